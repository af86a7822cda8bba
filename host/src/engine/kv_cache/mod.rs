//! The KV-cache manager: one pool of fixed-size blocks per device context,
//! a block table per sequence, and hash-based prefix caching.
//!
//! - [`dtype`] names the cache's element type; the K/V tensors themselves
//!   live on the device, in the backend's pool.
//! - [`block_pool`] owns block ids: reference counts, the LRU free queues
//!   (per tenant with a KV-cache reservation or cap) and the prefix-hash
//!   map.
//! - [`manager`] maps requests to block tables and decides which prompt
//!   blocks are already cached.
//! - [`state_checkpoints`] files a hybrid model's recurrent state at block
//!   boundaries, so prefix-cache hits restore it.
//! - [`events`] tells what enters and leaves the prefix cache, as vLLM's
//!   KV-cache events do, for prefix-aware routers.

pub mod block_pool;
pub mod dtype;
pub mod events;
pub mod manager;
pub mod state_checkpoints;

pub use block_pool::{BlockHash, BlockPool, OwnerLimits, OwnerUsage, SHARED_OWNER};
pub use dtype::KvCacheDtype;
pub use events::KvEvent;
pub use manager::{CacheKey, KvCacheManager, PrefixHit, PrefixStats};
