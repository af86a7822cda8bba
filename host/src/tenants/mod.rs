//! Tenants: API keys (salted sha256 hashes only), a model allowlist, limits
//! (concurrency, tokens per minute), and an ordered chain of WASM plugins
//! with per-hook failure policies.
//!
//! Each tenant's live view is an immutable [`Snapshot`] behind an
//! `ArcSwap`: a request takes one at admission and keeps it to the end, so
//! swapping a plugin version never changes a request in flight.
//!
//! State on disk (`--state-dir`), each file written atomically (temp file,
//! fsync, rename, fsync of the directory):
//! ```text
//! key-salt                                the salt of the key hashes (32 random bytes)
//! tenants/<id>/tenant.json
//! tenants/<id>/plugins/<name>/<v>.wasm    the uploaded component
//! tenants/<id>/plugins/<name>/<v>.cwasm   its precompiled artifact (a cache)
//! tenants/<id>/plugins/<name>/<v>.json    the version record (written last)
//! tenants/<id>/plugins/<name>/active.json the active version and rollback history
//! tenants/<id>/adapters/.blobs/<sha256>    an uploaded adapter file (see [`adapters`])
//! tenants/<id>/adapters/<name>/<v>.json   an adapter version's record
//! tenants/<id>/adapters/<name>/active.json
//! ```
//! Every file is created 0600 and every directory 0700: the key hashes and
//! plugin artifacts are the server's alone.

pub mod adapters;
pub mod metric_label;
mod replica;
pub mod shared;
pub mod store;

use crate::digest::sha256_hex;
use crate::plugins::{
    validate_config, ChainEntry, HookKind, Limits, LoadedPlugin, PluginMeta, PluginRuntime,
};
use anyhow::{anyhow, bail, Result};
use arc_swap::ArcSwap;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Instant;

/// The prefix of salted key hashes; hashes without it (written before
/// salting) are plain sha256 and still recognized.
const SALTED: &str = "s1:";

/// The stored hash of an API key: sha256 of the server's salt and the key,
/// so a leaked state directory cannot be matched against precomputed
/// hashes of likely keys.
pub fn hash_key(salt: &[u8], key: &str) -> String {
    let mut h = Sha256::new();
    h.update(salt);
    h.update(key.as_bytes());
    format!("{SALTED}{}", hex::encode(h.finalize()))
}

/// A tenant's or plugin's name: 1–64 of `[A-Za-z0-9_.-]`, not starting with '.'.
pub fn valid_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 64
        && !s.starts_with('.')
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || b == b'.')
}

/// A tenant's request limits.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TenantLimits {
    /// Requests in flight at once; more get a 429.
    pub max_concurrent: Option<usize>,
    /// Prompt plus completion tokens per minute; beyond, 429 with Retry-After.
    pub tokens_per_minute: Option<u64>,
    /// Prompt tokens per minute; beyond, 429 with Retry-After.
    pub prompt_tokens_per_minute: Option<u64>,
    /// Completion tokens per minute; beyond, 429 with Retry-After.
    pub completion_tokens_per_minute: Option<u64>,
    /// Requests admitted per minute; beyond, 429 with Retry-After.
    pub requests_per_minute: Option<u64>,
}

/// The per-minute budgets of [`TenantLimits`], in a fixed order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RateLimit {
    Tokens,
    PromptTokens,
    CompletionTokens,
    Requests,
}

impl RateLimit {
    pub const ALL: [RateLimit; 4] = [
        RateLimit::Tokens,
        RateLimit::PromptTokens,
        RateLimit::CompletionTokens,
        RateLimit::Requests,
    ];

    /// Its key in `limits` (and in the admin view's `rate_limits`).
    pub fn key(self) -> &'static str {
        match self {
            RateLimit::Tokens => "tokens_per_minute",
            RateLimit::PromptTokens => "prompt_tokens_per_minute",
            RateLimit::CompletionTokens => "completion_tokens_per_minute",
            RateLimit::Requests => "requests_per_minute",
        }
    }

    /// What it counts, for messages.
    pub fn what(self) -> &'static str {
        match self {
            RateLimit::Tokens => "tokens",
            RateLimit::PromptTokens => "prompt tokens",
            RateLimit::CompletionTokens => "completion tokens",
            RateLimit::Requests => "requests",
        }
    }

    /// The budget `limits` sets, if any.
    pub fn of(self, limits: &TenantLimits) -> Option<u64> {
        match self {
            RateLimit::Tokens => limits.tokens_per_minute,
            RateLimit::PromptTokens => limits.prompt_tokens_per_minute,
            RateLimit::CompletionTokens => limits.completion_tokens_per_minute,
            RateLimit::Requests => limits.requests_per_minute,
        }
    }
}

/// A tenant's share of the engine under contention (the scheduler's
/// `fair` policy): see [`crate::engine::fair_share`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TenantScheduling {
    /// Relative share, 1 to [`TenantScheduling::MAX_WEIGHT`]: a tenant of
    /// weight 3 gets three times the running sequences of a tenant of
    /// weight 1 when both have more work than fits.
    pub weight: u32,
    /// Strict priority class: a tenant in a lower class is always served
    /// first and may take running slots from higher classes. 0 by default;
    /// -100 to 100.
    pub priority_class: i64,
}

impl TenantScheduling {
    pub const MAX_WEIGHT: u32 = 1000;
    pub const MAX_CLASS: i64 = 100;

    /// Refuses weights and classes outside their ranges.
    pub fn check(&self) -> Result<()> {
        if !(1..=Self::MAX_WEIGHT).contains(&self.weight) {
            bail!(
                "scheduling.weight must be between 1 and {}, not {}",
                Self::MAX_WEIGHT,
                self.weight
            );
        }
        if self.priority_class.abs() > Self::MAX_CLASS {
            bail!(
                "scheduling.priority_class must be between -{0} and {0}, not {1}",
                Self::MAX_CLASS,
                self.priority_class
            );
        }
        Ok(())
    }
}

