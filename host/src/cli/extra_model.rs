//! `pagoda serve --extra-model SPEC`: one more model behind the same port
//! (an embedding model or a reranker beside a chat model), on an engine of
//! its own in the same process. SPEC is `NAME=PATH`, or a JSON object in
//! the manner of vLLM's JSON flags:
//! `{"model": PATH, "served_model_name": NAME or [NAMES], "runner":
//! "pooling", "convert": "embed", "pooler_config": {...}, ...}`.
//! What the object leaves out is the main model's setting where it is the
//! machine's (device, threads, dtype, KV-cache size and type, block size,
//! batching and scheduling) and the model's own default where it belongs
//! to the main model (its tokenizer, quantization, context length, runner,
//! pooler, speculative decoding, LoRA, KV-cache events).

use super::EngineFlags;
use crate::server::models::ExtraModel;
use anyhow::{bail, Context, Result};
use serde::Deserialize;
use serde_json::Value;
use std::path::PathBuf;

/// The JSON form's fields: a model's own settings.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct JsonSpec {
    model: PathBuf,
    served_model_name: Option<Names>,
    runner: Option<String>,
    convert: Option<String>,
    /// An object, or its JSON text.
    pooler_config: Option<Value>,
    /// An object, or its JSON text.
    hf_overrides: Option<Value>,
    tokenizer: Option<PathBuf>,
    quantization: Option<String>,
    dtype: Option<String>,
    max_model_len: Option<usize>,
    max_num_seqs: Option<usize>,
    max_num_batched_tokens: Option<usize>,
    /// "1GiB" or a number of bytes.
    kv_cache_memory: Option<Value>,
    gpu_memory_utilization: Option<f32>,
}

/// The keys [`JsonSpec`] takes, for the error that names an unknown one.
const KEYS: &str = "model, served_model_name, runner, convert, pooler_config, hf_overrides, tokenizer, quantization, dtype, max_model_len, max_num_seqs, max_num_batched_tokens, kv_cache_memory, gpu_memory_utilization";

#[derive(Deserialize)]
#[serde(untagged)]
enum Names {
    One(String),
    Many(Vec<String>),
}

/// A JSON field that is an object (sent on as its text) or that text.
fn json_text(v: Option<Value>) -> Option<String> {
    v.map(|v| match v {
        Value::String(s) => s,
        other => other.to_string(),
    })
}

/// The default served name of a model at `path`: its file name, as for the
/// main model.
fn default_name(path: &std::path::Path) -> String {
    path.file_name()
        .map(|n| n.to_string_lossy().to_string())
        .unwrap_or_else(|| path.display().to_string())
}

