//! Tenant-owned LoRA adapters: uploaded through the admin API, checked
//! against the base model before they become visible, stored by content
//! hash, versioned and rolled back the way plugins are, shared between
//! replicas through the state store, and resolved only for their tenant.
//!
//! - Storage: `tenants/<id>/adapters/.blobs/<sha256>` holds each uploaded
//!   file once (`adapter_config.json`, `adapter_model.safetensors`), and
//!   `tenants/<id>/adapters/<name>/<v>.json` + `active.json` the versions,
//!   written in that order (see [`super::store`]). In the shared store the
//!   files are `blobs/<sha256>` as plugin components are, and the tenant's
//!   manifest lists the versions.
//! - Residency: an adapter's factors are loaded into memory (resident) at
//!   upload and on first use after a restart, a sync or an eviction (a cold
//!   load), on the requesting tenant's own request: on the blocking pool,
//!   one load at a time per tenant, so a tenant that cycles through many
//!   adapters waits on its own loads and never on another tenant's.
//!   `adapter_limits.max_resident`/`max_resident_bytes` bound what a tenant
//!   keeps resident; the least recently used adapter no request holds is
//!   evicted to make room.
//! - Privacy: a name resolves only among the requesting tenant's adapters
//!   (then the server's own, `--lora-modules`, which the admin shares with
//!   every tenant its `models` allows); another tenant's adapter is as
//!   unknown as a missing one.

use super::store;
use super::{Tenant, Tenants, VersionSlot};
use crate::digest::sha256_hex;
use crate::engine::lora::{LoadedLora, LoraAdapter, SharedLoras};
use anyhow::{anyhow, bail, Context, Result};
use bytes::Bytes;
use disk::*;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Instant;

/// The record of one uploaded adapter version.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AdapterRecord {
    pub version: u64,
    /// The version's identity: sha256 of its two files' hashes.
    pub sha256: String,
    /// sha256 of `adapter_config.json` as uploaded.
    pub config_sha256: String,
    /// sha256 of `adapter_model.safetensors` as uploaded.
    pub weights_sha256: String,
    /// Bytes stored: both files.
    pub size: u64,
    /// Bytes its factors take in memory when resident (f32).
    pub resident_bytes: u64,
    pub rank: usize,
    /// The adapted projections (`q_proj`, ...), each once.
    pub modules: Vec<String>,
    pub uploaded_at: u64,
    /// Shared by the admin with every tenant (whose `models` allow it),
    /// under its name; otherwise only its own tenant resolves it.
    #[serde(default)]
    pub shared: bool,
}

impl store::Versioned for AdapterRecord {
    fn version(&self) -> u64 {
        self.version
    }
}

/// A resident adapter version and when a request last used it.
#[derive(Clone, Debug)]
pub struct Resident {
    pub lora: Arc<LoadedLora>,
    pub used: Instant,
}

/// An adapter's versions; `loaded` holds the resident one.
pub type AdapterSlot = VersionSlot<AdapterRecord, Resident>;

/// A tenant's adapter quotas (absent: no limit).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AdapterLimits {
    /// Adapters (names) stored.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_stored: Option<usize>,
    /// Bytes of every stored version's files together.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_stored_bytes: Option<u64>,
    /// Adapters resident in memory at once.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_resident: Option<usize>,
    /// Bytes of the resident adapters' factors together.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_resident_bytes: Option<u64>,
}

/// Why an adapter could not be stored or made resident. The admin API and
/// the inference routes answer each with the status it names.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AdapterError {
    /// 400 at upload: the tenant's stored adapters would exceed `limit`.
    #[error("tenant '{tenant}' would store {would} {unit}, over its adapter_limits.{limit} of {max}; delete an adapter (DELETE /admin/v1/tenants/{tenant}/adapters/NAME) or raise the limit (PUT /admin/v1/tenants/{tenant})")]
    Stored {
        tenant: String,
        limit: &'static str,
        unit: &'static str,
        would: u64,
        max: u64,
    },
    /// 400 at upload: the adapter alone is larger than `limit`, so it
    /// could never be resident.
    #[error("tenant '{tenant}' cannot keep adapter '{adapter}' resident: it alone takes {would} {unit}, over its adapter_limits.{limit} of {max}; raise the limit (PUT /admin/v1/tenants/{tenant})")]
    Resident {
        tenant: String,
        adapter: String,
        limit: &'static str,
        unit: &'static str,
        would: u64,
        max: u64,
    },
}

/// Metric names.
pub mod metrics {
    /// Requests run with a tenant's adapter, by `tenant` and `adapter`
    /// (labels bounded: see [`crate::tenants::metric_label::adapter`]).
    pub const REQUESTS: &str = "pagoda_tenant_adapter_requests_total";
    /// Cold loads of a tenant's adapters, by `tenant`.
    pub const COLD_LOADS: &str = "pagoda_tenant_adapter_cold_loads_total";
    /// How long each took, by `tenant`: time on that tenant's requests.
    pub const COLD_LOAD_SECONDS: &str = "pagoda_tenant_adapter_cold_load_seconds";
    /// Adapters a tenant has resident, by `tenant`.
    pub const RESIDENT: &str = "pagoda_tenant_adapters_resident";
}