impl Default for TenantScheduling {
    fn default() -> Self {
        TenantScheduling {
            weight: 1,
            priority_class: 0,
        }
    }
}

/// A tenant's part of the engine's KV-cache block pool, as fractions of
/// it: a reservation other tenants' traffic cannot evict, and a cap on what
/// the tenant may hold (running plus cached). See
/// [`crate::engine::kv_cache::OwnerLimits`].
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TenantKvCache {
    /// While the tenant holds at most this fraction of the pool, its cached
    /// blocks stay whatever other tenants run. 0 (the default): none.
    pub reserved_fraction: f64,
    /// The most of the pool the tenant may hold at once. 1 (the default):
    /// no cap. Never below one longest request's blocks.
    pub max_fraction: f64,
}

impl Default for TenantKvCache {
    fn default() -> Self {
        TenantKvCache {
            reserved_fraction: 0.0,
            max_fraction: 1.0,
        }
    }
}

impl TenantKvCache {
    /// The most all tenants' reservations may add up to: the rest stays
    /// for tenants without one.
    pub const MAX_RESERVED_TOTAL: f64 = 0.9;

    /// Refuses fractions outside 0 to 1, and a reservation above the cap.
    pub fn check(&self) -> Result<()> {
        for (key, v) in [
            ("kv_cache.reserved_fraction", self.reserved_fraction),
            ("kv_cache.max_fraction", self.max_fraction),
        ] {
            if !(0.0..=1.0).contains(&v) {
                bail!("{key} must be between 0 and 1, not {v}");
            }
        }
        if self.reserved_fraction > Self::MAX_RESERVED_TOTAL {
            bail!(
                "kv_cache.reserved_fraction may be at most {} (the rest of the pool stays for tenants without a reservation)",
                Self::MAX_RESERVED_TOTAL
            );
        }
        if self.reserved_fraction > self.max_fraction {
            bail!(
                "kv_cache.reserved_fraction ({}) is above kv_cache.max_fraction ({})",
                self.reserved_fraction,
                self.max_fraction
            );
        }
        Ok(())
    }

    /// The share as the engine takes it; `None` when it limits nothing.
    pub fn share(&self) -> Option<crate::engine::fair_share::KvShare> {
        let permille = |f: f64| (f * 1000.0).round().clamp(0.0, 1000.0) as u16;
        let share = crate::engine::fair_share::KvShare {
            reserved_permille: permille(self.reserved_fraction),
            max_permille: permille(self.max_fraction),
        };
        (share.reserved_permille > 0 || share.max_permille < 1000).then_some(share)
    }
}

/// A plugin of the chain and its per-hook policies.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChainSpec {
    pub name: String,
    /// hook name → "fail_open" | "fail_closed" (default fail_closed).
    #[serde(default)]
    pub policies: BTreeMap<String, String>,
}

/// A tenant's configuration as stored (keys hashed).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct TenantConfig {
    pub id: String,
    pub api_key_hashes: Vec<String>,
    /// Served model names this tenant may use; empty: all.
    pub models: Vec<String>,
    pub limits: TenantLimits,
    /// Weight and priority class in the scheduler.
    pub scheduling: TenantScheduling,
    /// The chain, in order. None: every uploaded plugin, by name.
    pub plugins: Option<Vec<ChainSpec>>,
    /// Limits of each plugin hook call.
    pub plugin_limits: Limits,
    /// Quotas of the tenant's own LoRA adapters.
    pub adapter_limits: adapters::AdapterLimits,
    /// Its part of the KV cache.
    pub kv_cache: TenantKvCache,
    /// Tenants naming the same group share prefix-cache blocks (one salt,
    /// so a common system prompt is computed once); `None`: the tenant's
    /// blocks are its own.
    pub cache_group: Option<String>,
}

/// The body of `PUT /admin/v1/tenants/{id}`.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TenantSpec {
    /// Plaintext keys; stored as sha256 hashes. Absent: keep the current keys.
    pub api_keys: Option<Vec<String>>,
    pub models: Vec<String>,
    pub limits: TenantLimits,
    pub scheduling: TenantScheduling,
    pub plugins: Option<Vec<PluginChainItem>>,
    pub plugin_limits: Option<Limits>,
    /// Absent: keep the current adapter quotas.
    pub adapter_limits: Option<adapters::AdapterLimits>,
    /// Absent: keep the current KV-cache share.
    pub kv_cache: Option<TenantKvCache>,
    /// The prefix-cache group; absent or null: none (replaced on every
    /// PUT, like `models`).
    pub cache_group: Option<String>,
}

/// A chain entry in a PUT body: a name, or a name with policies.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum PluginChainItem {
    Name(String),
    Spec(ChainSpec),
}

/// What a request sees of its tenant, fixed at admission.
pub struct Snapshot {
    pub config: TenantConfig,
    pub chain: Vec<ChainEntry>,
    /// The names of the tenant's own adapters (with an active version).
    pub adapters: std::collections::BTreeSet<String>,
}

impl Snapshot {
    /// Whether the tenant may name `model`: one of its own adapters, or a
    /// served name (or shared adapter) its allowlist admits.
    pub fn allows_model(&self, model: &str) -> bool {
        self.owns_adapter(model)
            || self.config.models.is_empty()
            || self.config.models.iter().any(|m| m == model)
    }

    /// Whether `name` is one of the tenant's own adapters.
    pub fn owns_adapter(&self, name: &str) -> bool {
        self.adapters.contains(name)
    }
}

