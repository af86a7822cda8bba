//! # pagoda-sdk: Pagoda plugins in plain Rust
//!
//! A Pagoda plugin is a WebAssembly component (target `wasm32-wasip2`)
//! implementing the world `pagoda:plugin/plugin@0.1.0` (`sdk/wit/pagoda.wit`).
//! The server instantiates it once per request and calls its hooks:
//!
//! | hook | when | may |
//! | --- | --- | --- |
//! | [`Plugin::route`] | first, with the client's request | pass, rewrite it, or reject it |
//! | [`Plugin::render_prompt`] | chat requests, before tokenization | render the messages into the prompt |
//! | [`Plugin::on_chunk`] | each streamed piece of text | change or hold back text |
//! | [`Plugin::post_process`] | the whole text of a non-streamed choice | change it, or fail |
//!
//! With this crate a plugin author implements the [`Plugin`] trait, lists
//! the hooks in [`Plugin::metadata`], and calls [`export_plugin!`]; the SDK
//! generates the WIT bindings, returns the ABI version, converts JSON to
//! typed values and back, and keeps the plugin's per-request state.
//!
//! ## A complete plugin
//!
//! This is `examples/plugins/starter`: it prefixes a system prompt to chat
//! requests and logs the model that was asked for.
//!
//! ```no_run
#![doc = include_str!("../../examples/plugins/starter/src/lib.rs")]
//! ```
//!
//! Its `Cargo.toml` needs only the SDK, serde (for the config type) and a
//! `cdylib` crate type (so the component exports the hooks):
//!
//! ```toml
//! [lib]
//! crate-type = ["cdylib"]
//!
//! [dependencies]
//! pagoda-sdk = { path = "../../../sdk" }
//! serde = { version = "1", features = ["derive"] }
//! ```
//!
//! `cargo build --target wasm32-wasip2 --release` then writes the component
//! to `target/wasm32-wasip2/release/<crate>.wasm`; Rust's wasm32-wasip2
//! output already is a component, so no post-processing step is needed.
//!
//! ## State
//!
//! The host creates a fresh instance for every request, and every hook of
//! that request runs on it. The SDK therefore creates one value of the
//! plugin type (with [`Default`]) on the first hook call of an instance and
//! hands the same `&mut self` to every later hook: fields of the plugin
//! type *are* per-request state (e.g. [`Plugin::on_chunk`]'s held-back text
//! per choice). Nothing survives the request, and nothing is shared with
//! other requests or tenants.
//!
//! ## Errors
//!
//! Hooks return [`Result`], whose [`Error`] converts from anything that
//! implements `Display` (so `?` works on `String`, `&str`, serde and
//! template errors alike). What an error does depends on the hook: in
//! `route` it rejects the request with status 500, in `render_prompt` the
//! host answers 400, in `post_process` 500. `on_chunk` cannot fail.
//! A panic traps the instance and the host fails the request.
//!
//! ## Testing natively
//!
//! On any target other than `wasm32` the SDK compiles without the WIT
//! bindings: [`export_plugin!`] only checks that the type implements
//! [`Plugin`], and the [`host`] functions talk to a stand-in host that
//! tests set up through `pagoda_sdk::testing` (native targets only). So a
//! plugin's `#[cfg(test)]` unit tests run with `cargo test` on the
//! developer's machine, calling the hooks as ordinary methods (or through
//! `Adapter`, exactly as the host calls them, JSON included).

#![warn(missing_docs)]

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

// Lets the generated bindings and the exported macros name this crate as
// `::pagoda_sdk` both from inside it and from plugin crates.
extern crate self as pagoda_sdk;

/// The ABI this SDK implements: 1 for `pagoda:plugin@0.1.0`.
pub const ABI_VERSION: u32 = 1;

#[cfg(target_arch = "wasm32")]
#[doc(hidden)]
pub mod bindings {
    //! The generated WIT bindings. Plugin authors never use them directly:
    //! [`export_plugin!`](crate::export_plugin) wires a [`Plugin`](crate::Plugin)
    //! to them.
    wit_bindgen::generate!({
        path: "wit",
        world: "plugin",
        // The export macro is used by plugin crates, not by the SDK itself.
        pub_export_macro: true,
        export_macro_name: "__export_pagoda_world",
        default_bindings_module: "::pagoda_sdk::bindings",
    });
}