/// Describes the adapter metrics on `/metrics`.
pub fn describe_metrics() {
    ::metrics::describe_counter!(
        metrics::REQUESTS,
        "Requests run with a tenant's LoRA adapter, per tenant and adapter (adapter labels follow --metrics-tenant-label, at most 32 values, then 'other')."
    );
    ::metrics::describe_counter!(
        metrics::COLD_LOADS,
        "Loads of a tenant's adapter into memory on the request that needed it, per tenant."
    );
    ::metrics::describe_histogram!(
        metrics::COLD_LOAD_SECONDS,
        "Time of each cold adapter load, spent on the tenant's own request, seconds."
    );
    ::metrics::describe_gauge!(
        metrics::RESIDENT,
        "Adapters a tenant keeps resident in memory."
    );
}

/// The two PEFT files of an upload.
pub struct AdapterUpload {
    pub config: Bytes,
    pub weights: Bytes,
}

/// An adapter parsed and checked against the base.
struct Checked {
    adapter: LoraAdapter,
    rank: usize,
    modules: Vec<String>,
}

fn check(upload_config: &[u8], weights: &[u8], loras: &SharedLoras) -> Result<Checked> {
    let (base, max_rank) = {
        let r = crate::engine::lora::lock(loras);
        (r.base().clone(), r.limits().max_rank)
    };
    let adapter = LoraAdapter::from_bytes(
        upload_config,
        weights,
        &base,
        max_rank,
        "adapter_config.json",
        "adapter_model.safetensors",
    )?;
    let modules: BTreeSet<&str> = adapter.modules.keys().map(|(_, m)| m.hf_name()).collect();
    Ok(Checked {
        rank: adapter.rank,
        modules: modules.into_iter().map(str::to_string).collect(),
        adapter,
    })
}

fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn lock_slots(t: &Tenant) -> std::sync::MutexGuard<'_, BTreeMap<String, AdapterSlot>> {
    t.adapters
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Every blob the slots' records name.
fn blobs_of(slots: &BTreeMap<String, AdapterSlot>) -> BTreeSet<String> {
    slots
        .values()
        .flat_map(|s| s.versions.values())
        .flat_map(|r| [r.config_sha256.clone(), r.weights_sha256.clone()])
        .collect()
}

/// Bytes of the distinct blobs the slots' records name.
fn stored_bytes(slots: &BTreeMap<String, AdapterSlot>, extra: Option<&AdapterRecord>) -> u64 {
    stored_bytes_of(
        slots
            .values()
            .flat_map(|s| s.versions.values())
            .chain(extra),
    )
}

/// Bytes of the distinct versions among `records`.
fn stored_bytes_of<'a>(records: impl Iterator<Item = &'a AdapterRecord>) -> u64 {
    let mut seen = BTreeMap::new();
    for r in records {
        // A record knows its two files' total; split evenly is wrong, so
        // count a version's files together, once per distinct pair.
        seen.insert((r.config_sha256.clone(), r.weights_sha256.clone()), r.size);
    }
    seen.values().sum()
}

/// The versions an adapter keeps once `active` is active after
/// `history`: those rollback can still reach. The others (rolled back
/// from, or beyond the history's 16) are dropped, so that a tenant's
/// stored bytes are what it can still use.
fn kept_versions(active: u64, history: &mut Vec<u64>) -> BTreeSet<u64> {
    let excess = history.len().saturating_sub(AdapterSlot::MAX_HISTORY);
    history.drain(..excess);
    history.iter().copied().chain([active]).collect()
}

/// Resident count and bytes of `slots`, without adapter `except`.
fn resident_use(slots: &BTreeMap<String, AdapterSlot>, except: &str) -> (u64, u64) {
    slots
        .iter()
        .filter(|(n, _)| n.as_str() != except)
        .flat_map(|(_, s)| s.loaded.values())
        .fold((0, 0), |(n, b), r| {
            (n + 1, b + r.lora.adapter.size_bytes() as u64)
        })
}

/// Makes room under the tenant's resident limits for `need` bytes of
/// adapter `name`, evicting the least recently used of its other resident
/// adapters, idle ones (no request in flight holds them) first. A request
/// in flight keeps its own reference, so evicting its adapter never
/// disturbs it: the limits bound what the tenant keeps resident between
/// requests. `false` if `name` cannot be kept at all (larger than
/// `max_resident_bytes` alone, or `max_resident` 0): it then serves the
/// request that loaded it and is not kept.
fn make_room(
    tenant: &str,
    slots: &mut BTreeMap<String, AdapterSlot>,
    limits: &AdapterLimits,
    name: &str,
    need: u64,
) -> bool {
    if limits.max_resident == Some(0) || limits.max_resident_bytes.is_some_and(|m| need > m) {
        return false;
    }
    loop {
        let (n, bytes) = resident_use(slots, name);
        let over_count = limits.max_resident.is_some_and(|m| n + 1 > m as u64);
        let over_bytes = limits.max_resident_bytes.is_some_and(|m| bytes + need > m);
        if !over_count && !over_bytes {
            return true;
        }
        let victim = slots
            .iter()
            .filter(|(n, _)| n.as_str() != name)
            .flat_map(|(n, s)| s.loaded.iter().map(move |(v, r)| (n.clone(), *v, r)))
            .min_by_key(|(_, _, r)| (Arc::strong_count(&r.lora) > 1, r.used))
            .map(|(n, v, _)| (n, v));
        let Some((n, v)) = victim else {
            return true;
        };
        if let Some(s) = slots.get_mut(&n) {
            s.loaded.remove(&v);
        }
        tracing::info!(tenant = %tenant, adapter = %n, "adapter evicted to make room for {name}");
    }
}

fn set_resident_gauge(tenant: &str, slots: &BTreeMap<String, AdapterSlot>) {
    let (n, _) = resident_use(slots, "");
    ::metrics::gauge!(metrics::RESIDENT, "tenant" => super::metric_label::of(tenant)).set(n as f64);
}