/// The record of one uploaded plugin version.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct VersionRecord {
    pub version: u64,
    /// sha256 of the uploaded component (`<v>.wasm`).
    pub sha256: String,
    /// sha256 of its precompiled artifact (`<v>.cwasm`): the artifact is
    /// native code, so it is loaded only when it matches. Records written
    /// before this field have none, and their artifacts are rebuilt.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cwasm_sha256: Option<String>,
    pub size: usize,
    pub meta: PluginMeta,
    pub config: String,
    pub uploaded_at: u64,
}

/// The versions of one uploaded object (a plugin, an adapter), which one
/// is active, and the rollback history: plugins and adapters are
/// versioned, persisted, rolled back and shared the same way.
pub struct VersionSlot<R, L> {
    pub versions: BTreeMap<u64, R>,
    /// Versions loaded in memory (compiled plugins, resident adapters).
    pub loaded: HashMap<u64, L>,
    pub active: Option<u64>,
    /// Earlier active versions, most recent last (for rollback).
    pub history: Vec<u64>,
}

impl<R, L> Default for VersionSlot<R, L> {
    fn default() -> Self {
        VersionSlot {
            versions: BTreeMap::new(),
            loaded: HashMap::new(),
            active: None,
            history: Vec::new(),
        }
    }
}

/// A plugin's versions.
pub type PluginSlot = VersionSlot<VersionRecord, Arc<LoadedPlugin>>;

impl<R: Clone, L> VersionSlot<R, L> {
    /// Rollback goes at most this many versions back.
    pub const MAX_HISTORY: usize = 16;
    /// Earlier versions kept compiled in memory for an instant rollback
    /// (with a state dir; the others are loaded from it when needed).
    pub const KEEP_LOADED: usize = 2;

    /// The number the next upload gets, and the history once it is active.
    pub fn next_upload(&self) -> (u64, Vec<u64>) {
        let version = self.versions.keys().next_back().copied().unwrap_or(0) + 1;
        let mut h = self.history.clone();
        if let Some(p) = self.active {
            h.push(p);
        }
        (version, h)
    }

    /// The version a rollback makes active, its record, and the history
    /// after it; an error naming `what` when there is none.
    pub fn rollback_target(&self, what: &str) -> Result<(u64, R, Vec<u64>)> {
        let mut h = self.history.clone();
        let target = h
            .pop()
            .ok_or_else(|| anyhow!("{what} has no earlier version to roll back to"))?;
        let record = self
            .versions
            .get(&target)
            .cloned()
            .ok_or_else(|| anyhow!("version {target} of {what} is missing"))?;
        Ok((target, record, h))
    }

    /// Bounds what the slot holds as versions come and go: the rollback
    /// history, and the versions loaded in memory (a compiled plugin holds
    /// native code and a memory image, a file descriptor). Without a state
    /// dir (`reloadable` false) every version rollback can reach stays
    /// loaded; with one, only the active version and the last `keep_back`.
    fn prune_keeping(&mut self, reloadable: bool, keep_back: usize) {
        let excess = self.history.len().saturating_sub(Self::MAX_HISTORY);
        self.history.drain(..excess);
        let keep_back = if reloadable {
            keep_back
        } else {
            Self::MAX_HISTORY
        };
        let recent = &self.history[self.history.len().saturating_sub(keep_back)..];
        let active = self.active;
        self.loaded
            .retain(|v, _| Some(*v) == active || recent.contains(v));
    }

    fn prune(&mut self, reloadable: bool) {
        self.prune_keeping(reloadable, Self::KEEP_LOADED)
    }
}

/// A token bucket of a per-minute limit: it holds up to a minute's
/// budget and refills at a sixtieth of it per second. A request is
/// refused while the level is not above zero; what it used is taken after
/// (so one large request may drive the level below zero, and the tenant
/// waits for the refill).
#[derive(Clone, Copy, Debug)]
struct Bucket {
    level: f64,
    at: Instant,
}

impl Bucket {
    fn full(per_minute: u64) -> Bucket {
        Bucket {
            level: per_minute as f64,
            at: Instant::now(),
        }
    }

    /// Refills up to `now`, capped at `per_minute`.
    fn refill(&mut self, per_minute: u64, now: Instant) {
        let rate = per_minute as f64 / 60.0;
        self.level = (self.level + rate * now.saturating_duration_since(self.at).as_secs_f64())
            .min(per_minute as f64);
        self.at = now;
    }

    /// Whole seconds until the level reaches `need`.
    fn wait_for(&self, per_minute: u64, need: f64) -> u64 {
        let rate = (per_minute as f64 / 60.0).max(1e-9);
        ((need - self.level) / rate).ceil().max(1.0) as u64
    }
}

pub struct Tenant {
    pub id: String,
    snapshot: ArcSwap<Snapshot>,
    in_flight: AtomicUsize,
    /// Plugin instances its requests in flight have reserved.
    instances_held: AtomicUsize,
    /// Per [`RateLimit`], in [`RateLimit::ALL`]'s order.
    buckets: Mutex<[Bucket; 4]>,
    pub(crate) plugins: Mutex<BTreeMap<String, PluginSlot>>,
    /// Its own LoRA adapters, by name.
    pub(crate) adapters: Mutex<BTreeMap<String, adapters::AdapterSlot>>,
    /// Serializes this tenant's cold adapter loads (each runs on the
    /// request that needs it).
    pub(crate) adapter_loads: tokio::sync::Mutex<()>,
    /// Serializes admin changes of this tenant (uploads, rollbacks, PUT).
    pub(crate) admin: tokio::sync::Mutex<()>,
}

