//! Model definitions and loading. One definition per architecture family,
//! written against `pagoda_accel` operations with no backend code inside.

pub mod llama;

pub use llama::{LlamaModel, Workspace};