impl Tenants {
    /// Checks an uploaded adapter against the base model (the refusals of
    /// a load: shapes, rank, modules), stores it as a new version within
    /// the tenant's quotas, and makes it active. Nothing changes on any
    /// refusal.
    pub async fn upload_adapter(
        &self,
        tenant: &Arc<Tenant>,
        name: &str,
        upload: AdapterUpload,
        shared: bool,
        loras: &SharedLoras,
    ) -> Result<AdapterRecord> {
        if !super::valid_name(name) {
            bail!("adapter name '{name}' is not valid (1-64 of A-Z a-z 0-9 _ - ., not starting with '.')");
        }
        if shared {
            if let Some(owner) = self.shared_adapter_owner(name, &tenant.id) {
                bail!(
                    "tenant '{}' already shares an adapter named '{name}'; shared names are unique across tenants, so pick another name or stop sharing that one",
                    owner.id
                );
            }
        }
        let dir = self.dir.clone().ok_or_else(|| {
            anyhow!("tenant adapters are stored in --state-dir; restart the server with one")
        })?;
        let (config, weights) = (upload.config, upload.weights);
        let checked = {
            let (c, w, l) = (config.clone(), weights.clone(), Arc::clone(loras));
            tokio::task::spawn_blocking(move || check(&c, &w, &l))
                .await
                .map_err(|e| anyhow!("the adapter check failed: {e}"))??
        };
        let config_sha256 = sha256_hex(&config);
        let weights_sha256 = sha256_hex(&weights);
        let resident_bytes = checked.adapter.size_bytes() as u64;
        let limits = tenant.snapshot().config.adapter_limits.clone();
        if let Some(max) = limits.max_resident_bytes {
            if resident_bytes > max {
                return Err(AdapterError::Resident {
                    tenant: tenant.id.clone(),
                    adapter: name.to_string(),
                    limit: "max_resident_bytes",
                    unit: "bytes",
                    would: resident_bytes,
                    max,
                }
                .into());
            }
        }
        let write = self.begin_write(&tenant.id).await?;
        let tenant = &self.live(tenant)?;
        let _g = tenant.admin.lock().await;
        let limits = tenant.snapshot().config.adapter_limits.clone();
        let (record, history, keep) = {
            let slots = lock_slots(tenant);
            let (version, mut history) = slots
                .get(name)
                .map_or((1, Vec::new()), AdapterSlot::next_upload);
            let keep = kept_versions(version, &mut history);
            let record = AdapterRecord {
                version,
                sha256: sha256_hex(format!("{config_sha256}\n{weights_sha256}").as_bytes()),
                config_sha256: config_sha256.clone(),
                weights_sha256: weights_sha256.clone(),
                size: (config.len() + weights.len()) as u64,
                resident_bytes,
                rank: checked.rank,
                modules: checked.modules.clone(),
                uploaded_at: now_secs(),
                shared,
            };
            let names = slots.len() + usize::from(!slots.contains_key(name));
            if let Some(max) = limits.max_stored {
                if names > max {
                    return Err(AdapterError::Stored {
                        tenant: tenant.id.clone(),
                        limit: "max_stored",
                        unit: "adapters",
                        would: names as u64,
                        max: max as u64,
                    }
                    .into());
                }
            }
            if let Some(max) = limits.max_stored_bytes {
                let keep = &keep;
                let would = stored_bytes_of(
                    slots
                        .iter()
                        .flat_map(|(n, s)| {
                            s.versions
                                .values()
                                .filter(move |r| n != name || keep.contains(&r.version))
                        })
                        .chain([&record]),
                );
                if would > max {
                    return Err(AdapterError::Stored {
                        tenant: tenant.id.clone(),
                        limit: "max_stored_bytes",
                        unit: "bytes",
                        would,
                        max,
                    }
                    .into());
                }
            }
            (record, history, keep)
        };
        if let (Some((_, basis)), Some(shared)) = (&write, &self.shared) {
            // The files first: a manifest never names a missing blob.
            shared.put_blob(&config_sha256, config.clone()).await?;
            shared.put_blob(&weights_sha256, weights.clone()).await?;
            let mut m = self.manifest_of(Some(tenant), tenant.snapshot().config.clone());
            let a = m.adapters.entry(name.to_string()).or_default();
            a.versions.retain(|v, _| keep.contains(v));
            a.versions.insert(record.version, record.clone());
            a.active = Some(record.version);
            a.history = history.clone();
            self.commit(&tenant.id, basis, m).await?;
        }
        {
            let (tid, n, r, h) = (
                tenant.id.clone(),
                name.to_string(),
                record.clone(),
                history.clone(),
            );
            tokio::task::spawn_blocking(move || {
                save_adapter_version(&dir, &tid, &n, &r, &config, &weights, r.version, &h)
            })
            .await
            .map_err(|e| anyhow!("{e}"))??;
        }
        let lora = crate::engine::lora::lock(loras).adopt(
            name,
            self.adapter_path(&tenant.id, name, record.version),
            checked.adapter,
        );
        {
            let mut slots = lock_slots(tenant);
            let fits = make_room(&tenant.id, &mut slots, &limits, name, resident_bytes);
            let s = slots.entry(name.to_string()).or_default();
            s.versions.retain(|v, _| keep.contains(v));
            s.versions.insert(record.version, record.clone());
            s.active = Some(record.version);
            s.history = history;
            s.loaded.clear();
            if fits {
                s.loaded.insert(
                    record.version,
                    Resident {
                        lora,
                        used: Instant::now(),
                    },
                );
            }
            s.prune_keeping(true, 0);
            set_resident_gauge(&tenant.id, &slots);
        }
        self.drop_unkept(tenant, name, &keep).await?;
        let cfg = tenant.snapshot().config.clone();
        tenant.publish(cfg);
        Ok(record)
    }

