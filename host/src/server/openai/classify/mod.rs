//! vLLM's `/classify`: the request (`protocol`) and the handler
//! (`serving`).

pub mod protocol;
pub mod serving;

pub use serving::classify;
