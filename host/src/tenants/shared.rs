//! Tenant and plugin state shared by replicas through an object store
//! (`--state-store s3://bucket/prefix`, `gs://…`, `az://…`, `file:///path`).
//!
//! Layout under the store's prefix:
//! - `key-salt`: the 32-byte salt of the API-key hashes, written once (the
//!   first replica's), so that every replica hashes a key alike.
//! - `blobs/<sha256>`: plugin components and adapter files, immutable,
//!   named by their content.
//!   Compiled artifacts are native code for one machine and stay in each
//!   replica's `--state-dir`.
//! - `tenants/<id>/manifest.json`: one [`Manifest`] per tenant: its config,
//!   key hashes, plugin chain and versions. It is only ever replaced by a
//!   conditional write on the version that was read (`PutMode::Update`), so
//!   two replicas that change one tenant at once never lose an update: the
//!   second write fails with [`StoreError::Conflict`]. A deleted tenant
//!   leaves a tombstone written the same way, so a delete cannot silently
//!   undo a concurrent update either.

use super::adapters::AdapterRecord;
use super::{TenantConfig, VersionRecord};
use anyhow::{anyhow, Context, Result};
use bytes::Bytes;
use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload, UpdateVersion};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// Metric names (described in the server's metrics setup).
pub mod metrics {
    /// 1 while the last operation on the state store succeeded, else 0.
    pub const UP: &str = "pagoda_state_store_up";
    /// Operations on the state store that failed because it was unreachable.
    pub const ERRORS: &str = "pagoda_state_store_errors_total";
    /// Manifests (or the plugin components they name) this replica could
    /// not apply, by `tenant` label: the tenant stays at its last good
    /// state, every other tenant keeps syncing.
    pub const TENANT_ERRORS: &str = "pagoda_state_store_tenant_errors_total";
    /// 1 while tenant `tenant`'s shared state cannot be applied here.
    pub const TENANT_FAULTY: &str = "pagoda_state_store_tenant_faulty";
    /// Polls that would have dropped more tenants than
    /// `--state-store-max-drop-fraction` allows, refused as a suspected
    /// store fault.
    pub const REFUSED_DROPS: &str = "pagoda_state_store_refused_drops_total";
    /// 1 while such a drop is held back (until the store has the tenants
    /// again or an admin confirms it).
    pub const DROP_HELD: &str = "pagoda_state_store_drop_held";
    /// 1 while this replica's key salt disagrees with the store's
    /// `key-salt` (it then refuses to serve).
    pub const SALT_CONFLICT: &str = "pagoda_state_store_salt_conflict";
}

/// One tenant's state as the store holds it.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Manifest {
    /// Bumped by every write: tells which of several writes landed last.
    pub revision: u64,
    /// A tombstone: the tenant was deleted at this revision.
    pub deleted: bool,
    pub config: TenantConfig,
    pub plugins: BTreeMap<String, ManifestPlugin>,
    /// The tenant's own LoRA adapters (their files are blobs too).
    pub adapters: BTreeMap<String, ManifestSlot<AdapterRecord>>,
}

/// A versioned object's versions in a [`Manifest`] (a plugin's, an
/// adapter's).
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default)]
pub struct ManifestSlot<R> {
    /// The records (a plugin's without artifact hashes: those are per
    /// machine).
    pub versions: BTreeMap<u64, R>,
    pub active: Option<u64>,
    pub history: Vec<u64>,
}

impl<R> Default for ManifestSlot<R> {
    fn default() -> Self {
        ManifestSlot {
            versions: BTreeMap::new(),
            active: None,
            history: Vec::new(),
        }
    }
}

/// A plugin's versions in a [`Manifest`].
pub type ManifestPlugin = ManifestSlot<VersionRecord>;

/// A manifest as read, with the version a conditional write is based on.
pub struct ReadManifest {
    /// None: the tenant has never been written (a tombstone is `Some`),
    /// or its object is corrupt (see `corrupt`).
    pub manifest: Option<Manifest>,
    /// Why the object that is there is not a manifest: the tenant is
    /// held at its last good state until an admin replaces or deletes it.
    pub corrupt: Option<StoreError>,
    /// What [`StateStore::write_manifest`] must find to replace it.
    pub basis: Option<UpdateVersion>,
}

