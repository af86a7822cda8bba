//! `pagoda bench`: offline throughput and single-stream latency on the
//! engine, with vLLM's workloads (datasets) and key names.

pub mod datasets;
pub mod latency;
pub mod serve;
pub mod stats;
pub mod throughput;
