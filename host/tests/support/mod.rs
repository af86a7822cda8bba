//! Helpers shared by integration tests that need a model on disk but not the
//! (large) demo model: [`tiny_model`] writes tiny random Llama/Qwen2 models
//! as Hugging Face folders and GGUF files.

#![allow(dead_code)]

pub mod tiny_model;
