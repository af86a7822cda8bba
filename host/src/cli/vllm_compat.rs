//! `vllm serve` flags that change nothing in Pagoda, and vLLM's underscore
//! spellings of long flags (`--max_model_len`), so that a vLLM command line
//! starts Pagoda as it is. Each accepted no-op flag gets one log line
//! naming it and saying why it changes nothing; flags that would change
//! results are refused elsewhere, never ignored.

use anyhow::{bail, Result};
use clap::Args;
use std::ffi::OsString;

/// The structured-output backends vLLM names; Pagoda's is llguidance
/// whichever is asked for.
pub const STRUCTURED_OUTPUT_BACKENDS: [&str; 5] = [
    "auto",
    "guidance",
    "xgrammar",
    "outlines",
    "lm-format-enforcer",
];

/// `vllm serve` flags accepted for compatibility.
#[derive(Args, Debug, Clone, Default)]
pub struct VllmNoopFlags {
    /// Accepted as vLLM takes it: Pagoda captures no CUDA graphs, so every
    /// step already runs eagerly.
    #[arg(long)]
    pub enforce_eager: bool,
    /// Accepted as vLLM takes it: Pagoda runs no code from model folders
    /// (architectures are built in; see `pagoda models`).
    #[arg(long)]
    pub trust_remote_code: bool,
    /// Accepted as vLLM takes it; the 10-second stats line (written only
    /// while requests run) and /metrics stay as they are.
    #[arg(long)]
    pub disable_log_stats: bool,
    /// Accepted as vLLM takes it: chunked prefill is always on in Pagoda.
    #[arg(long, overrides_with = "no_enable_chunked_prefill")]
    pub enable_chunked_prefill: bool,
    /// Accepted; chunked prefill stays on (it changes scheduling, not results).
    #[arg(long)]
    pub no_enable_chunked_prefill: bool,
    /// Accepted as vLLM takes it: Pagoda's engine schedules each step after
    /// the previous one finishes, which is what this asks for.
    #[arg(long, overrides_with = "async_scheduling")]
    pub no_async_scheduling: bool,
    /// Accepted; Pagoda schedules each step after the previous one finishes.
    #[arg(long)]
    pub async_scheduling: bool,
    /// CPU swap space per GPU in GiB, as vLLM takes it: accepted and
    /// unused, as Pagoda preempts by recompute and swaps nothing.
    #[arg(long, value_name = "GIB")]
    pub swap_space: Option<f64>,
    /// uvicorn's log level, as vLLM takes it: accepted and unused (Pagoda
    /// has no uvicorn; RUST_LOG sets its log level).
    #[arg(long, value_name = "LEVEL",
          value_parser = ["critical", "error", "warning", "info", "debug", "trace"])]
    pub uvicorn_log_level: Option<String>,
    /// The structured-output backend, as vLLM names it (auto, guidance,
    /// xgrammar, outlines, lm-format-enforcer): accepted; Pagoda's
    /// structured output is llguidance whichever is named.
    #[arg(long = "structured-outputs-config.backend", value_name = "BACKEND")]
    pub structured_outputs_backend: Option<String>,
    /// Accepted as vLLM takes it: responses always carry
    /// `usage.prompt_tokens_details.cached_tokens`.
    #[arg(long)]
    pub enable_prompt_tokens_details: bool,
    /// The path prefix a proxy strips before requests reach the server,
    /// as vLLM takes it: accepted; routes are served without it, as vLLM
    /// serves them.
    #[arg(long, value_name = "PATH")]
    pub root_path: Option<String>,
    /// Most `logprobs` / `top_logprobs` / `prompt_logprobs` a request may
    /// ask for, as vLLM takes it: 20 by default, -1 for no limit (a
    /// request's -1, the whole vocabulary, then passes). Requests over it
    /// get a 400.
    #[arg(long, value_name = "N", allow_negative_numbers = true)]
    pub max_logprobs: Option<i64>,
}

impl VllmNoopFlags {
    /// Refuses values that would change results (an unknown structured
    /// output backend, a logprobs limit other than Pagoda's), then logs one
    /// line for each accepted flag that changes nothing. Call after the
    /// log is set up.
    pub fn check_and_log(&self) -> Result<()> {
        if let Some(b) = &self.structured_outputs_backend {
            if !STRUCTURED_OUTPUT_BACKENDS.contains(&b.as_str()) {
                bail!(
                    "--structured-outputs-config.backend {b:?} is not a backend vLLM knows: use one of {}",
                    STRUCTURED_OUTPUT_BACKENDS.join(", ")
                );
            }
        }
        if let Some(n) = self.max_logprobs {
            if n < -1 {
                bail!("--max-logprobs {n}: give a non-negative count, or -1 for no limit");
            }
        }
        for line in self.log_lines() {
            tracing::info!("{line}");
        }
        Ok(())
    }