/// Why a store operation failed, as the admin API reports it.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// A conditional write found another replica's write in its place.
    #[error("tenant '{0}' was changed through another replica at the same time; read it again and retry")]
    Conflict(String),
    /// The store could not be reached (or answered with a server error).
    #[error("the state store {url} is unreachable ({detail}); requests are served from the local cache, and admin changes are refused until it is back")]
    Unavailable { url: String, detail: String },
    /// An object in the store is not what it must be (a manifest that does
    /// not parse, a component whose content does not match its name).
    #[error("the state store {url} holds a corrupt {object} ({detail}); {repair}")]
    Corrupt {
        url: String,
        object: String,
        detail: String,
        /// What an operator does about it.
        repair: &'static str,
    },
}

/// Whether `e` is the store being unreachable (which ends a poll) rather
/// than one tenant's bad state (which ends only that tenant's update).
pub fn is_unavailable(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        matches!(
            c.downcast_ref::<StoreError>(),
            Some(StoreError::Unavailable { .. })
        )
    })
}

/// What [`StateStore::check_salt`] found.
#[derive(Debug, PartialEq, Eq)]
pub enum SaltCheck {
    /// The store's `key-salt` is the one this replica holds.
    Same,
    /// The store had none: the one this replica holds was written back.
    Restored,
    /// The store holds another salt (these bytes, or `None` if unreadable).
    Differs(Option<[u8; 32]>),
}

/// What to do about a corrupt manifest.
const MANIFEST_REPAIR: &str = "the tenant is held at its last good state on every replica; replace it (PUT /admin/v1/tenants/ID) or delete it (DELETE /admin/v1/tenants/ID)";

/// The shared store of one server.
pub struct StateStore {
    store: Arc<dyn ObjectStore>,
    prefix: Path,
    /// `file://` only: `LocalFileSystem` has no conditional update, so a
    /// manifest is compared and replaced under an exclusive lock on this
    /// file, which every replica on the machine (or on a shared mount with
    /// working locks) takes.
    local_lock: Option<std::path::PathBuf>,
    url: String,
    /// Whether the last operation reached the store (for the transition log
    /// lines and the gauge).
    up: AtomicBool,
}

impl StateStore {
    /// Opens the store `url` names. Cloud credentials and endpoints come
    /// from the environment as each SDK names them (`AWS_ACCESS_KEY_ID`,
    /// `AWS_ENDPOINT_URL`, `AWS_ALLOW_HTTP`, `GOOGLE_SERVICE_ACCOUNT`,
    /// `AZURE_STORAGE_ACCOUNT_NAME`, ...).
    pub fn open(url: &str) -> Result<StateStore> {
        let opened = crate::object_url::open("--state-store", url)?;
        Ok(StateStore {
            store: opened.store,
            prefix: opened.prefix,
            // `file://` only: `LocalFileSystem` has no conditional update.
            local_lock: opened.local_root.map(|root| root.join(".manifest-lock")),
            url: url.to_string(),
            up: AtomicBool::new(true),
        })
    }

    /// The URL it was opened with.
    pub fn url(&self) -> &str {
        &self.url
    }

    fn path(&self, rel: &str) -> Path {
        rel.split('/')
            .fold(self.prefix.clone(), |p, part| p.join(part))
    }

    fn manifest_path(&self, id: &str) -> Path {
        self.path(&format!("tenants/{id}/manifest.json"))
    }

    /// Records that the store answered: the gauge, and a log line if it
    /// had been unreachable.
    fn reached(&self) {
        ::metrics::gauge!(metrics::UP).set(1.0);
        if !self.up.swap(true, Ordering::AcqRel) {
            tracing::info!("state store {} reachable again", self.url);
        }
    }

    /// Records that an operation could not reach the store (the gauge, the
    /// counter, and a log line on the change) and returns the error to
    /// report.
    fn unavailable(&self, what: &str, e: &object_store::Error) -> StoreError {
        ::metrics::gauge!(metrics::UP).set(0.0);
        ::metrics::counter!(metrics::ERRORS).increment(1);
        if self.up.swap(false, Ordering::AcqRel) {
            tracing::error!(
                "state store {} unreachable ({what}: {e}); serving from the local cache, admin changes get 503 until it is back",
                self.url
            );
        }
        StoreError::Unavailable {
            url: self.url.clone(),
            detail: format!("{what}: {e}"),
        }
    }

    /// Whether the last operation reached the store.
    pub fn is_up(&self) -> bool {
        self.up.load(Ordering::Acquire)
    }

