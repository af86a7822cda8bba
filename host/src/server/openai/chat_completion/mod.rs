//! `/v1/chat/completions` (and vLLM's batch of conversations): its
//! request (`protocol`), the rendering of a chat into a prompt (`prompt`,
//! shared with the other chat-shaped endpoints) and its handlers
//! (`serving`).

pub mod prompt;
pub mod protocol;
pub mod serving;

pub use serving::{chat, chat_batch};