    /// The log line of each accepted flag that changes nothing.
    pub fn log_lines(&self) -> Vec<String> {
        let mut out = Vec::new();
        if self.enforce_eager {
            out.push("--enforce-eager: accepted; Pagoda captures no CUDA graphs, so every step already runs eagerly".to_string());
        }
        if self.trust_remote_code {
            out.push("--trust-remote-code: accepted; Pagoda runs no code from model folders (its architectures are built in: `pagoda models`)".to_string());
        }
        if self.disable_log_stats {
            out.push("--disable-log-stats: accepted; the stats line (every 10 s, only while requests run) is still written, and /metrics is unchanged".to_string());
        }
        if self.enable_chunked_prefill {
            out.push("--enable-chunked-prefill: accepted; chunked prefill is always on in Pagoda (chunks fit --max-num-batched-tokens)".to_string());
        }
        if self.no_enable_chunked_prefill {
            out.push("--no-enable-chunked-prefill: accepted; chunked prefill stays on in Pagoda (it changes how steps are scheduled, not the results)".to_string());
        }
        if self.no_async_scheduling {
            out.push("--no-async-scheduling: accepted; Pagoda's engine always schedules a step after the previous one finishes".to_string());
        }
        if self.async_scheduling {
            out.push("--async-scheduling: accepted; Pagoda's engine schedules each step after the previous one finishes (it changes timing, not results)".to_string());
        }
        if let Some(g) = self.swap_space {
            out.push(format!("--swap-space {g}: accepted; Pagoda swaps no KV to the CPU (preempted sequences are recomputed)"));
        }
        if let Some(l) = &self.uvicorn_log_level {
            out.push(format!("--uvicorn-log-level {l}: accepted; Pagoda has no uvicorn (RUST_LOG sets its log level)"));
        }
        if let Some(b) = &self.structured_outputs_backend {
            out.push(format!("--structured-outputs-config.backend {b}: accepted; Pagoda's structured output is llguidance whichever backend is named"));
        }
        if self.enable_prompt_tokens_details {
            out.push("--enable-prompt-tokens-details: accepted; usage always carries prompt_tokens_details.cached_tokens in Pagoda".to_string());
        }
        if let Some(p) = &self.root_path {
            out.push(format!("--root-path {p}: accepted; routes are served without the prefix (as vLLM serves them), for a proxy that strips it"));
        }
        match self.max_logprobs {
            Some(-1) => out.push("--max-logprobs -1: requests may ask for logprobs over the whole vocabulary (each token's answer can then be megabytes)".to_string()),
            Some(n) => out.push(format!("--max-logprobs {n}: requests asking for more logprobs per token get a 400")),
            None => {}
        }
        out
    }

    /// The logprobs limit requests meet: `--max-logprobs` (vLLM's default
    /// of 20 when not given), None for -1 (no limit).
    pub fn max_logprobs_limit(&self) -> Option<usize> {
        match self.max_logprobs {
            None => Some(crate::engine::request::MAX_LOGPROBS),
            Some(n) => usize::try_from(n).ok(),
        }
    }
}