mod error;
mod glue;
pub mod host;
mod instance;
mod request;
#[cfg(not(target_arch = "wasm32"))]
pub mod testing;

pub use error::{Error, Result};
pub use request::{RouteRequest, CHAT_COMPLETIONS, COMPLETIONS};
// Re-exported so plugins can build schemas and bodies without naming their
// own serde_json version.
pub use serde_json::{self, json};

#[doc(hidden)]
pub use glue::Adapter;

/// A hook the host may call. A plugin lists the ones it implements in
/// [`Metadata::hooks`]; the host calls only those.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Hook {
    /// [`Plugin::route`].
    Route,
    /// [`Plugin::render_prompt`].
    RenderPrompt,
    /// [`Plugin::on_chunk`].
    OnChunk,
    /// [`Plugin::post_process`].
    PostProcess,
}

/// What a plugin says about itself; the host reads it once, at upload.
///
/// Start from [`metadata!`], which fills in the crate's name and version:
///
/// ```
/// use pagoda_sdk::{metadata, Hook, Metadata};
/// let m: Metadata = metadata!()
///     .hooks([Hook::Route])
///     .config_schema(pagoda_sdk::json!({"type": "object"}));
/// assert_eq!(m.hooks, vec![Hook::Route]);
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Metadata {
    /// Short name, e.g. `"redact"`.
    pub name: String,
    /// The plugin's own version (semver), shown by the admin API.
    pub version: String,
    /// The hooks it implements.
    pub hooks: Vec<Hook>,
    /// A JSON Schema for the plugin's config, as JSON text. Empty means the
    /// plugin takes no config (the host accepts only `{}`).
    pub config_schema: String,
}

impl Metadata {
    /// Metadata with a name and version, no hooks and no config.
    pub fn new(name: impl Into<String>, version: impl Into<String>) -> Metadata {
        Metadata {
            name: name.into(),
            version: version.into(),
            hooks: Vec::new(),
            config_schema: String::new(),
        }
    }

    /// Sets the hooks the plugin implements.
    pub fn hooks(mut self, hooks: impl IntoIterator<Item = Hook>) -> Metadata {
        self.hooks = hooks.into_iter().collect();
        self
    }

    /// Sets the JSON Schema its config must satisfy.
    pub fn config_schema(mut self, schema: Value) -> Metadata {
        self.config_schema = schema.to_string();
        self
    }

    /// Replaces the name (e.g. when several crates build versions of one
    /// plugin).
    pub fn name(mut self, name: impl Into<String>) -> Metadata {
        self.name = name.into();
        self
    }
}

/// [`Metadata`] named after the calling crate (`CARGO_PKG_NAME`) at its
/// version (`CARGO_PKG_VERSION`), with no hooks and no config yet.
///
/// A macro rather than a function so that `env!` reads the plugin crate's
/// manifest, not the SDK's.
#[macro_export]
macro_rules! metadata {
    () => {
        $crate::Metadata::new(env!("CARGO_PKG_NAME"), env!("CARGO_PKG_VERSION"))
    };
}

/// A rejection: the request ends with this HTTP status and message, sent to
/// the client as an OpenAI error (`code` `"plugin_rejected"`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rejection {
    /// 400–599; the host takes anything else as 400.
    pub status: u16,
    /// Shown to the client.
    pub message: String,
}

/// What [`Plugin::route`] decides.
#[derive(Clone, Debug, PartialEq)]
pub enum RouteDecision {
    /// Go on with the request unchanged.
    Continue,
    /// End the request with an error for the client.
    Reject(Rejection),
    /// Go on with this OpenAI request body instead of the client's. The host
    /// validates it again as if the client had sent it. (The body only: the
    /// endpoint cannot change.)
    Modify(Value),
}

