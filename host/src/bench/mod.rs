//! `pagoda bench`: offline throughput and single-stream latency on the
//! engine, with vLLM's workloads (datasets) and key names; and the
//! machine's read bandwidth, the ceiling decode works against.

pub mod bandwidth;
pub mod datasets;
pub mod latency;
pub mod serve;
pub mod stats;
pub mod throughput;
