//! `--config FILE`: flags from a JSON object or a flat YAML mapping
//! (`key: value` lines), as `vllm serve --config` takes them. Keys are flag
//! names without the dashes (`max-model-len` or `max_model_len`); flags on
//! the command line win over the file.

use anyhow::{bail, Context, Result};
use std::ffi::OsString;
use std::path::Path;

/// Reads `path` into `--flag value` arguments.
pub fn flags_from_file(path: &Path) -> Result<Vec<OsString>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("{}: cannot read the config file", path.display()))?;
    let pairs: Vec<(String, serde_json::Value)> = if text.trim_start().starts_with('{') {
        let v: serde_json::Value = serde_json::from_str(&text)
            .with_context(|| format!("{}: not valid JSON", path.display()))?;
        let obj = v
            .as_object()
            .with_context(|| format!("{}: must be a JSON object of flags", path.display()))?;
        obj.iter().map(|(k, v)| (k.clone(), v.clone())).collect()
    } else {
        parse_flat_yaml(&text)
            .with_context(|| format!("{}: not a flat YAML mapping", path.display()))?
    };
    let mut out = Vec::new();
    for (key, value) in pairs {
        let flag = format!("--{}", key.replace('_', "-"));
        match value {
            serde_json::Value::Bool(true) => out.push(flag.into()),
            serde_json::Value::Bool(false) => {
                // `enable-prefix-caching: false` means the negative flag.
                if let Some(rest) = key.replace('_', "-").strip_prefix("enable-") {
                    out.push(format!("--no-enable-{rest}").into());
                }
            }
            serde_json::Value::Null => {}
            serde_json::Value::Array(items) => {
                out.push(flag.into());
                for i in items {
                    out.push(scalar(&i).into());
                }
            }
            v => {
                out.push(flag.into());
                out.push(scalar(&v).into());
            }
        }
    }
    Ok(out)
}

fn scalar(v: &serde_json::Value) -> String {
    match v {
        serde_json::Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

fn parse_flat_yaml(text: &str) -> Result<Vec<(String, serde_json::Value)>> {
    let mut out = Vec::new();
    for (n, raw) in text.lines().enumerate() {
        let line = raw.split(" #").next().unwrap_or("").trim_end();
        if line.trim().is_empty() || line.trim_start().starts_with('#') {
            continue;
        }
        if line.starts_with(' ') || line.starts_with('\t') {
            bail!(
                "line {}: nested values are not supported; use one `flag: value` per line",
                n + 1
            );
        }
        let (k, v) = line
            .split_once(':')
            .with_context(|| format!("line {}: expected `flag: value`", n + 1))?;
        let v = v.trim();
        let value = match v {
            "true" | "True" | "yes" => serde_json::Value::Bool(true),
            "false" | "False" | "no" => serde_json::Value::Bool(false),
            "" | "null" | "~" => serde_json::Value::Null,
            _ => serde_json::Value::String(v.trim_matches('"').trim_matches('\'').to_string()),
        };
        out.push((k.trim().to_string(), value));
    }
    Ok(out)
}

/// Expands `--config FILE` in `args`: the file's flags go right after the
/// subcommand, so flags given on the command line (later) override them.
pub fn expand(args: Vec<OsString>) -> Result<Vec<OsString>> {
    let Some(pos) = args.iter().position(|a| a == "--config") else {
        return Ok(args);
    };
    let path = args.get(pos + 1).context("--config needs a file")?.clone();
    let file_flags = flags_from_file(Path::new(&path))?;
    let mut rest: Vec<OsString> = args[..pos].to_vec();
    rest.extend(args[pos + 2..].iter().cloned());
    // args[0] is the program, args[1] the subcommand.
    let at = rest.len().min(2);
    let mut out: Vec<OsString> = rest[..at].to_vec();
    out.extend(file_flags);
    out.extend(rest[at..].iter().cloned());
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn yaml_and_json_give_the_same_flags() {
        let dir = tempfile::tempdir().unwrap();
        let y = dir.path().join("c.yaml");
        std::fs::write(&y, "# serve config\nmodel: /m.gguf\nmax_model_len: 2048\nenable-prefix-caching: false\nport: 9000\n").unwrap();
        let j = dir.path().join("c.json");
        std::fs::write(&j, r#"{"model": "/m.gguf", "max_model_len": 2048, "enable-prefix-caching": false, "port": 9000}"#).unwrap();
        let want: Vec<OsString> = [
            "--model",
            "/m.gguf",
            "--max-model-len",
            "2048",
            "--no-enable-prefix-caching",
            "--port",
            "9000",
        ]
        .iter()
        .map(OsString::from)
        .collect();
        assert_eq!(flags_from_file(&y).unwrap(), want);
        let mut jf = flags_from_file(&j).unwrap();
        // JSON objects come back in key order; compare as sets of pairs.
        jf.sort();
        let mut w = want.clone();
        w.sort();
        assert_eq!(jf, w);
    }

    #[test]
    fn command_line_flags_come_after_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let y = dir.path().join("c.yaml");
        std::fs::write(&y, "port: 9000\n").unwrap();
        let args: Vec<OsString> = [
            "pagoda",
            "serve",
            "--config",
            y.to_str().unwrap(),
            "--port",
            "8001",
        ]
        .iter()
        .map(OsString::from)
        .collect();
        let out = expand(args).unwrap();
        let s: Vec<String> = out
            .iter()
            .map(|a| a.to_string_lossy().to_string())
            .collect();
        assert_eq!(s, ["pagoda", "serve", "--port", "9000", "--port", "8001"]);
    }
}
