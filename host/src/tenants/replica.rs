//! A replica's tenants kept in step with the shared state store
//! ([`super::shared`]).
//!
//! The store is the truth; `--state-dir` is this replica's cache of it, so
//! a restart while the store is down still serves every tenant it knew.
//! - Reading: [`Tenants::sync_from_store`] runs at start-up and then every
//!   `--state-poll-seconds`. It lists the manifests, applies each one whose
//!   e-tag changed (fetching plugin components it has not seen, compiling
//!   them, and hot-swapping as an upload does), and drops tenants the store
//!   no longer has.
//! - Writing: an admin change first re-reads the tenant's manifest (and
//!   applies it if another replica changed it), computes the change from
//!   that, writes the new manifest conditionally on the version it read,
//!   and only then changes this replica. A lost race is a 409 with nothing
//!   changed; an unreachable store is a 503 with nothing changed.

use super::adapters::AdapterSlot;
use super::shared::{
    is_unavailable, Manifest, ManifestPlugin, ReadManifest, SaltCheck, StateStore,
};
use super::{store, PluginSlot, Tenant, TenantConfig, Tenants, VersionRecord};
use crate::plugins::{Limits, LoadedPlugin};
use anyhow::{anyhow, Context, Result};
use object_store::UpdateVersion;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

/// What this replica last applied of a tenant's manifest.
#[derive(Clone, Debug, Default)]
pub(super) struct Seen {
    pub e_tag: Option<String>,
    pub revision: u64,
    /// Why the manifest of `e_tag` could not be applied (the tenant is
    /// held at `revision`); reported once per e-tag, not on every poll.
    pub fault: Option<String>,
}

/// The manifest version an admin change is based on.
pub(super) struct Basis {
    pub version: Option<UpdateVersion>,
    pub revision: u64,
    /// Whether the store holds a live (or corrupt) manifest for the
    /// tenant, which a delete must replace with a tombstone even when
    /// this replica never had the tenant.
    pub live: bool,
}

/// How this replica's sync with the store stands, beyond each tenant's
/// [`Seen`].
#[derive(Debug)]
pub(super) struct SyncState {
    /// Whether one poll has read the whole store: until then the server
    /// is not ready.
    pub synced: AtomicBool,
    /// Tenants a poll found missing from the store and did not drop,
    /// because more than `max_drop_fraction` of them went at once.
    pub held_drop: Mutex<Option<BTreeSet<String>>>,
    /// Set by an admin's confirmation: the next poll drops what is held.
    pub drop_confirmed: AtomicBool,
    /// `--state-store-max-drop-fraction`.
    pub max_drop_fraction: f64,
    /// Why this replica refuses to serve: its key salt is not the store's.
    pub salt_conflict: Mutex<Option<String>>,
}