/// Why a tenant's request was not admitted. The server answers each with
/// the status the variant names (`From<TenantError> for ApiError` in
/// `server::errors`), its `Display` being the message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TenantError {
    /// 429: the tenant has `max` requests in flight, its `max_concurrent`.
    #[error("Tenant '{tenant}' has {max} requests in flight, its limit. Retry later.")]
    TooManyInFlight { tenant: String, max: usize },
    /// 429: the tenant used a per-minute budget (`what`: tokens, prompt
    /// tokens, completion tokens or requests); its bucket refills enough
    /// for one more in `retry_after` seconds.
    #[error(
        "Tenant '{tenant}' used its {per_minute} {what} per minute. Retry after {retry_after} s."
    )]
    PerMinute {
        tenant: String,
        what: &'static str,
        per_minute: u64,
        retry_after: u64,
    },
    /// 503: the tenant's requests in flight hold its `share` of the plugin
    /// instance pool.
    #[error("Tenant '{tenant}' has its share of {share} plugin instances in use by requests in flight. Retry later.")]
    PluginShareInUse { tenant: String, share: usize },
    /// 503: requests in flight hold all `total` plugin instances.
    #[error("All {total} plugin instances are in use by requests in flight. Retry later.")]
    PluginPoolInUse { total: usize },
}

/// A request admitted for a tenant: holds its concurrency slot, its
/// plugin instances (one per chain entry) and its snapshot.
pub struct Admission {
    pub tenant: Arc<Tenant>,
    pub snapshot: Arc<Snapshot>,
    /// Plugin instances reserved for the request, and the server-wide
    /// count they were taken from.
    instances: usize,
    pool: Option<Arc<AtomicUsize>>,
}

impl Drop for Admission {
    fn drop(&mut self) {
        self.tenant.in_flight.fetch_sub(1, Ordering::AcqRel);
        if let Some(pool) = &self.pool {
            self.tenant
                .instances_held
                .fetch_sub(self.instances, Ordering::AcqRel);
            pool.fetch_sub(self.instances, Ordering::AcqRel);
        }
    }
}

impl Admission {
    /// Charges the request's tokens to the tenant's per-minute budgets.
    pub fn charge(&self, prompt: u64, completion: u64) {
        let limits = &self.snapshot.config.limits;
        let mut b = self
            .tenant
            .buckets
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for (i, l) in RateLimit::ALL.into_iter().enumerate() {
            let used = match l {
                RateLimit::Tokens => prompt + completion,
                RateLimit::PromptTokens => prompt,
                RateLimit::CompletionTokens => completion,
                RateLimit::Requests => continue,
            };
            if l.of(limits).is_some() {
                b[i].level -= used as f64;
            }
        }
    }
}

impl Tenant {
    fn new(config: TenantConfig) -> Tenant {
        let buckets = RateLimit::ALL.map(|l| Bucket::full(l.of(&config.limits).unwrap_or(0)));
        Tenant {
            id: config.id.clone(),
            snapshot: ArcSwap::from_pointee(Snapshot {
                config,
                chain: Vec::new(),
                adapters: Default::default(),
            }),
            in_flight: AtomicUsize::new(0),
            instances_held: AtomicUsize::new(0),
            buckets: Mutex::new(buckets),
            plugins: Mutex::new(BTreeMap::new()),
            adapters: Mutex::new(BTreeMap::new()),
            adapter_loads: tokio::sync::Mutex::new(()),
            admin: tokio::sync::Mutex::new(()),
        }
    }

    pub fn snapshot(&self) -> Arc<Snapshot> {
        self.snapshot.load_full()
    }

    /// Admits a request, or refuses it for its tenant's limits (a 429).
    pub fn admit(self: &Arc<Self>) -> Result<Admission, TenantError> {
        let snapshot = self.snapshot.load_full();
        let n = self.in_flight.fetch_add(1, Ordering::AcqRel) + 1;
        let adm = Admission {
            tenant: Arc::clone(self),
            snapshot,
            instances: 0,
            pool: None,
        };
        let limits = &adm.snapshot.config.limits;
        if let Some(max) = limits.max_concurrent {
            if n > max {
                return Err(TenantError::TooManyInFlight {
                    tenant: self.id.clone(),
                    max,
                });
            }
        }
        let mut buckets = self
            .buckets
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let now = Instant::now();
        // Every budget is checked before any is taken, and the longest
        // wait is the one to honour.
        let mut refused: Option<(RateLimit, u64, u64)> = None;
        for (i, l) in RateLimit::ALL.into_iter().enumerate() {
            let Some(per_minute) = l.of(limits) else {
                continue;
            };
            let b = &mut buckets[i];
            b.refill(per_minute, now);
            // A request takes one whole unit of the requests budget; the
            // token budgets need only be above zero.
            let need = if l == RateLimit::Requests {
                1.0
            } else {
                f64::MIN_POSITIVE
            };
            if b.level < need {
                let wait = b.wait_for(per_minute, need.max(1.0));
                if refused.is_none_or(|(_, _, w)| wait > w) {
                    refused = Some((l, per_minute, wait));
                }
            }
        }
        if let Some((l, per_minute, retry_after)) = refused {
            return Err(TenantError::PerMinute {
                tenant: self.id.clone(),
                what: l.what(),
                per_minute,
                retry_after,
            });
        }
        if limits.requests_per_minute.is_some() {
            buckets[3].level -= 1.0;
        }
        drop(buckets);
        Ok(adm)
    }

    /// Each per-minute budget the tenant has, with its bucket's level now
    /// (what it may still use; below zero after a large request).
    pub fn rate_limits(&self) -> serde_json::Value {
        let limits = &self.snapshot().config.limits;
        let mut buckets = self
            .buckets
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let now = Instant::now();
        let mut out = serde_json::Map::new();
        for (i, l) in RateLimit::ALL.into_iter().enumerate() {
            if let Some(per_minute) = l.of(limits) {
                buckets[i].refill(per_minute, now);
                out.insert(
                    l.key().into(),
                    serde_json::json!({"limit": per_minute, "remaining": buckets[i].level.floor()}),
                );
            }
        }
        serde_json::Value::Object(out)
    }

