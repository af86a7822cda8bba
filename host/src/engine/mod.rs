//! The inference engine, split by responsibility as in vLLM v1:
//! - [`scheduler`]: which sequences run each step, and how many tokens;
//!   its decisions go to the runner as plain data ([`scheduler_output`]);
//! - [`fair_share`]: weighted fair share and priority classes between
//!   tenants, which the scheduler's default policy orders by;
//! - [`kv_cache`]: the block pool, block tables and prefix hashes;
//! - [`kv_events`]: the prefix cache's events published over ZeroMQ for
//!   prefix-aware routers (`--kv-events-config`);
//! - [`runner`]: owns the batch (a row per running request: sampling
//!   parameters, random stream, drafts), lays each step out, runs it
//!   through the model on any device ([`pagoda_accel::Backend`]), samples
//!   and proposes drafts; what it sampled goes back as plain data
//!   ([`runner_output`]);
//! - [`sampler`]: logits → next token, and the verification of drafts;
//! - [`spec_decode`]: speculative decoding's configuration and proposers
//!   (prompt lookup, the draft model);
//! - [`structured_output`]: grammars (JSON schema, regex, choice, Lark)
//!   that mask the logits before sampling;
//! - [`core_output`]: what the core returns each step: token ids, logprobs
//!   and the token-level stops (EOS, stop ids, grammar, length);
//! - [`output_processor`]: in the front end, off the engine thread: token
//!   ids → detokenized text, stop strings, and the outputs clients see;
//! - [`core`]: the step loop tying them together: schedule → execute
//!   (run and sample) → update, each part visited once;
//! - [`models`] and [`loader`]: model definitions and weight formats;
//! - [`generation_config`]: sampling defaults from `generation_config.json`;
//! - [`llm`]: the offline `LLM` API.

pub mod args;
pub mod async_engine;
pub mod config;
pub mod core;
pub mod core_output;
pub mod fair_share;
pub mod generation_config;
pub mod kv_cache;
pub mod kv_events;
pub mod llm;
pub mod loader;
pub mod lora;
pub mod models;
pub mod output_processor;
pub mod pooling;
pub mod request;
pub mod runner;
pub mod runner_output;
pub mod sampler;
pub mod scheduler;
pub mod scheduler_output;
pub mod spec_decode;
pub mod structured_output;

pub use args::{build_engine, EngineArgs};
pub use generation_config::GenerationConfigSource;
pub use llm::{CompletionOutput, Prompt, RequestOutput, LLM};
pub use request::{FinishReason, SamplingDefaults, SamplingParams};
