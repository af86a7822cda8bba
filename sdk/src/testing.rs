//! A stand-in host for native unit tests (every target but `wasm32`).
//!
//! Each test thread has its own host, so tests running in parallel do not
//! see each other's config or logs. It starts with config `{}`, default
//! [`Facts`] and no logs.
//!
//! ```
//! use pagoda_sdk::host::{self, LogLevel};
//! use pagoda_sdk::testing;
//!
//! testing::set_config(pagoda_sdk::json!({"tag": " [v1]"}));
//! host::log(LogLevel::Info, "hello");
//! assert_eq!(host::config_json(), r#"{"tag":" [v1]"}"#);
//! assert_eq!(testing::take_logs(), vec![(LogLevel::Info, "hello".to_owned())]);
//! ```

use crate::host::imp::{Host, HOST};
use crate::host::{Facts, LogLevel};

/// Sets the config that [`host::config`](crate::host::config) returns.
pub fn set_config(config: serde_json::Value) {
    HOST.with(|h| h.borrow_mut().config = config.to_string());
}

/// Sets the facts that [`host::facts`](crate::host::facts) returns.
pub fn set_facts(facts: Facts) {
    HOST.with(|h| h.borrow_mut().facts = facts);
}

/// Returns and clears the lines logged so far on this thread.
pub fn take_logs() -> Vec<(LogLevel, String)> {
    HOST.with(|h| std::mem::take(&mut h.borrow_mut().logs))
}

/// Puts this thread's stand-in host back to its initial state and starts a
/// new request (see [`new_request`]).
pub fn reset() {
    HOST.with(|h| *h.borrow_mut() = Host::default());
    new_request();
}

/// Ends the current "request": drops the plugin value that
/// [`Adapter`](crate::Adapter)'s hooks created on this thread, so the next
/// hook call starts from `Default` as on a fresh instance.
pub fn new_request() {
    crate::instance::reset_instance();
}