/// vLLM's underscore spellings of long flags: `--max_model_len 2048` and
/// `--max_model_len=2048` become `--max-model-len …`. Only the flag's name
/// (before any `=`) of an argument starting with `--` is rewritten, never a
/// value, and nothing after a bare `--`.
pub fn dash_flag_names(args: Vec<OsString>) -> Vec<OsString> {
    let mut out = Vec::with_capacity(args.len());
    let mut flags_done = false;
    for a in args {
        if flags_done {
            out.push(a);
            continue;
        }
        let Some(s) = a.to_str() else {
            out.push(a);
            continue;
        };
        if s == "--" {
            flags_done = true;
            out.push(a);
            continue;
        }
        let Some(rest) = s.strip_prefix("--") else {
            out.push(a);
            continue;
        };
        let (name, value) = match rest.split_once('=') {
            Some((n, v)) => (n, Some(v)),
            None => (rest, None),
        };
        if !name.contains('_') {
            out.push(a);
            continue;
        }
        let mut flag = format!("--{}", name.replace('_', "-"));
        if let Some(v) = value {
            flag.push('=');
            flag.push_str(v);
        }
        out.push(flag.into());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strs(v: &[&str]) -> Vec<OsString> {
        v.iter().map(OsString::from).collect()
    }

    #[test]
    fn underscore_flag_names_get_dashes_and_values_do_not() {
        let got = dash_flag_names(strs(&[
            "pagoda",
            "serve",
            "my_model.gguf",
            "--max_model_len",
            "2048",
            "--served_model_name=my_model",
            "--served-model-name",
            "other_name",
            "--structured_outputs_config.backend",
            "lm-format-enforcer",
            "--chat-template=a_b",
            "--",
            "--not_a_flag",
        ]));
        assert_eq!(
            got,
            strs(&[
                "pagoda",
                "serve",
                "my_model.gguf",
                "--max-model-len",
                "2048",
                "--served-model-name=my_model",
                "--served-model-name",
                "other_name",
                "--structured-outputs-config.backend",
                "lm-format-enforcer",
                "--chat-template=a_b",
                "--",
                "--not_a_flag",
            ])
        );
    }

    #[test]
    fn underscore_spellings_parse_as_the_dashed_flags() {
        let args = dash_flag_names(strs(&[
            "pagoda",
            "serve",
            "m.gguf",
            "--max_model_len",
            "2048",
            "--gpu_memory_utilization=0.5",
            "--enforce_eager",
            "--swap_space",
            "4",
            "--structured_outputs_config.backend",
            "xgrammar",
        ]));
        let cli = crate::cli::Cli::try_parse_overridable(args).unwrap();
        let crate::cli::Command::Serve(s) = cli.command else {
            panic!("not serve");
        };
        assert_eq!(s.engine.max_model_len, Some(2048));
        assert_eq!(s.engine.gpu_memory_utilization, Some(0.5));
        assert!(s.vllm.enforce_eager);
        assert_eq!(s.vllm.swap_space, Some(4.0));
        assert_eq!(
            s.vllm.structured_outputs_backend.as_deref(),
            Some("xgrammar")
        );
    }

    #[test]
    fn each_noop_flag_has_a_log_line_naming_it() {
        let args = strs(&[
            "pagoda",
            "serve",
            "m.gguf",
            "--enforce-eager",
            "--trust-remote-code",
            "--disable-log-stats",
            "--enable-chunked-prefill",
            "--no-async-scheduling",
            "--swap-space",
            "4",
            "--uvicorn-log-level",
            "warning",
            "--structured-outputs-config.backend",
            "outlines",
            "--enable-prompt-tokens-details",
            "--root-path",
            "/api",
            "--max-logprobs",
            "20",
        ]);
        let cli = crate::cli::Cli::try_parse_overridable(args).unwrap();
        let crate::cli::Command::Serve(s) = cli.command else {
            panic!("not serve");
        };
        s.vllm.check_and_log().unwrap();
        let lines = s.vllm.log_lines().join("\n");
        for f in [
            "--enforce-eager",
            "--trust-remote-code",
            "--disable-log-stats",
            "--enable-chunked-prefill",
            "--no-async-scheduling",
            "--swap-space 4",
            "--uvicorn-log-level warning",
            "--structured-outputs-config.backend outlines",
            "--enable-prompt-tokens-details",
            "--root-path /api",
            "--max-logprobs 20",
        ] {
            assert!(lines.contains(f), "{f} not in {lines}");
        }
    }

    #[test]
    fn values_that_would_change_results_are_refused() {
        let f = VllmNoopFlags {
            structured_outputs_backend: Some("magic".into()),
            ..Default::default()
        };
        let e = f.check_and_log().unwrap_err().to_string();
        assert!(e.contains("lm-format-enforcer"), "{e}");
        let f = VllmNoopFlags {
            max_logprobs: Some(-2),
            ..Default::default()
        };
        let e = f.check_and_log().unwrap_err().to_string();
        assert!(e.contains("-1 for no limit"), "{e}");
        for (given, limit) in [(None, Some(20)), (Some(5), Some(5)), (Some(-1), None)] {
            let f = VllmNoopFlags {
                max_logprobs: given,
                ..Default::default()
            };
            assert_eq!(f.max_logprobs_limit(), limit, "{given:?}");
        }
        let args = strs(&["pagoda", "serve", "m.gguf", "--uvicorn-log-level", "loud"]);
        assert!(crate::cli::Cli::try_parse_overridable(args).is_err());
    }
}
