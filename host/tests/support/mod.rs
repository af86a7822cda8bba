//! Helpers shared by integration tests that need a model on disk but not the
//! (large) demo model: [`tiny_model`] writes tiny random Llama/Qwen2 models
//! as Hugging Face folders and GGUF files, and [`reference`] computes
//! their logits in f64 and drives the engine's model over them.

#![allow(dead_code)]

pub mod batching;
pub mod chi2;
pub mod fixtures;
pub mod hf_to_gguf;
pub mod reference;
pub mod tiny_model;
pub mod transformers_reference;