    /// The bytes of `key-salt`, or `None` if the store has none.
    async fn read_salt(&self) -> Result<Option<Bytes>, StoreError> {
        match self.store.get(&self.path("key-salt")).await {
            Ok(r) => {
                let b = r
                    .bytes()
                    .await
                    .map_err(|e| self.unavailable("key-salt", &e))?;
                self.reached();
                Ok(Some(b))
            }
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(self.unavailable("key-salt", &e)),
        }
    }

    /// Writes `salt` as `key-salt` unless one is there (then `false`: another
    /// replica wrote first).
    async fn create_salt(&self, salt: [u8; 32]) -> Result<bool, StoreError> {
        let opts = PutOptions::from(PutMode::Create);
        match self
            .store
            .put_opts(
                &self.path("key-salt"),
                PutPayload::from(salt.to_vec()),
                opts,
            )
            .await
        {
            Ok(_) => {
                self.reached();
                Ok(true)
            }
            Err(object_store::Error::AlreadyExists { .. }) => {
                self.reached();
                Ok(false)
            }
            Err(e) => Err(self.unavailable("key-salt", &e)),
        }
    }

    /// The shared key salt: the store's if it has one, else `proposed`
    /// (the local cache's), written so every later replica uses it too.
    pub async fn salt(&self, proposed: [u8; 32]) -> Result<[u8; 32], StoreError> {
        for _ in 0..2 {
            match self.read_salt().await? {
                Some(b) => {
                    return <[u8; 32]>::try_from(b.as_ref()).map_err(|_| {
                        self.corrupt(
                            &self.path("key-salt"),
                            format!("{} bytes, not 32", b.len()),
                            "restore it from a backup, or from a running replica's --state-dir/key-salt",
                        )
                    });
                }
                None if self.create_salt(proposed).await? => return Ok(proposed),
                // Another replica wrote it first: read theirs.
                None => continue,
            }
        }
        Err(StoreError::Unavailable {
            url: self.url.clone(),
            detail: "key-salt vanished while being read".into(),
        })
    }

    /// Checks that the store's `key-salt` is still `held` (this replica's,
    /// read from the store before): writes it back, conditionally, if the
    /// object is gone (an emptied bucket, a wrong lifecycle rule), so that
    /// a replica started later adopts it instead of making its own.
    pub async fn check_salt(&self, held: [u8; 32]) -> Result<SaltCheck, StoreError> {
        for _ in 0..2 {
            match self.read_salt().await? {
                Some(b) => {
                    return Ok(match <[u8; 32]>::try_from(b.as_ref()) {
                        Ok(s) if s == held => SaltCheck::Same,
                        Ok(s) => SaltCheck::Differs(Some(s)),
                        Err(_) => SaltCheck::Differs(None),
                    })
                }
                None if self.create_salt(held).await? => return Ok(SaltCheck::Restored),
                // Another replica restored it (or wrote its own) first:
                // compare with that.
                None => continue,
            }
        }
        Err(StoreError::Unavailable {
            url: self.url.clone(),
            detail: "key-salt vanished while being read".into(),
        })
    }

    /// Reads tenant `id`'s manifest. An unreachable store is an error; a
    /// corrupt object is not (it comes back in `corrupt`, with the version
    /// an admin write replaces it on), so one bad manifest never stops
    /// the others from being read.
    pub async fn read_manifest(&self, id: &str) -> Result<ReadManifest> {
        let path = self.manifest_path(id);
        let r = match self.store.get(&path).await {
            Ok(r) => r,
            Err(object_store::Error::NotFound { .. }) => {
                self.reached();
                return Ok(ReadManifest {
                    manifest: None,
                    corrupt: None,
                    basis: None,
                });
            }
            Err(e) => return Err(self.unavailable(&format!("reading {path}"), &e).into()),
        };
        let basis = UpdateVersion {
            e_tag: r.meta.e_tag.clone(),
            version: r.meta.version.clone(),
        };
        let b = r
            .bytes()
            .await
            .map_err(|e| self.unavailable(&format!("reading {path}"), &e))?;
        self.reached();
        let (manifest, corrupt) = match serde_json::from_slice::<Manifest>(&b) {
            Ok(m) if m.config.id == id || m.deleted => (Some(m), None),
            Ok(m) => (
                None,
                Some(self.corrupt(
                    &path,
                    format!("it names tenant '{}'", m.config.id),
                    MANIFEST_REPAIR,
                )),
            ),
            Err(e) => (
                None,
                Some(self.corrupt(
                    &path,
                    format!("not a tenant manifest: {e}"),
                    MANIFEST_REPAIR,
                )),
            ),
        };
        Ok(ReadManifest {
            manifest,
            corrupt,
            basis: Some(basis),
        })
    }