impl RouteDecision {
    /// [`RouteDecision::Reject`] with `status` and `message`.
    pub fn reject(status: u16, message: impl Into<String>) -> RouteDecision {
        RouteDecision::Reject(Rejection {
            status,
            message: message.into(),
        })
    }

    /// [`RouteDecision::Modify`] with the body of `request`.
    pub fn modify(request: RouteRequest) -> RouteDecision {
        RouteDecision::Modify(request.body)
    }
}

/// A Pagoda plugin. Implement the hooks you need (the defaults pass
/// everything through), list them in [`metadata`](Plugin::metadata), and
/// export the type with [`export_plugin!`].
///
/// The value is created with [`Default`] on the first hook call of a
/// request and lives until the request ends, so fields hold per-request
/// state (see the crate docs).
pub trait Plugin: Default + 'static {
    /// The plugin's name, version, hooks and config schema. Usually
    /// `metadata!().hooks([...]).config_schema(json!({...}))`.
    fn metadata() -> Metadata;

    /// First hook of a request: look at the client's request and let it
    /// through, rewrite it or reject it. An `Err` rejects the request with
    /// status 500 and the error's message (and logs it), because it means
    /// the plugin, not the client, failed.
    fn route(&mut self, request: RouteRequest) -> Result<RouteDecision> {
        let _ = request;
        Ok(RouteDecision::Continue)
    }

    /// Renders a chat request's messages into the prompt. `request` is the
    /// (possibly modified) chat request body; `template` is the model's own
    /// chat template, if it has one. `Ok(None)` leaves rendering to the
    /// model's template; `Err` fails the request with a 400.
    fn render_prompt(
        &mut self,
        request: Value,
        template: Option<String>,
    ) -> Result<Option<String>> {
        let _ = (request, template);
        Ok(None)
    }

    /// Transforms streamed text of choice `choice`: returns what to send to
    /// the client now, and may hold text back for later. With `finish` the
    /// piece is the last (possibly empty) and everything still held for the
    /// choice must be returned.
    fn on_chunk(&mut self, choice: u32, text: String, finish: bool) -> String {
        let _ = (choice, finish);
        text
    }

    /// Transforms the complete text of one choice of a non-streamed
    /// response; `Err` fails the request with a 500.
    fn post_process(&mut self, choice: u32, text: String) -> Result<String> {
        let _ = choice;
        Ok(text)
    }
}

/// Exports a [`Plugin`] as the component's implementation of the
/// `pagoda:plugin` world. Use it once, at the top level of the plugin
/// crate:
///
/// ```ignore
/// pagoda_sdk::export_plugin!(MyPlugin);
/// ```
///
/// On targets other than `wasm32` it only checks that the type implements
/// [`Plugin`], so the crate still compiles (and tests) natively.
#[macro_export]
macro_rules! export_plugin {
    ($plugin:ty) => {
        #[cfg(target_arch = "wasm32")]
        const _: () = {
            // The generated export macro takes a type name, not a path
            // with generics, hence the alias.
            type __PagodaExport = $crate::Adapter<$plugin>;
            $crate::bindings::__export_pagoda_world!(
                __PagodaExport with_types_in $crate::bindings
            );
        };
        #[cfg(not(target_arch = "wasm32"))]
        const _: () = {
            fn __pagoda_assert_plugin<P: $crate::Plugin>() {}
            let _ = __pagoda_assert_plugin::<$plugin>;
        };
    };
}

/// Merges `value` into the JSON object `target` under `key`, turning
/// `target` into an object first if it is not one. Used by the request
/// helpers.
fn set_key(target: &mut Value, key: &str, value: Value) {
    if !target.is_object() {
        *target = Value::Object(Map::new());
    }
    if let Value::Object(map) = target {
        map.insert(key.to_owned(), value);
    }
}

/// Parses JSON text into `T`, with an error naming `what`.
fn parse_json<T: DeserializeOwned>(text: &str, what: &str) -> Result<T> {
    serde_json::from_str(text).map_err(|e| Error::msg(format!("{what}: {e}")))
}