    /// Removes from `--state-dir` the versions of adapter `name` that
    /// `keep` does not hold, then the files no kept version names.
    async fn drop_unkept(&self, tenant: &Tenant, name: &str, keep: &BTreeSet<u64>) -> Result<()> {
        let Some(dir) = self.dir.clone() else {
            return Ok(());
        };
        let blobs = blobs_of(&lock_slots(tenant));
        let (tid, n, keep) = (tenant.id.clone(), name.to_string(), keep.clone());
        tokio::task::spawn_blocking(move || drop_versions(&dir, &tid, &n, &keep, &blobs))
            .await
            .map_err(|e| anyhow!("{e}"))?
    }

    /// Where version `v` of a tenant's adapter lives, as `/v1/models`
    /// shows it (`root`).
    fn adapter_path(&self, id: &str, name: &str, v: u64) -> std::path::PathBuf {
        self.dir
            .clone()
            .unwrap_or_default()
            .join("tenants")
            .join(id)
            .join("adapters")
            .join(name)
            .join(format!("{v}.json"))
    }

    /// Makes the previously active version of adapter `name` active again.
    pub async fn rollback_adapter(
        &self,
        tenant: &Arc<Tenant>,
        name: &str,
    ) -> Result<AdapterRecord> {
        let write = self.begin_write(&tenant.id).await?;
        let tenant = &self.live(tenant)?;
        let _g = tenant.admin.lock().await;
        let (target, record, mut history) = {
            let slots = lock_slots(tenant);
            let s = slots
                .get(name)
                .ok_or_else(|| anyhow!("tenant '{}' has no adapter '{name}'", tenant.id))?;
            s.rollback_target(&format!("adapter '{name}'"))?
        };
        // The version rolled back from can no longer be reached: dropped.
        let keep = kept_versions(target, &mut history);
        if let Some((_, basis)) = &write {
            let mut m = self.manifest_of(Some(tenant), tenant.snapshot().config.clone());
            let a = m.adapters.entry(name.to_string()).or_default();
            a.versions.retain(|v, _| keep.contains(v));
            a.active = Some(target);
            a.history = history.clone();
            self.commit(&tenant.id, basis, m).await?;
        }
        if let Some(dir) = self.dir.clone() {
            let (tid, n, h) = (tenant.id.clone(), name.to_string(), history.clone());
            tokio::task::spawn_blocking(move || {
                store::save_active_of(&dir, &tid, store::Kind::Adapters, &n, target, &h)
            })
            .await
            .map_err(|e| anyhow!("{e}"))??;
        }
        {
            let mut slots = lock_slots(tenant);
            let s = slots.entry(name.to_string()).or_default();
            s.versions.retain(|v, _| keep.contains(v));
            s.active = Some(target);
            s.history = history;
            // The rolled-back version is loaded again on first use.
            s.loaded.clear();
            set_resident_gauge(&tenant.id, &slots);
        }
        self.drop_unkept(tenant, name, &keep).await?;
        let cfg = tenant.snapshot().config.clone();
        tenant.publish(cfg);
        Ok(record)
    }

    /// Removes adapter `name` of `tenant`: new requests no longer find
    /// it; requests in flight finish with it. `false` if there is none.
    pub async fn delete_adapter(&self, tenant: &Arc<Tenant>, name: &str) -> Result<bool> {
        let write = self.begin_write(&tenant.id).await?;
        let tenant = &self.live(tenant)?;
        let _g = tenant.admin.lock().await;
        if !lock_slots(tenant).contains_key(name) {
            return Ok(false);
        }
        if let Some((_, basis)) = &write {
            let mut m = self.manifest_of(Some(tenant), tenant.snapshot().config.clone());
            m.adapters.remove(name);
            self.commit(&tenant.id, basis, m).await?;
        }
        let keep = {
            let mut slots = lock_slots(tenant);
            slots.remove(name);
            set_resident_gauge(&tenant.id, &slots);
            blobs_of(&slots)
        };
        if let Some(dir) = self.dir.clone() {
            let (tid, n) = (tenant.id.clone(), name.to_string());
            tokio::task::spawn_blocking(move || delete_adapter(&dir, &tid, &n, &keep))
                .await
                .map_err(|e| anyhow!("{e}"))??;
        }
        let cfg = tenant.snapshot().config.clone();
        tenant.publish(cfg);
        Ok(true)
    }

    /// A tenant's adapters, as the admin API lists them, with its usage
    /// against its quotas.
    pub fn list_adapters(&self, tenant: &Tenant) -> serde_json::Value {
        let slots = lock_slots(tenant);
        let data: Vec<serde_json::Value> = slots
            .iter()
            .map(|(name, s)| {
                serde_json::json!({
                    "name": name,
                    "active_version": s.active,
                    "resident": s.active.is_some_and(|v| s.loaded.contains_key(&v)),
                    "versions": s.versions.values().map(|r| {
                        let mut v = serde_json::to_value(r).unwrap_or_default();
                        v["active"] = (Some(r.version) == s.active).into();
                        v
                    }).collect::<Vec<_>>(),
                })
            })
            .collect();
        let (resident, resident_bytes) = resident_use(&slots, "");
        serde_json::json!({
            "object": "list",
            "data": data,
            "usage": {
                "stored": slots.len(),
                "stored_bytes": stored_bytes(&slots, None),
                "resident": resident,
                "resident_bytes": resident_bytes,
            },
            "limits": tenant.snapshot().config.adapter_limits,
        })
    }