    fn corrupt(&self, path: &Path, detail: String, repair: &'static str) -> StoreError {
        StoreError::Corrupt {
            url: self.url.clone(),
            object: path.to_string(),
            detail,
            repair,
        }
    }

    /// Replaces tenant `id`'s manifest if it is still the one `basis` was
    /// read from (`None`: if there is none yet). Returns the new version's
    /// e-tag.
    pub async fn write_manifest(
        &self,
        id: &str,
        m: &Manifest,
        basis: Option<UpdateVersion>,
    ) -> Result<Option<String>> {
        let path = self.manifest_path(id);
        let body = PutPayload::from(serde_json::to_vec_pretty(m)?);
        let result = match &self.local_lock {
            Some(lock) => self.write_locked(lock, &path, body, basis, id).await?,
            None => {
                let mode = match basis {
                    Some(v) => PutMode::Update(v),
                    None => PutMode::Create,
                };
                self.store
                    .put_opts(&path, body, PutOptions::from(mode))
                    .await
            }
        };
        match result {
            Ok(r) => {
                self.reached();
                Ok(r.e_tag)
            }
            Err(
                object_store::Error::Precondition { .. }
                | object_store::Error::AlreadyExists { .. },
            ) => {
                self.reached();
                Err(StoreError::Conflict(id.to_string()).into())
            }
            Err(e) => Err(self.unavailable(&format!("writing {path}"), &e).into()),
        }
    }

    /// [`StateStore::write_manifest`] on a local file system: compare the
    /// e-tag and replace the file under an exclusive lock.
    async fn write_locked(
        &self,
        lock: &std::path::Path,
        path: &Path,
        body: PutPayload,
        basis: Option<UpdateVersion>,
        id: &str,
    ) -> Result<object_store::Result<object_store::PutResult>> {
        let lock = lock.to_path_buf();
        let file = tokio::task::spawn_blocking(move || -> Result<std::fs::File> {
            let f = std::fs::OpenOptions::new()
                .create(true)
                .truncate(false)
                .write(true)
                .open(&lock)
                .with_context(|| format!("cannot open {}", lock.display()))?;
            f.lock()
                .with_context(|| format!("cannot lock {}", lock.display()))?;
            Ok(f)
        })
        .await
        .map_err(|e| anyhow!("the lock task failed: {e}"))??;
        let current = match self.store.head(path).await {
            Ok(meta) => Some(meta.e_tag),
            Err(object_store::Error::NotFound { .. }) => None,
            Err(e) => return Ok(Err(e)),
        };
        let expected = basis.map(|b| b.e_tag);
        let r = if current != expected {
            Err(object_store::Error::Precondition {
                path: path.to_string(),
                source: format!("tenant {id} changed").into(),
            })
        } else {
            self.store
                .put_opts(path, body, PutOptions::from(PutMode::Overwrite))
                .await
        };
        drop(file);
        Ok(r)
    }

    /// Stores a plugin component (or an adapter file) under its sha256. One already there is
    /// kept if its content matches the name, and replaced if it does not
    /// (so uploading the plugin again repairs a corrupt blob).
    pub async fn put_blob(&self, sha256: &str, bytes: Bytes) -> Result<()> {
        let path = self.path(&format!("blobs/{sha256}"));
        let opts = PutOptions::from(PutMode::Create);
        match self
            .store
            .put_opts(&path, PutPayload::from(bytes.clone()), opts)
            .await
        {
            Ok(_) => {
                self.reached();
                Ok(())
            }
            Err(object_store::Error::AlreadyExists { .. }) => {
                self.reached();
                match self.get_blob(sha256).await {
                    Ok(_) => Ok(()),
                    Err(e) if matches!(e.downcast_ref(), Some(StoreError::Corrupt { .. })) => {
                        tracing::warn!("{e:#}: replacing it with the uploaded component");
                        self.overwrite(&path, bytes).await
                    }
                    Err(e) => Err(e),
                }
            }
            // A store without conditional creation: the name is the
            // content's hash, so overwriting it changes nothing.
            Err(object_store::Error::NotImplemented { .. }) => self.overwrite(&path, bytes).await,
            Err(e) => Err(self.unavailable(&format!("writing {path}"), &e).into()),
        }
    }

    async fn overwrite(&self, path: &Path, bytes: Bytes) -> Result<()> {
        match self.store.put(path, PutPayload::from(bytes)).await {
            Ok(_) => {
                self.reached();
                Ok(())
            }
            Err(e) => Err(self.unavailable(&format!("writing {path}"), &e).into()),
        }
    }

