//! Pagoda: a multi-tenant LLM inference server.
//!
//! The crate is laid out along the path a request takes:
//! - [`tokenizer`]: text ⇄ token ids, incremental detokenization, chat templates;
//! - [`engine`]: model loading, the model runner, the KV-cache manager, the
//!   scheduler and the sampler;
//! - [`tenants`] and [`plugins`]: per-tenant keys, limits and WASM plugin chains;
//! - [`cli`]: the `pagoda` command line.

pub mod bench;
pub mod cli;
pub mod digest;
pub mod engine;
pub mod metering;
pub mod object_url;
pub mod plugins;
pub mod server;
pub mod tenants;
pub mod tokenizer;