    /// The adapter `name` of `tenant` for a request, made resident if it
    /// is not (a cold load, on this request). `Ok(None)`: the tenant has no
    /// such adapter (the name may be a served model or a shared adapter).
    pub async fn resolve_adapter(
        &self,
        tenant: &Arc<Tenant>,
        name: &str,
        loras: Option<&SharedLoras>,
    ) -> Result<Option<Arc<LoadedLora>>> {
        let label = || super::metric_label::of(&tenant.id);
        let hit = |slots: &mut BTreeMap<String, AdapterSlot>| {
            let s = slots.get_mut(name)?;
            let v = s.active?;
            let r = s.loaded.get_mut(&v)?;
            r.used = Instant::now();
            Some(Arc::clone(&r.lora))
        };
        let record = {
            let mut slots = lock_slots(tenant);
            let Some(s) = slots.get(name) else {
                return Ok(None);
            };
            let Some(record) = s.active.and_then(|v| s.versions.get(&v)).cloned() else {
                return Ok(None);
            };
            if let Some(l) = hit(&mut slots) {
                self.count_use(tenant, name);
                return Ok(Some(l));
            }
            record
        };
        let loras = loras.ok_or_else(|| {
            anyhow!("tenant adapters need LoRA; restart the server with --enable-lora")
        })?;
        // One cold load at a time per tenant, on its own request.
        let _loading = tenant.adapter_loads.lock().await;
        if let Some(l) = hit(&mut lock_slots(tenant)) {
            self.count_use(tenant, name);
            return Ok(Some(l));
        }
        let t0 = Instant::now();
        let (config, weights) = self.adapter_files(&tenant.id, &record).await?;
        let checked = {
            let l = Arc::clone(loras);
            tokio::task::spawn_blocking(move || check(&config, &weights, &l))
                .await
                .map_err(|e| anyhow!("the adapter load failed: {e}"))?
                .with_context(|| format!("adapter '{name}' v{} cannot be loaded", record.version))?
        };
        let lora = crate::engine::lora::lock(loras).adopt(
            name,
            self.adapter_path(&tenant.id, name, record.version),
            checked.adapter,
        );
        let limits = tenant.snapshot().config.adapter_limits.clone();
        {
            let mut slots = lock_slots(tenant);
            let need = lora.adapter.size_bytes() as u64;
            // Kept if it is still the active version (a rollback or an
            // upload may have landed meanwhile: then this request runs with
            // the version it resolved, which is not kept) and fits.
            let current = slots
                .get(name)
                .is_some_and(|s| s.active == Some(record.version));
            if current && make_room(&tenant.id, &mut slots, &limits, name, need) {
                if let Some(s) = slots.get_mut(name) {
                    s.loaded.insert(
                        record.version,
                        Resident {
                            lora: Arc::clone(&lora),
                            used: Instant::now(),
                        },
                    );
                }
            }
            set_resident_gauge(&tenant.id, &slots);
        }
        ::metrics::counter!(metrics::COLD_LOADS, "tenant" => label()).increment(1);
        ::metrics::histogram!(metrics::COLD_LOAD_SECONDS, "tenant" => label())
            .record(t0.elapsed().as_secs_f64());
        tracing::info!(tenant = %tenant.id, adapter = %name, version = record.version, "adapter loaded in {:.0} ms", t0.elapsed().as_secs_f64() * 1e3);
        self.count_use(tenant, name);
        Ok(Some(lora))
    }

    fn count_use(&self, tenant: &Tenant, name: &str) {
        ::metrics::counter!(
            metrics::REQUESTS,
            "tenant" => super::metric_label::of(&tenant.id),
            "adapter" => super::metric_label::adapter(&tenant.id, name),
        )
        .increment(1);
    }

    /// The tenant (other than `except`) whose active version of adapter
    /// `name` the admin shares with every tenant, if any.
    pub fn shared_adapter_owner(&self, name: &str, except: &str) -> Option<Arc<Tenant>> {
        let tenants: Vec<Arc<Tenant>> = self
            .map
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .values()
            .filter(|t| t.id != except)
            .cloned()
            .collect();
        tenants.into_iter().find(|t| {
            let slots = lock_slots(t);
            slots
                .get(name)
                .and_then(|s| s.versions.get(&s.active?))
                .is_some_and(|r| r.shared)
        })
    }

    /// Every adapter shared with all tenants, by name, with its active
    /// version (owned by tenants other than `except`).
    pub fn shared_adapters(&self, except: &str) -> Vec<(String, u64)> {
        let tenants: Vec<Arc<Tenant>> = self
            .map
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .values()
            .filter(|t| t.id != except)
            .cloned()
            .collect();
        let mut out: Vec<(String, u64)> = tenants
            .iter()
            .flat_map(|t| {
                lock_slots(t)
                    .iter()
                    .filter_map(|(n, s)| {
                        let v = s.active?;
                        s.versions.get(&v)?.shared.then(|| (n.clone(), v))
                    })
                    .collect::<Vec<_>>()
            })
            .collect();
        out.sort();
        out.dedup_by(|a, b| a.0 == b.0);
        out
    }

    /// A tenant's own adapters with their active versions, by name, as
    /// `/v1/models` lists them for the tenant.
    pub fn active_adapters(&self, tenant: &Tenant) -> Vec<(String, u64)> {
        lock_slots(tenant)
            .iter()
            .filter_map(|(n, s)| Some((n.clone(), s.active?)))
            .collect()
    }

