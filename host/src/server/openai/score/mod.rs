//! vLLM's `/score` and the rerank routes: the requests (`protocol`) and
//! the handler (`serving`).

pub mod protocol;
pub mod serving;

pub use protocol::ScoreRoute;
pub use serving::score;