/// Reads one `--extra-model SPEC` against the main model's flags `main`.
pub fn parse(spec: &str, main: &EngineFlags, seed: Option<u64>) -> Result<ExtraModel> {
    let mut f = main.clone();
    // What belongs to the main model only.
    f.tokenizer = None;
    f.quantization = None;
    f.max_model_len = None;
    f.load_format = "auto".into();
    f.runner = "auto".into();
    f.convert = "auto".into();
    f.pooler_config = None;
    f.hf_overrides = None;
    f.speculative_config = None;
    f.speculative_model = None;
    f.num_speculative_tokens = None;
    f.kv_events_config = None;
    f.enable_lora = false;
    f.lora_modules = Vec::new();
    let names = if spec.trim_start().starts_with('{') {
        let j: JsonSpec = serde_json::from_str(spec).map_err(|e| {
            anyhow::anyhow!("--extra-model {spec}: {e} (the JSON form takes {KEYS})")
        })?;
        let names = match j.served_model_name {
            None => vec![default_name(&j.model)],
            Some(Names::One(n)) => vec![n],
            Some(Names::Many(n)) => n,
        };
        f.model = Some(j.model);
        f.tokenizer = j.tokenizer;
        f.quantization = j.quantization;
        f.max_model_len = j.max_model_len;
        f.runner = j.runner.unwrap_or(f.runner);
        f.convert = j.convert.unwrap_or(f.convert);
        f.pooler_config = json_text(j.pooler_config);
        f.hf_overrides = json_text(j.hf_overrides);
        f.dtype = j.dtype.unwrap_or(f.dtype);
        f.max_num_seqs = j.max_num_seqs.or(f.max_num_seqs);
        f.max_num_batched_tokens = j.max_num_batched_tokens.unwrap_or(f.max_num_batched_tokens);
        f.gpu_memory_utilization = j.gpu_memory_utilization.or(f.gpu_memory_utilization);
        match j.kv_cache_memory {
            None => {}
            Some(Value::String(s)) => f.kv_cache_memory = Some(s),
            Some(Value::Number(n)) if n.is_u64() => f.kv_cache_memory = Some(n.to_string()),
            Some(other) => bail!(
                "--extra-model {spec}: kv_cache_memory {other} is neither a size such as \"1GiB\" nor a number of bytes"
            ),
        }
        names
    } else {
        match spec.split_once('=') {
            Some((name, path)) if !name.is_empty() && !path.is_empty() => {
                f.model = Some(path.into());
                vec![name.to_string()]
            }
            _ => bail!(
                "--extra-model {spec}: expected NAME=PATH or a JSON object such as {{\"model\": PATH, \"served_model_name\": NAME, \"runner\": \"pooling\"}}"
            ),
        }
    };
    if names.is_empty() || names.iter().any(String::is_empty) {
        bail!("--extra-model {spec}: served_model_name needs at least one non-empty name");
    }
    let mut args = f
        .to_engine_args()
        .with_context(|| format!("--extra-model {spec}"))?;
    args.seed = seed;
    Ok(ExtraModel { names, args })
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    /// The main model's flags as `pagoda serve` would read them.
    fn main_flags(extra: &[&str]) -> EngineFlags {
        #[derive(Parser)]
        struct P {
            #[command(flatten)]
            f: EngineFlags,
        }
        let args = ["p", "--model", "/m/chat.gguf"].iter().chain(extra);
        P::parse_from(args).f
    }

    fn err(spec: &str) -> String {
        format!(
            "{:#}",
            parse(spec, &main_flags(&[]), None).err().expect(spec)
        )
    }

    #[test]
    fn name_equals_path_inherits_the_machine_settings_only() {
        let main = main_flags(&[
            "--threads",
            "3",
            "--dtype",
            "float32",
            "--kv-cache-memory",
            "64MiB",
            "--max-model-len",
            "2048",
            "--runner",
            "generate",
            "--speculative-config",
            r#"{"method": "ngram", "num_speculative_tokens": 2}"#,
        ]);
        let m = parse("embed=/m/bert", &main, Some(7)).expect("NAME=PATH");
        assert_eq!(m.names, ["embed"]);
        assert_eq!(m.args.model, PathBuf::from("/m/bert"));
        assert_eq!(m.args.threads, 3);
        assert_eq!(m.args.kv_cache_memory, Some(64 << 20));
        assert_eq!(m.args.seed, Some(7));
        assert_eq!(
            format!("{:?}", m.args.dtype),
            format!("{:?}", main.to_engine_args().unwrap().dtype)
        );
        // The main model's own settings stay with it.
        assert_eq!(m.args.max_model_len, None);
        assert!(m.args.speculative.is_none());
        assert_eq!(m.args.runner, crate::engine::pooling::RunnerKind::Auto);
    }

    #[test]
    fn the_json_form_sets_a_models_own_fields() {
        let m = parse(
            r#"{"model": "/m/qwen3", "served_model_name": ["emb", "emb-alias"], "runner": "pooling",
                "convert": "embed", "pooler_config": {"pooling_type": "LAST", "normalize": true},
                "max_model_len": 512, "max_num_seqs": 8, "kv_cache_memory": "32MiB"}"#,
            &main_flags(&["--max-num-seqs", "64"]),
            None,
        )
        .expect("JSON spec");
        assert_eq!(m.names, ["emb", "emb-alias"]);
        assert_eq!(m.args.model, PathBuf::from("/m/qwen3"));
        assert_eq!(m.args.max_model_len, Some(512));
        assert_eq!(m.args.max_num_seqs, 8);
        assert_eq!(m.args.kv_cache_memory, Some(32 << 20));
        let pooler: Value =
            serde_json::from_str(m.args.pooler_config.as_deref().expect("pooler")).expect("JSON");
        assert_eq!(pooler["pooling_type"], "LAST");
        assert_eq!(m.args.runner, crate::engine::pooling::RunnerKind::Pooling);
        // One name, and a name defaulting to the file name.
        let one = parse(
            r#"{"model": "/m/b", "served_model_name": "b1"}"#,
            &main_flags(&[]),
            None,
        )
        .expect("one name");
        assert_eq!(one.names, ["b1"]);
        let dflt = parse(r#"{"model": "/m/bge-small"}"#, &main_flags(&[]), None).expect("no name");
        assert_eq!(dflt.names, ["bge-small"]);
    }

    #[test]
    fn the_flag_repeated_or_given_several_values_adds_up() {
        let args = [
            "pagoda",
            "serve",
            "--extra-model",
            "a=/m/a",
            "--extra-model",
            "b=/m/b",
            r#"{"model": "/m/c"}"#,
            "--model",
            "/m/chat.gguf",
        ];
        let cli = crate::cli::Cli::try_parse_overridable(args.iter().map(Into::into).collect())
            .expect("flags");
        let crate::cli::Command::Serve(s) = cli.command else {
            panic!("not serve")
        };
        assert_eq!(s.extra_model, ["a=/m/a", "b=/m/b", r#"{"model": "/m/c"}"#]);
    }

    #[test]
    fn malformed_specs_are_refused_with_what_was_expected() {
        let e = err("/m/bert");
        assert!(e.contains("expected NAME=PATH or a JSON object"), "{e}");
        let e = err("=/m/bert");
        assert!(e.contains("expected NAME=PATH"), "{e}");
        let e = err("embed=");
        assert!(e.contains("expected NAME=PATH"), "{e}");
        let e = err(r#"{"model": "/m/b", "max_model_length": 5}"#);
        assert!(
            e.contains("unknown field `max_model_length`") && e.contains("max_model_len"),
            "{e}"
        );
        let e = err(r#"{"served_model_name": "x"}"#);
        assert!(e.contains("missing field `model`"), "{e}");
        let e = err(r#"{"model": "/m/b""#);
        assert!(e.contains("--extra-model"), "{e}");
        let e = err(r#"{"model": "/m/b", "served_model_name": []}"#);
        assert!(e.contains("at least one non-empty name"), "{e}");
        let e = err(r#"{"model": "/m/b", "kv_cache_memory": -1}"#);
        assert!(e.contains("kv_cache_memory -1"), "{e}");
        // Values the engine flags refuse are refused here too, the spec named.
        let e = err(r#"{"model": "/m/b", "runner": "train"}"#);
        assert!(e.contains("--extra-model") && e.contains("train"), "{e}");
    }
}
