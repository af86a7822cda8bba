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
//! The wire form ([`WireFormat`]) is msgpack as msgspec writes vLLM's
//! structs. vLLM 0.32 (PR #42892) writes maps: a batch is `{"ts",
//! "events", "data_parallel_rank"}` and an event a map tagged by `"type"`:
//! `{"type": "BlockStored", "block_hashes", "parent_block_hash",
//! "token_ids", "block_size", "lora_id", "medium", "lora_name",
//! "extra_keys"}`, `{"type": "BlockRemoved", "block_hashes", "medium"}` or
//! `{"type": "AllBlocksCleared"}` (fields at their default, which msgspec
//! omits, are left out). Older vLLM wrote positional arrays, which
//! consumers built for it still expect: a batch `[ts, [event, ...],
//! dp_rank]`, an event `["BlockStored", block_hashes, parent_block_hash,
//! token_ids, block_size, lora_id, medium, lora_name, extra_keys]`,
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
        /// Per block: what besides the tokens went into its hash, as vLLM
        /// lists it: the LoRA adapter's name on every block of an adapted
        /// sequence, then, on block 0, its cache salt (the tenant and any
        /// `cache_salt`), so a router keeps adapters and tenants apart too.
        extra_keys: Vec<Option<Vec<String>>>,
        /// The LoRA adapter the blocks were computed under: its id and
        /// name (vLLM's `lora_id` and `lora_name`).
        lora: Option<(u32, String)>,
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

/// How batches are written on the wire (`--kv-events-config`'s
/// `wire_format`, Pagoda's own key).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum WireFormat {
    /// Tagged maps, as vLLM 0.32 writes and decodes them.
    #[default]
    Map,
    /// Positional arrays, as vLLM before 0.32 wrote them.
    Array,
}

/// An event in the map form.
struct AsMap<'a>(&'a KvEvent);

impl Serialize for AsMap<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        match self.0 {
            KvEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                extra_keys,
                lora,
            } => {
                let mut m = s.serialize_map(Some(9))?;
                m.serialize_entry("type", "BlockStored")?;
                m.serialize_entry("block_hashes", block_hashes)?;
                m.serialize_entry("parent_block_hash", parent_block_hash)?;
                m.serialize_entry("token_ids", token_ids)?;
                m.serialize_entry("block_size", block_size)?;
                m.serialize_entry("lora_id", &lora.as_ref().map(|l| l.0))?;
                m.serialize_entry("medium", MEDIUM)?;
                m.serialize_entry("lora_name", &lora.as_ref().map(|l| &l.1))?;
                m.serialize_entry("extra_keys", extra_keys)?;
                m.end()
            }
            KvEvent::BlockRemoved { block_hashes } => {
                let mut m = s.serialize_map(Some(3))?;
                m.serialize_entry("type", "BlockRemoved")?;
                m.serialize_entry("block_hashes", block_hashes)?;
                m.serialize_entry("medium", MEDIUM)?;
                m.end()
            }
            KvEvent::AllBlocksCleared => {
                let mut m = s.serialize_map(Some(1))?;
                m.serialize_entry("type", "AllBlocksCleared")?;
                m.end()
            }
        }
    }
}

/// A batch in the map form.
struct MapBatch<'a> {
    ts: f64,
    events: &'a [KvEvent],
    dp_rank: i64,
}

impl Serialize for MapBatch<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::{SerializeMap, SerializeSeq};
        struct Events<'a>(&'a [KvEvent]);
        impl Serialize for Events<'_> {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                let mut q = s.serialize_seq(Some(self.0.len()))?;
                for e in self.0 {
                    q.serialize_element(&AsMap(e))?;
                }
                q.end()
            }
        }
        let mut m = s.serialize_map(Some(3))?;
        m.serialize_entry("ts", &self.ts)?;
        m.serialize_entry("events", &Events(self.events))?;
        m.serialize_entry("data_parallel_rank", &self.dp_rank)?;
        m.end()
    }
}

/// The array form of an event.
impl Serialize for KvEvent {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            KvEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                extra_keys,
                lora,
            } => (
                "BlockStored",
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                lora.as_ref().map(|l| l.0),
                MEDIUM,
                lora.as_ref().map(|l| &l.1),
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

/// Encodes one batch of events in `format`.
pub fn encode_batch(
    ts: f64,
    events: &[KvEvent],
    dp_rank: i64,
    format: WireFormat,
) -> Result<Vec<u8>, rmp_serde::encode::Error> {
    match format {
        WireFormat::Map => rmp_serde::to_vec(&MapBatch {
            ts,
            events,
            dp_rank,
        }),
        WireFormat::Array => rmp_serde::to_vec(&(ts, events, dp_rank)),
    }
}
