//! Built-in plugin `redact` (hooks: `on-chunk`, `post-process`).
//!
//! Replaces e-mail addresses, phone numbers and the tenant's own patterns
//! in generated text. Config (every field optional):
//!
//! ```json
//! {"patterns": ["regex", "..."], "replacement": "[REDACTED]",
//!  "emails": true, "phones": true}
//! ```
//!
//! Streamed text is redacted exactly as the same text would be in one
//! piece: [`redactor::Stream`] holds back the tail of a piece while it could
//! still be, or become, part of a match, and releases it once the next
//! pieces decide it (or at the end of the choice). Patterns use Rust
//! `regex` syntax; see [`redactor`] for the built-in ones.

pub mod redactor;

use pagoda_sdk::host::{self, LogLevel};
use pagoda_sdk::{metadata, Hook, Metadata, Plugin, Result};
use redactor::{Config, Redactor, Stream};
use std::collections::HashMap;

/// The plugin: the compiled patterns and, per choice, the text held back.
#[derive(Default)]
pub struct Redact {
    redactor: Option<Redactor>,
    streams: HashMap<u32, Stream>,
}

impl Redact {
    /// The redactor for this request's config, compiled on first use.
    fn redactor(&mut self) -> Result<&Redactor> {
        if self.redactor.is_none() {
            let config: Config = host::config()?;
            self.redactor = Some(Redactor::new(&config)?);
        }
        Ok(self.redactor.as_ref().expect("just set"))
    }
}

impl Plugin for Redact {
    fn metadata() -> Metadata {
        metadata!()
            .hooks([Hook::OnChunk, Hook::PostProcess])
            .config_schema(redactor::schema())
    }

    fn on_chunk(&mut self, choice: u32, text: String, finish: bool) -> String {
        if let Err(e) = self.redactor() {
            // on-chunk has no error channel, and passing text through
            // unredacted would leak what the tenant asked to hide: fail
            // closed by trapping, which fails the request.
            let message = format!("redact: cannot use config: {}", e.message());
            host::log(LogLevel::Error, &message);
            panic!("{message}");
        }
        let redactor = self.redactor.as_ref().expect("checked above");
        let stream = self.streams.entry(choice).or_default();
        let out = stream.push(redactor, &text, finish);
        if finish {
            self.streams.remove(&choice);
        }
        out
    }

    fn post_process(&mut self, _choice: u32, text: String) -> Result<String> {
        Ok(self.redactor()?.redact(&text))
    }
}

pagoda_sdk::export_plugin!(Redact);

#[cfg(test)]
mod tests {
    use super::*;
    use pagoda_sdk::{json, testing};

    #[test]
    fn hooks_with_config() {
        testing::reset();
        testing::set_config(json!({"patterns": ["(?i)project x"], "replacement": "***"}));
        let mut p = Redact::default();
        assert_eq!(
            p.post_process(0, "Mail a@b.io about Project X".into())
                .unwrap(),
            "Mail *** about ***"
        );
        // Two interleaved streamed choices keep separate buffers.
        let mut out = [String::new(), String::new()];
        for (choice, piece) in [
            (0, "write to bo"),
            (1, "call +1 555"),
            (0, "b@exa"),
            (1, " 123 4567 now"),
        ] {
            out[choice as usize] += &p.on_chunk(choice, piece.into(), false);
        }
        out[0] += &p.on_chunk(0, "mple.com!".into(), true);
        out[1] += &p.on_chunk(1, String::new(), true);
        assert_eq!(out, ["write to ***!", "call *** now"]);
    }

    #[test]
    fn bad_config_fails_post_process() {
        testing::reset();
        testing::set_config(json!({"patterns": ["("]}));
        let err = Redact::default().post_process(0, "x".into()).unwrap_err();
        assert!(err.message().contains("pattern"), "{}", err.message());
    }
}