impl Default for SyncState {
    fn default() -> Self {
        SyncState {
            synced: AtomicBool::new(false),
            held_drop: Mutex::new(None),
            drop_confirmed: AtomicBool::new(false),
            max_drop_fraction: 0.5,
            salt_conflict: Mutex::new(None),
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Tenants {
    /// Shares this server's tenants through `store` from now on, hashing
    /// keys with `salt` (the store's). A poll that finds more than
    /// `max_drop_fraction` of the tenants gone from the store (all of
    /// them, always) holds them as a suspected store fault.
    pub fn with_store(
        mut self,
        store: Arc<StateStore>,
        salt: Option<[u8; 32]>,
        max_drop_fraction: f64,
    ) -> Result<Tenants> {
        if self.dir.is_none() {
            anyhow::bail!("--state-store needs --state-dir for the local cache");
        }
        if !(0.0..=1.0).contains(&max_drop_fraction) {
            anyhow::bail!(
                "--state-store-max-drop-fraction {max_drop_fraction} must be between 0 and 1"
            );
        }
        if let Some(s) = salt {
            self.set_salt(s)?;
        }
        self.shared = Some(store);
        self.sync.max_drop_fraction = max_drop_fraction;
        Ok(self)
    }

    /// The shared store, if there is one.
    pub fn state_store(&self) -> Option<&Arc<StateStore>> {
        self.shared.as_ref()
    }

    /// Why this server must not serve now: its store has not been read
    /// yet, or its key salt is not the store's. `None` without a store.
    pub fn not_serving(&self) -> Option<String> {
        let shared = self.shared.as_ref()?;
        if let Some(why) = lock(&self.sync.salt_conflict).clone() {
            return Some(why);
        }
        (!self.sync.synced.load(Ordering::Acquire)).then(|| {
            format!(
                "The server has not read its state store {} yet; it serves once it has.",
                shared.url()
            )
        })
    }

    /// Why the salt conflicts, if it does (requests are refused then).
    pub fn salt_conflict(&self) -> Option<String> {
        lock(&self.sync.salt_conflict).clone()
    }

    /// The tenants a poll is holding back from being dropped.
    pub fn held_drop(&self) -> Vec<String> {
        lock(&self.sync.held_drop)
            .as_ref()
            .map(|h| h.iter().cloned().collect())
            .unwrap_or_default()
    }

    /// An admin's word that the tenants held back are really gone: drops
    /// them now (through a poll) and returns their ids.
    pub async fn confirm_drop(&self) -> Result<Vec<String>> {
        let held = self.held_drop();
        if held.is_empty() {
            return Ok(held);
        }
        self.sync.drop_confirmed.store(true, Ordering::Release);
        self.sync_from_store().await?;
        Ok(held
            .into_iter()
            .filter(|id| self.get(id).is_none())
            .collect())
    }

    /// Why tenant `id`'s shared state is not applied here, if it is not.
    pub fn state_fault(&self, id: &str) -> Option<String> {
        self.seen_of(id).and_then(|s| s.fault)
    }

    /// Makes `salt` the key salt, here and in the cache.
    fn set_salt(&self, salt: [u8; 32]) -> Result<()> {
        if let Some(dir) = &self.dir {
            if self.salt() != salt {
                store::write_atomic(&dir.join("key-salt"), &salt)?;
            }
        }
        *self
            .salt
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = salt;
        super::metric_label::set_secret(&salt);
        self.salt_confirmed.store(true, Ordering::Release);
        Ok(())
    }

    /// Brings this replica in line with the store: every changed manifest
    /// applied (one that cannot be leaves only its own tenant behind),
    /// every tenant the store no longer has dropped unless too many went
    /// at once, and the key salt checked.
    pub async fn sync_from_store(&self) -> Result<()> {
        let Some(shared) = self.shared.clone() else {
            return Ok(());
        };
        if !self.salt_confirmed.load(Ordering::Acquire) {
            let salt = shared.salt(self.salt()).await?;
            self.set_salt(salt)?;
        } else {
            self.check_salt(&shared).await?;
        }
        // Never interleaved with this replica's own admin changes: one
        // that landed between the listing and the lock would look like a
        // tenant the store does not have.
        let _w = self.writes.lock().await;
        let listed = shared.list_manifests().await?;
        for (id, e_tag) in &listed {
            let seen = self.seen_of(id);
            let known = seen.as_ref().and_then(|s| s.e_tag.clone());
            let held = self.get(id).is_some() || seen.as_ref().is_some_and(|s| s.fault.is_some());
            if e_tag.is_some() && known == *e_tag && held {
                continue;
            }
            let mut read = shared.read_manifest(id).await?;
            let read_tag = read.basis.as_ref().and_then(|b| b.e_tag.clone());
            if let Some(bad) = read.corrupt.take() {
                self.hold_at_last_good(id, read_tag, &anyhow::Error::from(bad));
                continue;
            }
            if let Err(e) = self.apply_manifest(id, read).await {
                if is_unavailable(&e) {
                    return Err(e);
                }
                self.hold_at_last_good(id, read_tag, &e);
            }
        }
        self.drop_missing(&listed).await?;
        if !self.sync.synced.swap(true, Ordering::AcqRel) {
            tracing::info!("state store {}: read; serving", shared.url());
        }
        Ok(())
    }

    /// Compares the store's key salt with this replica's: restores it if
    /// it is gone; refuses to serve (until they agree) if it differs.
    async fn check_salt(&self, shared: &StateStore) -> Result<()> {
        let held = self.salt();
        let found = shared.check_salt(held).await?;
        let mut conflict = lock(&self.sync.salt_conflict);
        match found {
            SaltCheck::Same | SaltCheck::Restored => {
                if found == SaltCheck::Restored {
                    tracing::warn!(
                        "state store {}: key-salt was missing; wrote back the salt this replica holds",
                        shared.url()
                    );
                }
                if conflict.take().is_some() {
                    tracing::warn!(
                        "state store {}: key-salt agrees with this replica again; serving",
                        shared.url()
                    );
                    ::metrics::gauge!(super::shared::metrics::SALT_CONFLICT).set(0.0);
                }
            }
            SaltCheck::Differs(_) => {
                if conflict.is_none() {
                    let why = format!(
                        "This replica's API-key salt is not the state store's ({}/key-salt was replaced while it ran), so keys would not match across replicas; it refuses requests until the store's key-salt is restored to the one in its --state-dir/key-salt, or it is restarted to adopt the store's.",
                        shared.url()
                    );
                    tracing::error!("{why}");
                    ::metrics::gauge!(super::shared::metrics::SALT_CONFLICT).set(1.0);
                    *conflict = Some(why);
                }
            }
        }
        Ok(())
    }

    /// Keeps tenant `id` at what this replica last applied, because the
    /// store's manifest (e-tag `e_tag`) cannot be applied: logged and
    /// counted once per e-tag.
    fn hold_at_last_good(&self, id: &str, e_tag: Option<String>, e: &anyhow::Error) {
        let mut seen = self.seen_lock();
        let s = seen.entry(id.to_string()).or_default();
        let new = s.e_tag != e_tag || s.fault.is_none() || e_tag.is_none();
        let why = format!("{e:#}");
        if new {
            tracing::warn!(
                tenant = %id,
                "tenant {id}: its shared state cannot be applied, so this replica keeps its last good state (revision {}): {why}",
                s.revision
            );
            let label = super::metric_label::of(id);
            ::metrics::counter!(super::shared::metrics::TENANT_ERRORS, "tenant" => label.clone())
                .increment(1);
            ::metrics::gauge!(super::shared::metrics::TENANT_FAULTY, "tenant" => label).set(1.0);
        }
        s.e_tag = e_tag;
        s.fault = Some(why);
    }

    /// Drops the tenants the store's listing lacks, unless that is more
    /// than `max_drop_fraction` of them (or all): an emptied bucket or a
    /// wrong prefix looks just like that, and dropping every tenant would
    /// leave keys that worked a minute ago refused everywhere. Deletions
    /// through the admin API leave tombstones, so they never come here.
    async fn drop_missing(&self, listed: &BTreeMap<String, Option<String>>) -> Result<()> {
        let ids = self.ids();
        let missing: BTreeSet<String> = ids
            .iter()
            .filter(|id| !listed.contains_key(*id))
            .cloned()
            .collect();
        let too_many = !missing.is_empty()
            && (missing.len() == ids.len()
                || missing.len() as f64 > self.sync.max_drop_fraction * ids.len() as f64);
        let confirmed = self.sync.drop_confirmed.swap(false, Ordering::AcqRel);
        {
            let mut held = lock(&self.sync.held_drop);
            if too_many && !confirmed {
                if held.as_ref() != Some(&missing) {
                    tracing::error!(
                        "state store: {} of {} tenants are gone from the store at once ({}); suspecting a store fault, so they are kept. If they really were removed, confirm with POST /admin/v1/state-store/confirm-drop",
                        missing.len(),
                        ids.len(),
                        missing.iter().cloned().collect::<Vec<_>>().join(", ")
                    );
                    ::metrics::counter!(super::shared::metrics::REFUSED_DROPS).increment(1);
                    ::metrics::gauge!(super::shared::metrics::DROP_HELD).set(1.0);
                    *held = Some(missing);
                }
                return Ok(());
            }
            if held.take().is_some() {
                if confirmed {
                    tracing::warn!("state store: an admin confirmed the drop of the held tenants");
                } else {
                    tracing::warn!("state store: the held tenants are back in the store (or few enough are missing); no longer holding");
                }
                ::metrics::gauge!(super::shared::metrics::DROP_HELD).set(0.0);
            }
        }
        for id in missing {
            tracing::warn!("tenant {id} is not in the state store; dropping it");
            self.remove_local(&id).await?;
            self.seen_lock().remove(&id);
        }
        Ok(())
    }

    fn seen_lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Seen>> {
        self.seen
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Notes that this replica now holds revision `revision` (e-tag
    /// `e_tag`) of tenant `id`'s manifest.
    fn record_seen(&self, id: &str, e_tag: Option<String>, revision: u64) {
        let old = self.seen_lock().insert(
            id.to_string(),
            Seen {
                e_tag,
                revision,
                fault: None,
            },
        );
        if old.is_some_and(|s| s.fault.is_some()) {
            tracing::warn!(tenant = %id, "tenant {id}: its shared state applies again (revision {revision})");
            let label = super::metric_label::of(id);
            ::metrics::gauge!(super::shared::metrics::TENANT_FAULTY, "tenant" => label).set(0.0);
        }
    }

    fn seen_of(&self, id: &str) -> Option<Seen> {
        self.seen_lock().get(id).cloned()
    }

    /// The revision of the manifest this replica last applied for `id`.
    pub fn revision_of(&self, id: &str) -> Option<u64> {
        self.shared.as_ref()?;
        self.seen_of(id).map(|s| s.revision)
    }

    /// Before an admin change: holds this replica's write lock, re-reads
    /// tenant `id`'s manifest (applying it if it changed elsewhere), and
    /// returns what the change is based on. `None` without a store. A
    /// manifest that is corrupt, or that cannot be applied, does not stop
    /// the change: the change is computed from this replica's last good
    /// state and replaces it, which is how an admin repairs it.
    pub(super) async fn begin_write(
        &self,
        id: &str,
    ) -> Result<Option<(tokio::sync::MutexGuard<'_, ()>, Basis)>> {
        let Some(shared) = self.shared.clone() else {
            return Ok(None);
        };
        let guard = self.writes.lock().await;
        let mut read = shared.read_manifest(id).await?;
        let e_tag = read.basis.as_ref().and_then(|b| b.e_tag.clone());
        let seen = self.seen_of(id).unwrap_or_default();
        let revision = read.manifest.as_ref().map_or(seen.revision, |m| m.revision);
        let live = read.corrupt.is_some() || read.manifest.as_ref().is_some_and(|m| !m.deleted);
        let version = read.basis.clone();
        if let Some(bad) = read.corrupt.take() {
            tracing::warn!(tenant = %id, "{bad}: this admin change replaces it");
        } else if read.basis.is_some() && (e_tag.is_none() || seen.e_tag != e_tag) {
            // (A manifest that is simply absent is not applied: dropping a
            // tenant because its manifest went missing is the polls' call,
            // under their guard; this change re-creates it.)
            if let Err(e) = self.apply_manifest(id, read).await {
                if is_unavailable(&e) {
                    return Err(e);
                }
                tracing::warn!(tenant = %id, "tenant {id}: the store's state cannot be applied ({e:#}); this admin change replaces it");
            }
        }
        Ok(Some((
            guard,
            Basis {
                version,
                revision,
                live,
            },
        )))
    }

    /// Writes tenant `id`'s new manifest on `basis`; a 409 (Conflict) if
    /// another replica wrote first.
    pub(super) async fn commit(&self, id: &str, basis: &Basis, mut m: Manifest) -> Result<()> {
        let Some(shared) = &self.shared else {
            return Ok(());
        };
        m.revision = basis.revision + 1;
        for p in m.plugins.values_mut() {
            for r in p.versions.values_mut() {
                r.cwasm_sha256 = None;
            }
        }
        let e_tag = shared.write_manifest(id, &m, basis.version.clone()).await?;
        self.record_seen(id, e_tag, m.revision);
        Ok(())
    }

    /// The manifest of this replica's view of `tenant` with `config`.
    pub(super) fn manifest_of(&self, tenant: Option<&Tenant>, config: TenantConfig) -> Manifest {
        let plugins = tenant
            .map(|t| {
                t.plugins
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .iter()
                    .map(|(name, s)| {
                        (
                            name.clone(),
                            ManifestPlugin {
                                versions: s.versions.clone(),
                                active: s.active,
                                history: s.history.clone(),
                            },
                        )
                    })
                    .collect()
            })
            .unwrap_or_default();
        let adapters = tenant
            .map(|t| {
                t.adapters
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .iter()
                    .map(|(name, s)| {
                        (
                            name.clone(),
                            super::shared::ManifestSlot {
                                versions: s.versions.clone(),
                                active: s.active,
                                history: s.history.clone(),
                            },
                        )
                    })
                    .collect()
            })
            .unwrap_or_default();
        Manifest {
            revision: 0,
            deleted: false,
            config,
            plugins,
            adapters,
        }
    }

    /// Makes this replica's tenant `id` what `read` says: created, updated
    /// (plugins fetched and hot-swapped) or removed.
    async fn apply_manifest(&self, id: &str, read: ReadManifest) -> Result<()> {
        let e_tag = read.basis.as_ref().and_then(|b| b.e_tag.clone());
        let m = match read.manifest {
            Some(m) if !m.deleted => m,
            other => {
                self.remove_local(id).await?;
                self.record_seen(id, e_tag, other.map_or(0, |m| m.revision));
                return Ok(());
            }
        };
        if m.config.id != id {
            anyhow::bail!("the manifest of tenant {id} names tenant {}", m.config.id);
        }
        let existing = self.get(id);
        let mut slots: BTreeMap<String, PluginSlot> = BTreeMap::new();
        for (name, p) in &m.plugins {
            let mut slot = PluginSlot {
                versions: p.versions.clone(),
                loaded: HashMap::new(),
                active: p.active,
                history: p.history.clone(),
            };
            // Versions already compiled here stay (rollback is instant).
            if let Some(t) = &existing {
                let held = t
                    .plugins
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                if let Some(old) = held.get(name) {
                    for (v, l) in &old.loaded {
                        if p.versions.get(v).is_some_and(|r| r.sha256 == l.sha256) {
                            slot.loaded.insert(*v, Arc::clone(l));
                        }
                    }
                }
            }
            if let Some(v) = p.active {
                let r = p.versions.get(&v).ok_or_else(|| {
                    anyhow!("plugin {name}: the active version {v} has no record")
                })?;
                if !slot.loaded.contains_key(&v) {
                    let l = self
                        .load_shared_version(id, name, r, &m.config.plugin_limits)
                        .await?;
                    slot.loaded.insert(v, l);
                }
            }
            slot.prune(true);
            slots.insert(name.clone(), slot);
        }
        let mut adapter_slots: BTreeMap<String, AdapterSlot> = BTreeMap::new();
        for (name, a) in &m.adapters {
            let mut slot = AdapterSlot {
                versions: a.versions.clone(),
                loaded: HashMap::new(),
                active: a.active,
                history: a.history.clone(),
            };
            // The resident version stays resident if it is still the
            // active one, with the same content.
            if let (Some(t), Some(v)) = (&existing, a.active) {
                let held = t
                    .adapters
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                if let Some(r) = held.get(name).and_then(|old| {
                    let same = old.versions.get(&v)? == a.versions.get(&v)?;
                    same.then(|| old.loaded.get(&v).cloned()).flatten()
                }) {
                    slot.loaded.insert(v, r);
                }
            }
            // The active version's files into the cache, so it loads
            // while the store is unreachable.
            if let Some(v) = a.active {
                let r = a.versions.get(&v).ok_or_else(|| {
                    anyhow!("adapter {name}: the active version {v} has no record")
                })?;
                self.cache_adapter_files(id, r).await?;
            }
            adapter_slots.insert(name.clone(), slot);
        }
        self.cache(&m).await?;
        let tenant = existing.unwrap_or_else(|| self.get_or_insert(&m.config));
        let old_hashes = tenant.snapshot().config.api_key_hashes.clone();
        *tenant
            .plugins
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = slots;
        *tenant
            .adapters
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = adapter_slots;
        self.index_keys(id, &old_hashes, &m.config.api_key_hashes);
        tenant.publish(m.config.clone());
        self.record_seen(id, e_tag, m.revision);
        Ok(())
    }

    /// Writes the manifest's tenant config, version records and active
    /// pointers into the local cache.
    async fn cache(&self, m: &Manifest) -> Result<()> {
        let Some(dir) = self.dir.clone() else {
            return Ok(());
        };
        let m = m.clone();
        tokio::task::spawn_blocking(move || -> Result<()> {
            store::save_tenant(&dir, &m.config)?;
            for (name, p) in &m.plugins {
                for r in p.versions.values() {
                    store::save_record_if_absent(&dir, &m.config.id, name, r)?;
                }
                if let Some(a) = p.active {
                    store::save_active(&dir, &m.config.id, name, a, &p.history)?;
                }
            }
            for (name, a) in &m.adapters {
                for r in a.versions.values() {
                    super::adapters::disk::save_adapter_record(&dir, &m.config.id, name, r)?;
                }
                if let Some(v) = a.active {
                    store::save_active_of(
                        &dir,
                        &m.config.id,
                        store::Kind::Adapters,
                        name,
                        v,
                        &a.history,
                    )?;
                }
            }
            // Adapters the store no longer has leave the cache, with the
            // files no remaining version names.
            let keep: std::collections::BTreeSet<String> = m
                .adapters
                .values()
                .flat_map(|a| a.versions.values())
                .flat_map(|r| [r.config_sha256.clone(), r.weights_sha256.clone()])
                .collect();
            for name in super::adapters::disk::adapter_names(&dir, &m.config.id) {
                if !m.adapters.contains_key(&name) {
                    super::adapters::disk::delete_adapter(&dir, &m.config.id, &name, &keep)?;
                }
            }
            Ok(())
        })
        .await
        .map_err(|e| anyhow!("the cache task failed: {e}"))?
    }

    /// Loads version `r` of plugin `name`: from the local cache when it
    /// holds the component, else fetched from the store into the cache.
    pub(super) async fn load_shared_version(
        &self,
        id: &str,
        name: &str,
        r: &VersionRecord,
        limits: &Limits,
    ) -> Result<Arc<LoadedPlugin>> {
        let dir = self
            .dir
            .clone()
            .ok_or_else(|| anyhow!("--state-store needs --state-dir"))?;
        let cached = {
            let (dir, id, name, r) = (dir.clone(), id.to_string(), name.to_string(), r.clone());
            tokio::task::spawn_blocking(move || store::cached_component(&dir, &id, &name, &r))
                .await
                .map_err(|e| anyhow!("the cache task failed: {e}"))?
        };
        if !cached {
            let shared = self
                .shared
                .clone()
                .ok_or_else(|| anyhow!("version {} of {name} is not in the cache", r.version))?;
            let wasm = shared.get_blob(&r.sha256).await?;
            let (dir, id, name, r) = (dir.clone(), id.to_string(), name.to_string(), r.clone());
            tokio::task::spawn_blocking(move || store::save_component(&dir, &id, &name, &r, &wasm))
                .await
                .map_err(|e| anyhow!("the cache task failed: {e}"))??;
        }
        let rt = Arc::clone(&self.runtime);
        let plugin = name.to_string();
        let (id, name, r, limits) = (id.to_string(), name.to_string(), r.clone(), limits.clone());
        tokio::task::spawn_blocking(move || {
            // The cache's record knows its own artifact's hash.
            let record = store::cached_record(&dir, &id, &name, r.version)
                .filter(|c| c.sha256 == r.sha256)
                .unwrap_or(r);
            store::load_version(&rt, &dir, &id, &name, &record, &limits)
        })
        .await
        .map_err(|e| anyhow!("the loader task failed: {e}"))?
        .with_context(|| format!("cannot load plugin {plugin}"))
    }

    /// Drops tenant `id` from this replica and its cache.
    pub(super) async fn remove_local(&self, id: &str) -> Result<()> {
        let Some(t) = self.get(id) else {
            return Ok(());
        };
        if let Some(dir) = self.dir.clone() {
            let id2 = id.to_string();
            tokio::task::spawn_blocking(move || store::delete_tenant(&dir, &id2))
                .await
                .map_err(|e| anyhow!("{e}"))??;
        }
        let c = t.snapshot().config.clone();
        self.index_keys(id, &c.api_key_hashes, &[]);
        self.map
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(id);
        Ok(())
    }
}
