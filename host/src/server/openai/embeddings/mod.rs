//! `/v1/embeddings`, vLLM's `/pooling` and Cohere's `/v2/embed`: the
//! requests (`protocol`) and the handler (`serving`).

pub mod protocol;
pub mod serving;

pub use protocol::PoolingRoute;
pub use serving::embeddings;