    /// Rebuilds the snapshot from `config` and the active plugin versions.
    pub(crate) fn publish(&self, config: TenantConfig) {
        let slots = self
            .plugins
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let active = |name: &str| -> Option<Arc<LoadedPlugin>> {
            let s = slots.get(name)?;
            s.loaded.get(&s.active?).cloned()
        };
        let mut chain = Vec::new();
        match &config.plugins {
            Some(specs) => {
                for spec in specs {
                    if let Some(p) = active(&spec.name) {
                        chain.push(ChainEntry {
                            plugin: p,
                            fail_open: policies(&spec.policies),
                        });
                    }
                }
            }
            None => {
                for name in slots.keys() {
                    if let Some(p) = active(name) {
                        chain.push(ChainEntry {
                            plugin: p,
                            fail_open: [false; 4],
                        });
                    }
                }
            }
        }
        drop(slots);
        let adapters = self
            .adapters
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .iter()
            .filter(|(_, s)| s.active.is_some())
            .map(|(n, _)| n.clone())
            .collect();
        {
            let mut b = self
                .buckets
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            for (i, l) in RateLimit::ALL.into_iter().enumerate() {
                let cap = l.of(&config.limits).unwrap_or(0) as f64;
                if b[i].level > cap {
                    b[i].level = cap;
                }
            }
        }
        self.snapshot.store(Arc::new(Snapshot {
            config,
            chain,
            adapters,
        }));
    }
}

fn policies(p: &BTreeMap<String, String>) -> [bool; 4] {
    let mut out = [false; 4];
    for (i, h) in [
        HookKind::Route,
        HookKind::RenderPrompt,
        HookKind::OnChunk,
        HookKind::PostProcess,
    ]
    .into_iter()
    .enumerate()
    {
        let v = p
            .get(h.as_str())
            .or_else(|| p.get(&h.as_str().replace('-', "_")));
        out[i] = v.is_some_and(|v| v == "fail_open" || v == "fail-open" || v == "open");
    }
    out
}

/// The chain of a PUT body, entries as names or specs, with every policy
/// checked.
pub fn check_chain_items(items: Vec<PluginChainItem>) -> Result<Vec<ChainSpec>> {
    let chain: Vec<ChainSpec> = items
        .into_iter()
        .map(|i| match i {
            PluginChainItem::Name(name) => ChainSpec {
                name,
                policies: BTreeMap::new(),
            },
            PluginChainItem::Spec(s) => s,
        })
        .collect();
    check_policies(&chain)?;
    Ok(chain)
}

fn check_policies(specs: &[ChainSpec]) -> Result<()> {
    for s in specs {
        if !valid_name(&s.name) {
            bail!(
                "plugin name '{}' is not valid (1-64 of A-Z a-z 0-9 _ - .)",
                s.name
            );
        }
        for (k, v) in &s.policies {
            if HookKind::parse(k).is_none() {
                bail!("plugin '{}': unknown hook '{k}' in policies (route, render-prompt, on-chunk, post-process)", s.name);
            }
            if !matches!(
                v.as_str(),
                "fail_open" | "fail-open" | "open" | "fail_closed" | "fail-closed" | "closed"
            ) {
                bail!(
                    "plugin '{}': policy '{v}' for {k} must be fail_open or fail_closed",
                    s.name
                );
            }
        }
    }
    Ok(())
}

/// All tenants, their keys, and the plugin runtime.
pub struct Tenants {
    pub runtime: Arc<PluginRuntime>,
    pub dir: Option<PathBuf>,
    map: RwLock<HashMap<String, Arc<Tenant>>>,
    /// key hash → tenant id
    keys: RwLock<HashMap<String, String>>,
    /// The salt of the key hashes: `key-salt` in the state directory (the
    /// shared store's, with one), or random for a server that keeps no
    /// state.
    salt: RwLock<[u8; 32]>,
    /// Whether `salt` is the shared store's (false until the store has
    /// been reached once).
    salt_confirmed: std::sync::atomic::AtomicBool,
    /// The state store replicas share (`--state-store`).
    shared: Option<Arc<shared::StateStore>>,
    /// What this replica last applied of each tenant's manifest.
    seen: Mutex<HashMap<String, replica::Seen>>,
    /// How the sync with the store stands (readiness, held drops, salt).
    sync: replica::SyncState,
    /// Serializes this replica's changes to the shared store (and its
    /// polls), so each change is based on the latest manifest it read.
    writes: tokio::sync::Mutex<()>,
    /// The admin token, which no tenant key may equal.
    admin_token: Option<String>,
    /// Plugin instances reserved by requests in flight, all tenants.
    instances_held: Arc<AtomicUsize>,
}

impl Tenants {
    /// The tenants of a server, persisted under `dir` if given (whose
    /// key salt is read, or created on first start).
    pub fn new(
        runtime: Arc<PluginRuntime>,
        dir: Option<PathBuf>,
        admin_token: Option<String>,
    ) -> Result<Tenants> {
        let salt = match &dir {
            Some(d) => store::load_or_create_salt(d)?,
            None => rand::random(),
        };
        metric_label::set_secret(&salt);
        Ok(Tenants {
            runtime,
            dir,
            map: RwLock::new(HashMap::new()),
            keys: RwLock::new(HashMap::new()),
            salt: RwLock::new(salt),
            salt_confirmed: std::sync::atomic::AtomicBool::new(false),
            shared: None,
            seen: Mutex::new(HashMap::new()),
            sync: replica::SyncState::default(),
            writes: tokio::sync::Mutex::new(()),
            admin_token,
            instances_held: Arc::new(AtomicUsize::new(0)),
        })
    }

