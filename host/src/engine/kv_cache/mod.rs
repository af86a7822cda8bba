//! The KV-cache manager: one pool of fixed-size blocks per device context,
//! a block table per sequence, and hash-based prefix caching.
//!
//! - [`storage`] holds the K/V tensors themselves, per layer.
//! - [`block_pool`] owns block ids: reference counts, the LRU free queue and
//!   the prefix-hash map.
//! - [`manager`] maps requests to block tables and decides which prompt
//!   blocks are already cached.

pub mod block_pool;
pub mod manager;
pub mod storage;

pub use block_pool::{BlockHash, BlockPool};
pub use manager::{CacheKey, KvCacheManager, PrefixStats};
pub use storage::{KvCache, KvCacheDtype};
