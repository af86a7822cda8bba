//! Pagoda: a multi-tenant LLM inference server.
//!
//! The crate is laid out along the path a request takes:
//! - [`tokenizer`]: text ⇄ token ids, incremental detokenization, chat templates;
//! - [`engine`]: model loading, the model runner, the KV-cache manager, the
//!   scheduler and the sampler;
//! - [`cli`]: the `pagoda` command line.

pub mod bench;
pub mod cli;
pub mod engine;
pub mod server;
pub mod tokenizer;
