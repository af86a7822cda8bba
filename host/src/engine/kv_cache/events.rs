//! What happens to the prefix cache, told the way vLLM's KV-cache events
//! tell it (`vllm/distributed/kv_events.py`), so that a prefix-aware router
//! (the Gateway API Inference Extension's endpoint picker in llm-d) can
//! track which replica holds which prompt prefixes.
//!
//! A block is *stored* when it enters the prefix cache (every slot
//! computed, [`super::KvCacheManager::commit`]) and *removed* when the pool
//! hands it out again, evicting it. Only the canonical copy of a hash is
//! reported, so every removal matches an earlier store.
//!
//! The wire form is msgpack arrays, as msgspec writes vLLM's array-like
//! tagged structs: a batch is `[ts, [event, ...], dp_rank]`, and an event
//! is `["BlockStored", block_hashes, parent_block_hash, token_ids,
//! block_size, lora_id, medium, lora_name, extra_keys]`,
//! `["BlockRemoved", block_hashes, medium]` or `["AllBlocksCleared"]`.

use serde::Serialize;

/// Where the blocks live, in vLLM's words: the engine's own KV pool
/// (device memory, or host memory for the CPU backend) is its first tier.
pub const MEDIUM: &str = "GPU";

/// One change to the prefix cache.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KvEvent {
    /// Consecutive blocks of one sequence entered the cache.
    BlockStored {
        /// One hash per block, in order.
        block_hashes: Vec<u64>,
        /// The hash of the block before the first, if it has one.
        parent_block_hash: Option<u64>,
        /// The blocks' tokens, back to back.
        token_ids: Vec<u32>,
        block_size: usize,
        /// Per block: what besides the tokens went into its hash. Block 0
        /// of a sequence carries its cache salt (the tenant and any
        /// `cache_salt`), so a router keeps tenants apart too.
        extra_keys: Vec<Option<Vec<String>>>,
    },
    /// Blocks were evicted.
    BlockRemoved { block_hashes: Vec<u64> },
    /// The whole cache was dropped.
    AllBlocksCleared,
}

/// The wire form of a block hash: Pagoda's hashes are 128 bits; routers
/// key blocks by 64-bit integers (vLLM's legacy `ExternalBlockHash`).
pub fn external_hash(h: super::block_pool::BlockHash) -> u64 {
    (h.0 >> 64) as u64 ^ h.0 as u64
}

/// The text form of a cache salt in `extra_keys`.
pub fn salt_key(salt: u64) -> String {
    format!("{salt:016x}")
}

impl Serialize for KvEvent {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let none = Option::<String>::None;
        match self {
            KvEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                extra_keys,
            } => (
                "BlockStored",
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                Option::<i64>::None, // lora_id
                MEDIUM,
                none, // lora_name
                extra_keys,
            )
                .serialize(s),
            KvEvent::BlockRemoved { block_hashes } => {
                ("BlockRemoved", block_hashes, MEDIUM).serialize(s)
            }
            KvEvent::AllBlocksCleared => ("AllBlocksCleared",).serialize(s),
        }
    }
}

/// Encodes one batch of events: `[ts, events, dp_rank]`.
pub fn encode_batch(
    ts: f64,
    events: &[KvEvent],
    dp_rank: i64,
) -> Result<Vec<u8>, rmp_serde::encode::Error> {
    rmp_serde::to_vec(&(ts, events, dp_rank))
}