    /// The two files of adapter version `r`: from the local cache, else
    /// fetched from the shared store into it.
    pub(super) async fn adapter_files(
        &self,
        id: &str,
        r: &AdapterRecord,
    ) -> Result<(Vec<u8>, Vec<u8>)> {
        let dir = self
            .dir
            .clone()
            .ok_or_else(|| anyhow!("tenant adapters need --state-dir"))?;
        let mut out = Vec::new();
        for sha in [&r.config_sha256, &r.weights_sha256] {
            let local = {
                let (dir, id, sha) = (dir.clone(), id.to_string(), sha.clone());
                tokio::task::spawn_blocking(move || read_adapter_blob(&dir, &id, &sha))
                    .await
                    .map_err(|e| anyhow!("the cache task failed: {e}"))?
            };
            let bytes = match (local, &self.shared) {
                (Ok(b), _) => b,
                (Err(_), Some(shared)) => {
                    let b = shared.get_blob(sha).await?;
                    let (dir, id, sha, b2) = (dir.clone(), id.to_string(), sha.clone(), b.clone());
                    tokio::task::spawn_blocking(move || save_adapter_blob(&dir, &id, &sha, &b2))
                        .await
                        .map_err(|e| anyhow!("the cache task failed: {e}"))??;
                    b.to_vec()
                }
                (Err(e), None) => return Err(e),
            };
            out.push(bytes);
        }
        let weights = out.pop().unwrap_or_default();
        let config = out.pop().unwrap_or_default();
        Ok((config, weights))
    }

    /// Puts the files of adapter version `r` into the local cache (from
    /// the shared store), so the version can be loaded while the store is
    /// unreachable.
    pub(super) async fn cache_adapter_files(&self, id: &str, r: &AdapterRecord) -> Result<()> {
        self.adapter_files(id, r).await.map(|_| ())
    }
}

/// Adapter files and records under `--state-dir` (written as
/// [`super::store`] writes everything: atomically, content before record,
/// record before the active pointer).
pub mod disk {
    use super::{store, AdapterRecord, AdapterSlot};
    use anyhow::{Context, Result};
    use std::collections::BTreeMap;
    use std::path::{Path, PathBuf};

    /// The content-addressed blobs of tenant `id`'s adapters: the files of
    /// every stored version, named by their sha256, so versions that share a
    /// file store it once.
    fn adapter_blob_dir(root: &Path, id: &str) -> PathBuf {
        store::tenant_dir(root, id).join("adapters").join(".blobs")
    }

    /// The adapter slots of tenant `id` (records and active pointers).
    pub(crate) fn read_adapter_slots(root: &Path, id: &str) -> BTreeMap<String, AdapterSlot> {
        let mut out = BTreeMap::new();
        // Leftovers of a blob write a crash interrupted.
        for f in std::fs::read_dir(adapter_blob_dir(root, id))
            .into_iter()
            .flatten()
            .flatten()
        {
            if f.file_name().to_string_lossy().starts_with(".tmp-") {
                let _ = std::fs::remove_file(f.path());
            }
        }
        let Ok(entries) = std::fs::read_dir(store::tenant_dir(root, id).join("adapters")) else {
            return out;
        };
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().to_string();
            if !crate::tenants::valid_name(&name) || !e.path().is_dir() {
                continue;
            }
            let slot: AdapterSlot = store::read_slot(&e.path());
            if !slot.versions.is_empty() {
                out.insert(name, slot);
            }
        }
        out
    }

    /// The names of tenant `id`'s adapters in the cache.
    pub fn adapter_names(root: &Path, id: &str) -> Vec<String> {
        read_adapter_slots(root, id).into_keys().collect()
    }

    /// Whether the cache holds the blob `sha256` of tenant `id`, byte for byte.
    pub fn has_adapter_blob(root: &Path, id: &str, sha256: &str) -> bool {
        read_adapter_blob(root, id, sha256).is_ok()
    }

    /// The blob `sha256` of tenant `id`'s adapters, checked against its name.
    pub fn read_adapter_blob(root: &Path, id: &str, sha256: &str) -> Result<Vec<u8>> {
        let path = adapter_blob_dir(root, id).join(sha256);
        let b = std::fs::read(&path).with_context(|| format!("cannot read {}", path.display()))?;
        let actual = crate::digest::sha256_hex(&b);
        if actual != sha256 {
            anyhow::bail!(
                "{} has sha256 {actual}, not its name; upload the adapter again",
                path.display()
            );
        }
        Ok(b)
    }

    /// Stores `bytes` as a blob of tenant `id` (kept if already there whole).
    pub fn save_adapter_blob(root: &Path, id: &str, sha256: &str, bytes: &[u8]) -> Result<()> {
        if has_adapter_blob(root, id, sha256) {
            return Ok(());
        }
        store::write_atomic(&adapter_blob_dir(root, id).join(sha256), bytes)
    }

    /// Persists a new adapter version: its two blobs, then its record, then
    /// the active pointer. A crash before the pointer leaves the previous
    /// version active.
    #[allow(clippy::too_many_arguments)]
    pub fn save_adapter_version(
        root: &Path,
        id: &str,
        name: &str,
        r: &AdapterRecord,
        config: &[u8],
        weights: &[u8],
        active: u64,
        history: &[u64],
    ) -> Result<()> {
        save_adapter_blob(root, id, &r.config_sha256, config)?;
        save_adapter_blob(root, id, &r.weights_sha256, weights)?;
        save_adapter_record(root, id, name, r)?;
        store::save_active_of(root, id, store::Kind::Adapters, name, active, history)
    }

    /// Writes adapter version record `r` (after its blobs are in place).
    pub fn save_adapter_record(root: &Path, id: &str, name: &str, r: &AdapterRecord) -> Result<()> {
        store::write_atomic(
            &store::slot_dir(root, id, store::Kind::Adapters, name)
                .join(format!("{}.json", r.version)),
            &serde_json::to_vec_pretty(r)?,
        )
    }

    /// Removes adapter `name` of tenant `id` (renamed away first, so a crash
    /// never leaves half of it loading), then every blob no remaining record
    /// of the tenant names (`keep`).
    pub fn delete_adapter(
        root: &Path,
        id: &str,
        name: &str,
        keep: &std::collections::BTreeSet<String>,
    ) -> Result<()> {
        let dir = store::slot_dir(root, id, store::Kind::Adapters, name);
        if dir.exists() {
            let parent = store::tenant_dir(root, id).join("adapters");
            let gone = parent.join(format!(".deleted-{name}-{:x}", rand::random::<u64>()));
            std::fs::rename(&dir, &gone)
                .with_context(|| format!("cannot remove {}", dir.display()))?;
            store::fsync_dir(&parent)?;
            let _ = std::fs::remove_dir_all(&gone);
        }
        gc_adapter_blobs(root, id, keep);
        Ok(())
    }

    /// Removes the records of adapter `name`'s versions that `keep` does
    /// not hold (rollback can no longer reach them), then every blob of
    /// the tenant that `blobs` does not name.
    pub fn drop_versions(
        root: &Path,
        id: &str,
        name: &str,
        keep: &std::collections::BTreeSet<u64>,
        blobs: &std::collections::BTreeSet<String>,
    ) -> Result<()> {
        let dir = store::slot_dir(root, id, store::Kind::Adapters, name);
        for f in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            let fname = f.file_name().to_string_lossy().to_string();
            let v = fname
                .strip_suffix(".json")
                .and_then(|v| v.parse::<u64>().ok());
            if v.is_some_and(|v| !keep.contains(&v)) {
                std::fs::remove_file(f.path())
                    .with_context(|| format!("cannot remove {}", f.path().display()))?;
            }
        }
        store::fsync_dir(&dir)?;
        gc_adapter_blobs(root, id, blobs);
        Ok(())
    }

    /// Removes the blobs of tenant `id` that `keep` does not name.
    pub fn gc_adapter_blobs(root: &Path, id: &str, keep: &std::collections::BTreeSet<String>) {
        let dir = adapter_blob_dir(root, id);
        for f in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            let n = f.file_name().to_string_lossy().to_string();
            if !keep.contains(&n) {
                let _ = std::fs::remove_file(f.path());
            }
        }
    }
}

