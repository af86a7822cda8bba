//! Prompts without generation: `/tokenize`, `/detokenize` and the render
//! endpoints.

pub mod protocol;
pub mod serving;

pub use serving::{detokenize, render, tokenize};
