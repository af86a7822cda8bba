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

use super::shared::{Manifest, ManifestPlugin, ReadManifest, StateStore};
use super::{store, PluginSlot, Tenant, TenantConfig, Tenants, VersionRecord};
use crate::plugins::{Limits, LoadedPlugin};
use anyhow::{anyhow, Context, Result};
use object_store::UpdateVersion;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

/// What this replica last applied of a tenant's manifest.
#[derive(Clone, Debug, Default)]
pub(super) struct Seen {
    pub e_tag: Option<String>,
    pub revision: u64,
}

/// The manifest version an admin change is based on.
pub(super) struct Basis {
    pub version: Option<UpdateVersion>,
    pub revision: u64,
}

impl Tenants {
    /// Shares this server's tenants through `store` from now on, hashing
    /// keys with `salt` (the store's).
    pub fn with_store(mut self, store: Arc<StateStore>, salt: Option<[u8; 32]>) -> Result<Tenants> {
        if self.dir.is_none() {
            anyhow::bail!("--state-store needs --state-dir for the local cache");
        }
        if let Some(s) = salt {
            self.set_salt(s)?;
        }
        self.shared = Some(store);
        Ok(self)
    }

    /// The shared store, if there is one.
    pub fn state_store(&self) -> Option<&Arc<StateStore>> {
        self.shared.as_ref()
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
        self.salt_confirmed
            .store(true, std::sync::atomic::Ordering::Release);
        Ok(())
    }

    /// Brings this replica in line with the store: every changed manifest
    /// applied, every tenant the store no longer has dropped.
    pub async fn sync_from_store(&self) -> Result<()> {
        let Some(shared) = self.shared.clone() else {
            return Ok(());
        };
        if !self
            .salt_confirmed
            .load(std::sync::atomic::Ordering::Acquire)
        {
            let salt = shared.salt(self.salt()).await?;
            self.set_salt(salt)?;
        }
        // Never interleaved with this replica's own admin changes: one
        // that landed between the listing and the lock would look like a
        // tenant the store does not have.
        let _w = self.writes.lock().await;
        let listed = shared.list_manifests().await?;
        for (id, e_tag) in &listed {
            let known = self.seen_of(id).and_then(|s| s.e_tag);
            if e_tag.is_some() && known == *e_tag && self.get(id).is_some() {
                continue;
            }
            let read = shared.read_manifest(id).await?;
            if let Err(e) = self.apply_manifest(id, read).await {
                tracing::error!("tenant {id}: cannot apply the shared state: {e:#}");
            }
        }
        for id in self.ids() {
            if !listed.contains_key(&id) {
                tracing::info!("tenant {id} is not in the state store; dropping it");
                self.remove_local(&id).await?;
                self.seen_lock().remove(&id);
            }
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
        self.seen_lock()
            .insert(id.to_string(), Seen { e_tag, revision });
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
    /// returns what the change is based on. `None` without a store.
    pub(super) async fn begin_write(
        &self,
        id: &str,
    ) -> Result<Option<(tokio::sync::MutexGuard<'_, ()>, Basis)>> {
        let Some(shared) = self.shared.clone() else {
            return Ok(None);
        };
        let guard = self.writes.lock().await;
        let read = shared.read_manifest(id).await?;
        let e_tag = read.basis.as_ref().and_then(|b| b.e_tag.clone());
        let revision = read.manifest.as_ref().map_or(0, |m| m.revision);
        let version = read.basis.clone();
        let known = self.seen_of(id).and_then(|s| s.e_tag);
        if e_tag.is_none() || known != e_tag {
            self.apply_manifest(id, read).await?;
        }
        Ok(Some((guard, Basis { version, revision })))
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
        Manifest {
            revision: 0,
            deleted: false,
            config,
            plugins,
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
        self.cache(&m).await?;
        let tenant = existing.unwrap_or_else(|| self.get_or_insert(&m.config));
        let old_hashes = tenant.snapshot().config.api_key_hashes.clone();
        *tenant
            .plugins
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = slots;
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