    /// Admits a request of `tenant`: its limits (see [`Tenant::admit`]),
    /// then one plugin instance per chain entry, reserved before anything
    /// runs. The runtime's instances are shared evenly: a tenant may hold
    /// at most its share (the pool over the number of tenants, but always
    /// enough for one request), so one tenant's slow plugins cannot take
    /// the instances other tenants' requests need; a request beyond its
    /// tenant's share, or beyond the pool, gets a 503 at once, before any
    /// token is generated for it.
    pub fn admit(&self, tenant: &Arc<Tenant>) -> Result<Admission, TenantError> {
        let mut adm = tenant.admit()?;
        let need = adm.snapshot.chain.len();
        if need == 0 {
            return Ok(adm);
        }
        let total = self.runtime.instance_pool_size();
        let tenants = self
            .map
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .len()
            .max(1);
        let share = (total / tenants).max(need);
        let held = tenant.instances_held.fetch_add(need, Ordering::AcqRel) + need;
        if held > share {
            tenant.instances_held.fetch_sub(need, Ordering::AcqRel);
            return Err(TenantError::PluginShareInUse {
                tenant: tenant.id.clone(),
                share,
            });
        }
        let all = self.instances_held.fetch_add(need, Ordering::AcqRel) + need;
        if all > total {
            tenant.instances_held.fetch_sub(need, Ordering::AcqRel);
            self.instances_held.fetch_sub(need, Ordering::AcqRel);
            return Err(TenantError::PluginPoolInUse { total });
        }
        adm.instances = need;
        adm.pool = Some(Arc::clone(&self.instances_held));
        Ok(adm)
    }

