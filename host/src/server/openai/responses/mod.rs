//! `/v1/responses`: the request read into a chat request (`protocol`),
//! the stored responses (`store`) and the handlers (`serving`).

pub mod protocol;
pub mod serving;
pub mod store;

pub use serving::{cancel, delete, input_items, render, responses, retrieve};
pub use store::ResponseStore;
