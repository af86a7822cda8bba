//! The `tenant` label of the per-tenant metrics (`pagoda_tenant_*`,
//! `pagoda_plugin_*`), as `--metrics-tenant-label` chooses it. `/metrics`
//! is open to anyone who reaches the port, as vLLM's is, so by default a
//! tenant appears there as a salted hash rather than by name; the admin
//! API reports each tenant's label (`metrics_label`) to map it back.

use sha2::{Digest, Sha256};
use std::sync::{OnceLock, PoisonError, RwLock};

/// How a tenant appears in metric labels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TenantLabel {
    /// The tenant id itself.
    Id,
    /// `t-` and 16 hex digits of a hash of the id, salted with a secret
    /// derived from the key salt (see [`set_secret`]), so the same tenant
    /// has the same label on every replica sharing a store, but its name
    /// is not exposed.
    Hash,
    /// One series for all tenants (`all`).
    None,
}

impl std::str::FromStr for TenantLabel {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> anyhow::Result<Self> {
        Ok(match s {
            "id" => TenantLabel::Id,
            "hash" => TenantLabel::Hash,
            "none" => TenantLabel::None,
            other => anyhow::bail!("--metrics-tenant-label '{other}' is not one of id, hash, none"),
        })
    }
}

static MODE: OnceLock<TenantLabel> = OnceLock::new();

/// The secret the hashed labels are salted with: derived from the key
/// salt (the state store's, shared by every replica), which no request
/// can read. Not the admin token: `/metrics` is open, so a label salted
/// with a credential would let anyone test guesses of it offline.
static SECRET: RwLock<[u8; 32]> = RwLock::new([0; 32]);

/// Sets the labelling for this process, once (the server does at start-up;
/// later calls change nothing). Until then, labels are tenant ids.
pub fn configure(mode: TenantLabel) {
    let _ = MODE.set(mode);
}

/// Salts the hashed labels with `key_salt` (the server's API-key salt).
pub fn set_secret(key_salt: &[u8; 32]) {
    let mut h = Sha256::new();
    h.update(b"pagoda metrics tenant label\0");
    h.update(key_salt);
    *SECRET.write().unwrap_or_else(PoisonError::into_inner) = h.finalize().into();
}

/// The label of tenant `id` (`default` for requests without a tenant).
pub fn of(id: &str) -> String {
    if id.is_empty() {
        return "default".to_string();
    }
    match MODE.get() {
        None | Some(TenantLabel::Id) => id.to_string(),
        Some(TenantLabel::None) => "all".to_string(),
        Some(TenantLabel::Hash) => {
            let secret = *SECRET.read().unwrap_or_else(PoisonError::into_inner);
            let mut h = Sha256::new();
            h.update(secret);
            h.update([0]);
            h.update(id.as_bytes());
            format!("t-{}", hex::encode(&h.finalize()[..8]))
        }
    }
}

/// Distinct adapter label values a process gives out; adapters beyond
/// them share the label `other`, so a tenant that uploads many adapters
/// cannot grow `/metrics` without bound.
pub const MAX_ADAPTER_LABELS: usize = 32;

static ADAPTER_LABELS: std::sync::Mutex<Option<std::collections::HashSet<String>>> =
    std::sync::Mutex::new(None);

/// The `adapter` label of tenant `id`'s adapter `name`, under the rules of
/// the tenant label: its name with `id`, a salted hash (`a-` and 16 hex
/// digits of tenant and name, so one tenant's `support` is not another's)
/// with `hash`, and `all` with `none`. The first [`MAX_ADAPTER_LABELS`]
/// distinct values are kept; later ones are `other`.
pub fn adapter(id: &str, name: &str) -> String {
    let label = match MODE.get() {
        None | Some(TenantLabel::Id) => name.to_string(),
        Some(TenantLabel::None) => return "all".to_string(),
        Some(TenantLabel::Hash) => {
            let secret = *SECRET.read().unwrap_or_else(PoisonError::into_inner);
            let mut h = Sha256::new();
            h.update(secret);
            h.update(b"\0adapter\0");
            h.update(id.as_bytes());
            h.update([0]);
            h.update(name.as_bytes());
            format!("a-{}", hex::encode(&h.finalize()[..8]))
        }
    };
    let mut seen = ADAPTER_LABELS
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    let seen = seen.get_or_insert_with(Default::default);
    if seen.contains(&label) {
        label
    } else if seen.len() < MAX_ADAPTER_LABELS {
        seen.insert(label.clone());
        label
    } else {
        "other".to_string()
    }
}
