//! `/v1/completions`: its request (`protocol`) and handler (`serving`).

pub mod protocol;
pub mod serving;

pub use serving::completions;
