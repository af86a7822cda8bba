//! What the host offers a plugin: logging, the tenant's config and facts
//! about the request. There is no filesystem, network, clock or environment
//! beyond this.
//!
//! On targets other than `wasm32` these functions talk to a stand-in host
//! kept here, per thread, which `pagoda_sdk::testing` (native targets only)
//! sets up and inspects, so plugin code that calls them runs in native unit
//! tests.

use crate::{parse_json, Result};
use serde::de::DeserializeOwned;

/// Severity of a log line.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum LogLevel {
    /// Very detailed tracing.
    Trace,
    /// Debugging detail.
    Debug,
    /// Normal operation.
    Info,
    /// Something looks wrong.
    Warn,
    /// Something failed.
    Error,
}

/// Read-only facts about the request being served.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Facts {
    /// The tenant the request's API key belongs to.
    pub tenant_id: String,
    /// The request's id, as it appears in the response.
    pub request_id: String,
    /// The models this tenant may use, by served name.
    pub models: Vec<String>,
    /// Prompt tokens, once known (0 in `route` and `render_prompt`).
    pub prompt_tokens: u32,
    /// Tokens generated so far (0 before generation).
    pub completion_tokens: u32,
}

/// Writes one line to the server's log, tagged with the tenant and the
/// plugin. The host truncates lines longer than 4 KiB.
pub fn log(level: LogLevel, message: impl AsRef<str>) {
    imp::log(level, message.as_ref())
}

/// The plugin's configuration for this tenant as JSON text: `"{}"` when the
/// tenant gave none. The host has already validated it against the schema
/// in the plugin's [`Metadata`](crate::Metadata).
pub fn config_json() -> String {
    imp::config()
}

/// The plugin's configuration for this tenant, deserialized into `T`.
///
/// Give `T` `#[serde(default)]` fields so that the empty config `{}` works.
pub fn config<T: DeserializeOwned>() -> Result<T> {
    parse_json(&config_json(), "invalid plugin config")
}

/// The facts of the current request.
pub fn facts() -> Facts {
    imp::facts()
}

#[cfg(target_arch = "wasm32")]
mod imp {
    use super::{Facts, LogLevel};
    use crate::bindings::pagoda::plugin::host as wit;

    pub fn log(level: LogLevel, message: &str) {
        let level = match level {
            LogLevel::Trace => wit::LogLevel::Trace,
            LogLevel::Debug => wit::LogLevel::Debug,
            LogLevel::Info => wit::LogLevel::Info,
            LogLevel::Warn => wit::LogLevel::Warn,
            LogLevel::Error => wit::LogLevel::Error,
        };
        wit::log(level, message)
    }

    pub fn config() -> String {
        wit::config()
    }

    pub fn facts() -> Facts {
        let f = wit::facts();
        Facts {
            tenant_id: f.tenant_id,
            request_id: f.request_id,
            models: f.models,
            prompt_tokens: f.prompt_tokens,
            completion_tokens: f.completion_tokens,
        }
    }
}

/// The stand-in host of native targets: one per thread, so tests running
/// in parallel do not see each other's config or logs. [`crate::testing`]
/// sets it up and reads it back.
#[cfg(not(target_arch = "wasm32"))]
pub(crate) mod imp {
    use super::{Facts, LogLevel};
    use std::cell::RefCell;

    pub(crate) struct Host {
        pub(crate) config: String,
        pub(crate) facts: Facts,
        pub(crate) logs: Vec<(LogLevel, String)>,
    }

    impl Default for Host {
        /// Config `{}`, default facts, no logs.
        fn default() -> Host {
            Host {
                config: "{}".to_owned(),
                facts: Facts::default(),
                logs: Vec::new(),
            }
        }
    }

    thread_local! {
        pub(crate) static HOST: RefCell<Host> = RefCell::new(Host::default());
    }

    pub fn log(level: LogLevel, message: &str) {
        HOST.with(|h| h.borrow_mut().logs.push((level, message.to_owned())));
    }

    pub fn config() -> String {
        HOST.with(|h| h.borrow().config.clone())
    }

    pub fn facts() -> Facts {
        HOST.with(|h| h.borrow().facts.clone())
    }
}