    /// Fetches the plugin component (or adapter file) with this sha256,
    /// checked.
    pub async fn get_blob(&self, sha256: &str) -> Result<Bytes> {
        let path = self.path(&format!("blobs/{sha256}"));
        let b = match self.store.get(&path).await {
            Ok(r) => r.bytes().await,
            Err(e) => Err(e),
        }
        .map_err(|e| self.unavailable(&format!("reading {path}"), &e))?;
        self.reached();
        let actual = crate::digest::sha256_hex(&b);
        if actual != sha256 {
            return Err(self
                .corrupt(
                    &path,
                    format!("its content has sha256 {actual}"),
                    "upload the plugin or adapter again (PUT /admin/v1/tenants/ID/plugins/NAME or .../adapters/NAME), roll back, or delete the tenant",
                )
                .into());
        }
        Ok(b)
    }

    /// Every tenant manifest in the store, by id, with its e-tag.
    pub async fn list_manifests(&self) -> Result<BTreeMap<String, Option<String>>> {
        use futures_util::TryStreamExt;
        let dir = self.path("tenants");
        let metas: Vec<object_store::ObjectMeta> = self
            .store
            .list(Some(&dir))
            .try_collect()
            .await
            .map_err(|e| self.unavailable(&format!("listing {dir}"), &e))?;
        self.reached();
        let mut out = BTreeMap::new();
        for m in metas {
            let mut parts = m.location.prefix_match(&dir).into_iter().flatten();
            let (Some(id), Some(file), None) = (parts.next(), parts.next(), parts.next()) else {
                continue;
            };
            if file.as_ref() == "manifest.json" && super::valid_name(id.as_ref()) {
                out.insert(id.as_ref().to_string(), m.e_tag);
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn manifest(revision: u64) -> Manifest {
        Manifest {
            revision,
            config: TenantConfig {
                id: "t".into(),
                ..TenantConfig::default()
            },
            ..Manifest::default()
        }
    }

    /// The conditional write, as the admin API relies on it: a write based
    /// on a stale read loses, on every kind of store we can run here.
    async fn stale_writes_conflict(s: &StateStore) {
        let r = s.read_manifest("t").await.unwrap();
        assert!(r.manifest.is_none());
        s.write_manifest("t", &manifest(1), None).await.unwrap();
        // A second creation conflicts.
        let e = s.write_manifest("t", &manifest(1), None).await.unwrap_err();
        assert!(
            matches!(e.downcast_ref(), Some(StoreError::Conflict(_))),
            "{e:#}"
        );
        let a = s.read_manifest("t").await.unwrap();
        let b = s.read_manifest("t").await.unwrap();
        assert_eq!(a.manifest.as_ref().unwrap().revision, 1);
        s.write_manifest("t", &manifest(2), a.basis).await.unwrap();
        let e = s
            .write_manifest("t", &manifest(2), b.basis)
            .await
            .unwrap_err();
        assert!(
            matches!(e.downcast_ref(), Some(StoreError::Conflict(_))),
            "{e:#}"
        );
        let now = s.read_manifest("t").await.unwrap();
        assert_eq!(now.manifest.unwrap().revision, 2);
        let listed = s.list_manifests().await.unwrap();
        assert_eq!(listed.keys().collect::<Vec<_>>(), ["t"]);
        // Blobs are content-addressed and checked on the way back.
        let wasm = Bytes::from_static(b"\0asm component");
        let sha = crate::digest::sha256_hex(&wasm);
        s.put_blob(&sha, wasm.clone()).await.unwrap();
        s.put_blob(&sha, wasm.clone()).await.unwrap();
        assert_eq!(s.get_blob(&sha).await.unwrap(), wasm);
        // The salt is the first proposal, whatever later replicas propose.
        let first = s.salt([7; 32]).await.unwrap();
        assert_eq!(first, [7; 32]);
        assert_eq!(s.salt([9; 32]).await.unwrap(), [7; 32]);
    }

    #[tokio::test]
    async fn a_stale_write_conflicts_on_a_file_store() {
        let dir = tempfile::tempdir().unwrap();
        let s = StateStore::open(&format!("file://{}", dir.path().display())).unwrap();
        stale_writes_conflict(&s).await;
    }

    #[tokio::test]
    async fn corrupt_objects_are_reported_as_such_and_repairable() {
        let dir = tempfile::tempdir().unwrap();
        let s = StateStore::open(&format!("file://{}", dir.path().display())).unwrap();
        // A manifest that does not parse is read as corrupt, with the
        // version a repairing write replaces.
        std::fs::create_dir_all(dir.path().join("tenants/t")).unwrap();
        std::fs::write(dir.path().join("tenants/t/manifest.json"), b"{oops").unwrap();
        let r = s.read_manifest("t").await.unwrap();
        assert!(r.manifest.is_none());
        let bad = r.corrupt.expect("corrupt");
        assert!(bad.to_string().contains("tenants/t/manifest.json"), "{bad}");
        s.write_manifest("t", &manifest(5), r.basis).await.unwrap();
        assert_eq!(
            s.read_manifest("t")
                .await
                .unwrap()
                .manifest
                .unwrap()
                .revision,
            5
        );
        // One that names another tenant is corrupt too.
        let mut other = manifest(1);
        other.config.id = "u".into();
        let r = s.read_manifest("t").await.unwrap();
        s.write_manifest("t", &other, r.basis).await.unwrap();
        assert!(s.read_manifest("t").await.unwrap().corrupt.is_some());
        // A blob whose content is not its name: an error naming it, and a
        // put of the right content replaces it.
        let wasm = Bytes::from_static(b"\0asm the real component");
        let sha = crate::digest::sha256_hex(&wasm);
        std::fs::create_dir_all(dir.path().join("blobs")).unwrap();
        std::fs::write(dir.path().join("blobs").join(&sha), b"garbage").unwrap();
        let e = s.get_blob(&sha).await.unwrap_err();
        assert!(
            matches!(e.downcast_ref(), Some(StoreError::Corrupt { .. })),
            "{e:#}"
        );
        assert!(format!("{e:#}").contains(&format!("blobs/{sha}")), "{e:#}");
        s.put_blob(&sha, wasm.clone()).await.unwrap();
        assert_eq!(s.get_blob(&sha).await.unwrap(), wasm);
    }

    #[tokio::test]
    async fn a_missing_salt_is_written_back_and_a_different_one_reported() {
        let dir = tempfile::tempdir().unwrap();
        let s = StateStore::open(&format!("file://{}", dir.path().display())).unwrap();
        assert_eq!(s.salt([3; 32]).await.unwrap(), [3; 32]);
        assert_eq!(s.check_salt([3; 32]).await.unwrap(), SaltCheck::Same);
        std::fs::remove_file(dir.path().join("key-salt")).unwrap();
        assert_eq!(s.check_salt([3; 32]).await.unwrap(), SaltCheck::Restored);
        assert_eq!(std::fs::read(dir.path().join("key-salt")).unwrap(), [3; 32]);
        std::fs::write(dir.path().join("key-salt"), [4; 32]).unwrap();
        assert_eq!(
            s.check_salt([3; 32]).await.unwrap(),
            SaltCheck::Differs(Some([4; 32]))
        );
        std::fs::write(dir.path().join("key-salt"), [4; 5]).unwrap();
        assert_eq!(
            s.check_salt([3; 32]).await.unwrap(),
            SaltCheck::Differs(None)
        );
    }

    #[tokio::test]
    async fn an_unreachable_store_is_reported_as_such() {
        // Nothing listens on port 9 of loopback.
        std::env::set_var("AWS_ENDPOINT", "http://127.0.0.1:9");
        std::env::set_var("AWS_ALLOW_HTTP", "true");
        std::env::set_var("AWS_ACCESS_KEY_ID", "x");
        std::env::set_var("AWS_SECRET_ACCESS_KEY", "x");
        std::env::set_var("AWS_REGION", "us-east-1");
        let s = StateStore::open("s3://bucket/prefix").unwrap();
        let e = s.read_manifest("t").await.err().unwrap();
        assert!(
            matches!(e.downcast_ref(), Some(StoreError::Unavailable { .. })),
            "{e:#}"
        );
        // Refused by the network, not by the client's own configuration.
        let text = format!("{e:#}");
        assert!(!text.contains("builder error"), "{text}");
        assert!(!s.is_up());
    }

    #[test]
    fn bad_urls_say_what_to_give() {
        for (url, says) in [
            ("bucket/prefix", "s3://bucket/prefix"),
            ("ftp://x/y", "not one of"),
            ("file://relative/path", "absolute path"),
        ] {
            let e = StateStore::open(url).err().unwrap();
            assert!(format!("{e:#}").contains(says), "{url}: {e:#}");
        }
    }
}