    /// The salt API keys are hashed with.
    pub fn salt(&self) -> [u8; 32] {
        *self
            .salt
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Tenant `config.id`, created with `config` if there is none.
    fn get_or_insert(&self, config: &TenantConfig) -> Arc<Tenant> {
        self.map
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .entry(config.id.clone())
            .or_insert_with(|| Arc::new(Tenant::new(config.clone())))
            .clone()
    }

    pub fn is_empty(&self) -> bool {
        self.map
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .is_empty()
    }

    pub fn ids(&self) -> Vec<String> {
        let mut v: Vec<String> = self
            .map
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .keys()
            .cloned()
            .collect();
        v.sort();
        v
    }

    /// `tenant` as this replica holds it now, for a change that has begun
    /// its write ([`Tenants::begin_write`]): another replica may have
    /// deleted it meanwhile.
    fn live(&self, tenant: &Tenant) -> Result<Arc<Tenant>> {
        self.get(&tenant.id)
            .ok_or_else(|| anyhow!("tenant '{}' was deleted through another replica", tenant.id))
    }

    pub fn get(&self, id: &str) -> Option<Arc<Tenant>> {
        self.map
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(id)
            .cloned()
    }

    /// A short id of an API key for usage records and logs: the first 16
    /// hex digits of its salted hash (never the key, and not enough of the
    /// stored hash to test guesses against).
    pub fn key_id(&self, key: &str) -> String {
        let h = hash_key(&self.salt(), key);
        h.trim_start_matches(SALTED).chars().take(16).collect()
    }

    /// The tenant an API key belongs to. Every stored hash is compared,
    /// each in constant time, so the time taken says nothing about which
    /// keys exist or how close a guess came.
    pub fn by_key(&self, key: &str) -> Option<Arc<Tenant>> {
        let salted = hash_key(&self.salt(), key);
        let plain = sha256_hex(key.as_bytes());
        let index = self
            .keys
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut found: Option<&String> = None;
        for (stored, id) in index.iter() {
            let want = if stored.starts_with(SALTED) {
                &salted
            } else {
                &plain
            };
            if crate::server::auth::same(stored, want) {
                found = Some(id);
            }
        }
        let id = found.cloned();
        drop(index);
        self.get(&id?)
    }

    fn index_keys(&self, id: &str, old: &[String], new: &[String]) {
        let mut k = self
            .keys
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for h in old {
            if k.get(h).is_some_and(|t| t == id) {
                k.remove(h);
            }
        }
        for h in new {
            k.insert(h.clone(), id.to_string());
        }
    }

    /// Creates or replaces a tenant's configuration. Returns (created, config).
    pub async fn put(&self, id: &str, spec: TenantSpec) -> Result<(bool, TenantConfig)> {
        if !valid_name(id) {
            bail!("tenant id '{id}' is not valid (1-64 of A-Z a-z 0-9 _ - .)");
        }
        let write = self.begin_write(id).await?;
        let existing = self.get(id);
        let old = existing.as_ref().map(|t| t.snapshot().config.clone());
        let api_key_hashes = match spec.api_keys {
            Some(keys) => {
                if keys.iter().any(|k| k.trim().len() < 8) {
                    bail!("api_keys must be at least 8 characters each");
                }
                if let Some(admin) = &self.admin_token {
                    if keys
                        .iter()
                        .any(|k| crate::server::auth::same(k.trim(), admin))
                    {
                        bail!("an api_key may not be the admin token");
                    }
                }
                let hashes: Vec<String> = keys
                    .iter()
                    .map(|k| hash_key(&self.salt(), k.trim()))
                    .collect();
                let index = self
                    .keys
                    .read()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                if let Some(h) = hashes
                    .iter()
                    .find(|h| index.get(*h).is_some_and(|t| t != id))
                {
                    let _ = h;
                    bail!("one of the api_keys already belongs to another tenant");
                }
                hashes
            }
            None => old
                .as_ref()
                .map(|c| c.api_key_hashes.clone())
                .unwrap_or_default(),
        };
        let plugins = spec.plugins.map(check_chain_items).transpose()?;
        spec.scheduling.check()?;
        let plugin_limits = spec.plugin_limits.unwrap_or_else(|| {
            old.as_ref()
                .map(|c| c.plugin_limits.clone())
                .unwrap_or_default()
        });
        if plugin_limits.memory_bytes > self.runtime.config().max_memory_bytes {
            bail!(
                "plugin_limits.memory_bytes may be at most {}",
                self.runtime.config().max_memory_bytes
            );
        }
        if plugin_limits.timeout_ms == 0
            || plugin_limits.timeout_ms > 60_000
            || plugin_limits.chunk_timeout_ms == 0
            || plugin_limits.chunk_timeout_ms > 60_000
        {
            bail!("plugin_limits timeouts must be between 1 and 60000 ms");
        }
        let adapter_limits = spec.adapter_limits.unwrap_or_else(|| {
            old.as_ref()
                .map(|c| c.adapter_limits.clone())
                .unwrap_or_default()
        });
        let kv_cache = match spec.kv_cache {
            Some(kv) => kv,
            None => old.as_ref().map(|c| c.kv_cache).unwrap_or_default(),
        };
        kv_cache.check()?;
        let others: f64 = self
            .map
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .iter()
            .filter(|(other, _)| other.as_str() != id)
            .map(|(_, t)| t.snapshot().config.kv_cache.reserved_fraction)
            .sum();
        if others + kv_cache.reserved_fraction > TenantKvCache::MAX_RESERVED_TOTAL + 1e-9 {
            bail!(
                "kv_cache.reserved_fraction {}: the tenants' reservations would add up to {:.3}, above {}",
                kv_cache.reserved_fraction,
                others + kv_cache.reserved_fraction,
                TenantKvCache::MAX_RESERVED_TOTAL
            );
        }
        if let Some(g) = &spec.cache_group {
            if !valid_name(g) {
                bail!("cache_group '{g}' is not valid (1-64 of A-Z a-z 0-9 _ - .)");
            }
        }
        let config = TenantConfig {
            id: id.to_string(),
            cache_group: spec.cache_group,
            api_key_hashes,
            models: spec.models,
            limits: spec.limits,
            scheduling: spec.scheduling,
            plugins,
            plugin_limits,
            adapter_limits,
            kv_cache,
        };
        if let Some((_, basis)) = &write {
            let m = self.manifest_of(existing.as_deref(), config.clone());
            self.commit(id, basis, m).await?;
        }
        let tenant = existing.unwrap_or_else(|| self.get_or_insert(&config));
        let _g = tenant.admin.lock().await;
        if let Some(dir) = &self.dir {
            let dir = dir.clone();
            let c = config.clone();
            tokio::task::spawn_blocking(move || store::save_tenant(&dir, &c))
                .await
                .map_err(|e| anyhow!("{e}"))??;
        }
        self.index_keys(
            id,
            old.as_ref().map_or(&[][..], |c| &c.api_key_hashes[..]),
            &config.api_key_hashes,
        );
        tenant.publish(config.clone());
        Ok((old.is_none(), config))
    }

    pub async fn delete(&self, id: &str) -> Result<bool> {
        let write = self.begin_write(id).await?;
        let t = self.get(id);
        // A tenant this replica never applied (its manifest is corrupt, or
        // names a component it could not load) is still deleted from the
        // store.
        let live = write.as_ref().is_some_and(|(_, b)| b.live);
        if t.is_none() && !live {
            return Ok(false);
        }
        if let Some((_, basis)) = &write {
            // A tombstone, written on the version read like any change.
            let mut m = self.manifest_of(
                None,
                TenantConfig {
                    id: id.to_string(),
                    ..TenantConfig::default()
                },
            );
            m.deleted = true;
            self.commit(id, basis, m).await?;
        }
        if let Some(t) = t {
            let _g = t.admin.lock().await;
            self.remove_local(id).await?;
        }
        Ok(true)
    }

    /// Compiles, checks and smoke-tests a component, validates its config,
    /// persists it as a new version and makes it active.
    pub async fn upload(
        &self,
        tenant: &Arc<Tenant>,
        name: &str,
        wasm: bytes::Bytes,
        config: Option<String>,
    ) -> Result<VersionRecord> {
        if !valid_name(name) {
            bail!("plugin name '{name}' is not valid (1-64 of A-Z a-z 0-9 _ - .)");
        }
        let limits = tenant.snapshot().config.plugin_limits.clone();
        let rt = Arc::clone(&self.runtime);
        let sha = sha256_hex(&wasm);
        let size = wasm.len();
        let bytes = wasm.clone();
        // Compile and check off the request path.
        let (pre, meta, cwasm, config) = tokio::task::spawn_blocking(move || -> Result<_> {
            let component = rt.compile(&bytes)?;
            let cwasm = rt.serialize(&component)?;
            let (pre, meta) = rt.prepare(component, &limits)?;
            let config = validate_config(&meta, config.as_deref())?;
            Ok((pre, meta, cwasm, config))
        })
        .await
        .map_err(|e| anyhow!("the compiler task failed: {e}"))??;
        let write = self.begin_write(&tenant.id).await?;
        let tenant = &self.live(tenant)?;
        let _g = tenant.admin.lock().await;
        let (version, history) = {
            let slots = tenant
                .plugins
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            slots
                .get(name)
                .map_or((1, Vec::new()), PluginSlot::next_upload)
        };
        let record = VersionRecord {
            version,
            sha256: sha.clone(),
            cwasm_sha256: Some(sha256_hex(&cwasm)),
            size,
            meta: meta.clone(),
            config: config.clone(),
            uploaded_at: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
        };
        let loaded = Arc::new(LoadedPlugin::new(
            name.to_string(),
            version,
            sha,
            meta,
            config,
            pre,
        ));
        if let (Some((_, basis)), Some(shared)) = (&write, &self.shared) {
            // The component first: a manifest never names a missing blob.
            shared.put_blob(&record.sha256, wasm.clone()).await?;
            let mut m = self.manifest_of(Some(tenant), tenant.snapshot().config.clone());
            let p = m.plugins.entry(name.to_string()).or_default();
            p.versions.insert(version, record.clone());
            p.active = Some(version);
            p.history = history.clone();
            self.commit(&tenant.id, basis, m).await?;
        }
        if let Some(dir) = &self.dir {
            let dir = dir.clone();
            let (tid, n, r, h) = (
                tenant.id.clone(),
                name.to_string(),
                record.clone(),
                history.clone(),
            );
            tokio::task::spawn_blocking(move || {
                store::save_version(&dir, &tid, &n, &r, &wasm, &cwasm, version, &h)
            })
            .await
            .map_err(|e| anyhow!("{e}"))??;
        }
        {
            let mut slots = tenant
                .plugins
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let s = slots.entry(name.to_string()).or_default();
            s.versions.insert(version, record.clone());
            s.loaded.insert(version, loaded);
            s.active = Some(version);
            s.history = history;
            s.prune(self.dir.is_some());
        }
        let cfg = tenant.snapshot().config.clone();
        tenant.publish(cfg);
        Ok(record)
    }

    /// Makes the previously active version active again.
    pub async fn rollback(&self, tenant: &Arc<Tenant>, name: &str) -> Result<VersionRecord> {
        let write = self.begin_write(&tenant.id).await?;
        let tenant = &self.live(tenant)?;
        let _g = tenant.admin.lock().await;
        let (target, history, record, loaded) = {
            let slots = tenant
                .plugins
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let s = slots
                .get(name)
                .ok_or_else(|| anyhow!("tenant '{}' has no plugin '{name}'", tenant.id))?;
            let (target, record, h) = s.rollback_target(&format!("plugin '{name}'"))?;
            (target, h, record, s.loaded.get(&target).cloned())
        };
        let loaded = match loaded {
            Some(l) => l,
            None if self.shared.is_some() => {
                let limits = tenant.snapshot().config.plugin_limits.clone();
                self.load_shared_version(&tenant.id, name, &record, &limits)
                    .await?
            }
            None => {
                let dir = self
                    .dir
                    .clone()
                    .ok_or_else(|| anyhow!("version {target} is not loaded"))?;
                let rt = Arc::clone(&self.runtime);
                let (tid, n, r) = (tenant.id.clone(), name.to_string(), record.clone());
                let limits = tenant.snapshot().config.plugin_limits.clone();
                tokio::task::spawn_blocking(move || {
                    store::load_version(&rt, &dir, &tid, &n, &r, &limits)
                })
                .await
                .map_err(|e| anyhow!("{e}"))??
            }
        };
        if let Some((_, basis)) = &write {
            let mut m = self.manifest_of(Some(tenant), tenant.snapshot().config.clone());
            let p = m.plugins.entry(name.to_string()).or_default();
            p.active = Some(target);
            p.history = history.clone();
            self.commit(&tenant.id, basis, m).await?;
        }
        if let Some(dir) = &self.dir {
            let dir = dir.clone();
            let (tid, n, h) = (tenant.id.clone(), name.to_string(), history.clone());
            tokio::task::spawn_blocking(move || store::save_active(&dir, &tid, &n, target, &h))
                .await
                .map_err(|e| anyhow!("{e}"))??;
        }
        {
            let mut slots = tenant
                .plugins
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let s = slots.entry(name.to_string()).or_default();
            s.loaded.insert(target, loaded);
            s.active = Some(target);
            s.history = history;
            s.prune(self.dir.is_some());
        }
        let cfg = tenant.snapshot().config.clone();
        tenant.publish(cfg);
        Ok(record)
    }

    /// The plugins of a tenant, as the admin API lists them.
    pub fn list_plugins(&self, tenant: &Tenant) -> serde_json::Value {
        let slots = tenant
            .plugins
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let list: Vec<serde_json::Value> = slots
            .iter()
            .map(|(name, s)| {
                serde_json::json!({
                    "name": name,
                    "active_version": s.active,
                    "versions": s.versions.values().map(|r| serde_json::json!({
                        "version": r.version,
                        "sha256": r.sha256,
                        "size": r.size,
                        "plugin_name": r.meta.name,
                        "plugin_version": r.meta.version,
                        "hooks": r.meta.hooks,
                        "config": serde_json::from_str::<serde_json::Value>(&r.config).unwrap_or_default(),
                        "uploaded_at": r.uploaded_at,
                        "active": Some(r.version) == s.active,
                    })).collect::<Vec<_>>(),
                })
            })
            .collect();
        serde_json::json!({"object": "list", "data": list})
    }

    /// Loads every tenant and active plugin version from the state dir.
    pub fn load_all(&self) -> Result<usize> {
        let Some(dir) = &self.dir else { return Ok(0) };
        let loaded = store::load_all(&self.runtime, dir)?;
        let n = loaded.len();
        for store::Loaded { config, plugins } in loaded {
            let adapters = adapters::disk::read_adapter_slots(dir, &config.id);
            let t = Arc::new(Tenant::new(config.clone()));
            *t.plugins
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner) = plugins;
            *t.adapters
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner) = adapters;
            self.index_keys(&config.id, &[], &config.api_key_hashes);
            t.publish(config.clone());
            self.map
                .write()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .insert(config.id.clone(), t);
        }
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_keys_and_policies() {
        assert!(valid_name("acme-1.prod_x"));
        assert!(
            !valid_name("")
                && !valid_name("../etc")
                && !valid_name(".hidden")
                && !valid_name("a/b")
        );
        assert_eq!(hash_key(b"salt", "k").len(), SALTED.len() + 64);
        assert_ne!(hash_key(b"salt", "k"), hash_key(b"salt", "k2"));
        assert_ne!(hash_key(b"salt", "k"), hash_key(b"tlas", "k"));
        let mut p = BTreeMap::new();
        p.insert("route".to_string(), "fail_open".to_string());
        p.insert("on-chunk".to_string(), "fail_closed".to_string());
        assert_eq!(policies(&p), [true, false, false, false]);
        let bad = vec![ChainSpec {
            name: "x".into(),
            policies: [("routing".to_string(), "fail_open".to_string())].into(),
        }];
        assert!(check_policies(&bad).is_err());
    }
}