/// The files of a multipart/form-data upload: the part named (by its field
/// or its file name) `adapter_config.json` and the one named
/// `adapter_model.safetensors`.
/// The parts share `body`'s memory (an upload may be large).
pub fn parse_multipart(content_type: &str, body: &Bytes) -> Result<AdapterUpload> {
    let boundary = content_type
        .split(';')
        .map(str::trim)
        .find_map(|p| p.strip_prefix("boundary="))
        .map(|b| b.trim_matches('"'))
        .filter(|b| !b.is_empty() && content_type.trim_start().starts_with("multipart/form-data"))
        .ok_or_else(|| {
            anyhow!("the body must be multipart/form-data with the parts adapter_config.json and adapter_model.safetensors (curl -F adapter_config.json=@DIR/adapter_config.json -F adapter_model.safetensors=@DIR/adapter_model.safetensors)")
        })?;
    let delim = format!("--{boundary}");
    let find = |hay: &[u8], needle: &[u8], from: usize| -> Option<usize> {
        hay.get(from..)?
            .windows(needle.len())
            .position(|w| w == needle)
            .map(|p| p + from)
    };
    let mut config = None;
    let mut weights = None;
    let mut pos = find(body, delim.as_bytes(), 0)
        .ok_or_else(|| anyhow!("the multipart body has no boundary '{boundary}'"))?;
    let close = format!("\r\n{delim}");
    loop {
        pos += delim.len();
        if body.get(pos..pos + 2) == Some(b"--") {
            break;
        }
        if body.get(pos..pos + 2) != Some(b"\r\n") {
            bail!("the multipart body is malformed after a boundary");
        }
        pos += 2;
        let head_end = find(body, b"\r\n\r\n", pos)
            .ok_or_else(|| anyhow!("a multipart part has no end of headers"))?;
        let head = std::str::from_utf8(&body[pos..head_end])
            .map_err(|_| anyhow!("a multipart part's headers are not UTF-8"))?;
        let start = head_end + 4;
        let end = find(body, close.as_bytes(), start)
            .ok_or_else(|| anyhow!("a multipart part is not closed by its boundary"))?;
        let disposition = head
            .lines()
            .find(|l| l.to_ascii_lowercase().starts_with("content-disposition:"))
            .unwrap_or("");
        let param = |key: &str| {
            disposition.split(';').map(str::trim).find_map(|p| {
                p.strip_prefix(key)
                    .and_then(|v| v.strip_prefix('='))
                    .map(|v| v.trim_matches('"').to_string())
            })
        };
        let names = [param("name"), param("filename")];
        let is = |want: &str| {
            names
                .iter()
                .flatten()
                .any(|n| n == want || n.rsplit('/').next() == Some(want))
        };
        let part = body.slice(start..end);
        if is("adapter_config.json") {
            config = Some(part);
        } else if is("adapter_model.safetensors") {
            weights = Some(part);
        } else if is("adapter_model.bin") {
            bail!("adapter_model.bin is a pickled PyTorch file, which Pagoda does not load; convert it with PEFT (`model.save_pretrained(dir, safe_serialization=True)`) to adapter_model.safetensors");
        } else {
            bail!(
                "unexpected multipart part {:?}: send adapter_config.json and adapter_model.safetensors",
                names.iter().flatten().next().cloned().unwrap_or_default()
            );
        }
        pos = end + 2;
    }
    match (config, weights) {
        (Some(config), Some(weights)) => Ok(AdapterUpload { config, weights }),
        (None, _) => bail!("the upload has no adapter_config.json part"),
        (_, None) => bail!("the upload has no adapter_model.safetensors part"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn part(name: &str, body: &[u8]) -> Vec<u8> {
        let mut v = format!(
            "--XyZ\r\nContent-Disposition: form-data; name=\"{name}\"; filename=\"{name}\"\r\nContent-Type: application/octet-stream\r\n\r\n"
        )
        .into_bytes();
        v.extend_from_slice(body);
        v.extend_from_slice(b"\r\n");
        v
    }

    #[test]
    fn multipart_finds_both_files_and_refuses_what_is_not_an_adapter() {
        let mut body = part("adapter_config.json", b"{\"r\": 8}");
        // Binary content holding CR LF and dashes stays whole.
        body.extend(part("adapter_model.safetensors", b"\x00\r\n--X\r\n\xff"));
        body.extend_from_slice(b"--XyZ--\r\n");
        let ct = "multipart/form-data; boundary=XyZ";
        let body = Bytes::from(body);
        let up = parse_multipart(ct, &body).expect("parsed");
        assert_eq!(&up.config[..], b"{\"r\": 8}");
        assert_eq!(&up.weights[..], b"\x00\r\n--X\r\n\xff");

        let mut one = part("adapter_config.json", b"{}");
        one.extend_from_slice(b"--XyZ--\r\n");
        let e = parse_multipart(ct, &Bytes::from(one))
            .err()
            .expect("refused");
        assert!(format!("{e}").contains("adapter_model.safetensors"), "{e}");

        let mut bin = part("adapter_model.bin", b"pickle");
        bin.extend_from_slice(b"--XyZ--\r\n");
        let e = parse_multipart(ct, &Bytes::from(bin))
            .err()
            .expect("refused");
        assert!(format!("{e}").contains("safetensors"), "{e}");

        let e = parse_multipart("application/octet-stream", &body)
            .err()
            .expect("refused");
        assert!(format!("{e}").contains("multipart/form-data"), "{e}");
        assert!(parse_multipart(ct, &Bytes::from_static(b"--XyZ\r\nno end")).is_err());
    }

    #[test]
    fn resident_limits_evict_the_least_recently_used_idle_adapter_first() {
        fn resident(bytes: usize, used: Instant) -> Resident {
            let adapter = LoraAdapter {
                rank: 1,
                scaling: 1.0,
                modules: [(
                    (0, crate::engine::lora::LoraModule::Q),
                    crate::engine::lora::LoraWeights {
                        a: vec![0.0; bytes / 8],
                        b: vec![0.0; bytes / 8],
                        rank: 1,
                        in_dim: bytes / 8,
                        out_dim: 1,
                    },
                )]
                .into(),
            };
            Resident {
                lora: Arc::new(LoadedLora {
                    id: 1,
                    name: "x".into(),
                    path: Default::default(),
                    adapter,
                }),
                used,
            }
        }
        let t0 = Instant::now();
        let mut slots: BTreeMap<String, AdapterSlot> = BTreeMap::new();
        for (i, n) in ["a", "b", "c"].into_iter().enumerate() {
            let s = slots.entry(n.into()).or_default();
            s.active = Some(1);
            s.loaded.insert(
                1,
                resident(800, t0 + std::time::Duration::from_millis(i as u64)),
            );
        }
        let count = AdapterLimits {
            max_resident: Some(3),
            ..AdapterLimits::default()
        };
        // "a" is the least recently used, but a request holds it: "b" goes.
        let held = Arc::clone(&slots["a"].loaded[&1].lora);
        assert!(make_room("t", &mut slots, &count, "d", 800));
        assert!(!slots["a"].loaded.is_empty() && slots["b"].loaded.is_empty());
        // With every other adapter held, the least recently used goes
        // anyway (its request keeps its own reference).
        let held_c = Arc::clone(&slots["c"].loaded[&1].lora);
        let two = AdapterLimits {
            max_resident: Some(2),
            ..AdapterLimits::default()
        };
        assert!(make_room("t", &mut slots, &two, "d", 800));
        assert!(slots["a"].loaded.is_empty() && !slots["c"].loaded.is_empty());
        assert_eq!(held.adapter.size_bytes(), 800, "{}", held_c.name);
        // Bytes: room for 1000 keeps one of 800, never one of 1200.
        let bytes = AdapterLimits {
            max_resident_bytes: Some(1000),
            ..AdapterLimits::default()
        };
        assert!(!make_room("t", &mut slots, &bytes, "d", 1200));
        assert!(!slots["c"].loaded.is_empty(), "evicted for nothing");
        assert!(make_room("t", &mut slots, &bytes, "d", 800));
        assert!(slots["c"].loaded.is_empty());
        assert!(!make_room(
            "t",
            &mut slots,
            &AdapterLimits {
                max_resident: Some(0),
                ..AdapterLimits::default()
            },
            "d",
            8
        ));
    }
}
