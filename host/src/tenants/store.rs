//! Tenants, plugin versions and adapter versions under `--state-dir`.
//! Every file is written atomically: a temp file in the same directory,
//! fsync, rename, fsync of the directory. A version's record (`<v>.json`)
//! is written after its content (a plugin's component and artifact, an
//! adapter's blobs), and the active pointer after the record, so a crash at
//! any point leaves the previous active version intact.

use super::{valid_name, PluginSlot, TenantConfig, VersionRecord, VersionSlot};
use crate::plugins::{validate_config, Limits, LoadedPlugin, PluginRuntime};
use anyhow::{anyhow, Context, Result};
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

pub(super) fn tenant_dir(root: &Path, id: &str) -> PathBuf {
    root.join("tenants").join(id)
}

/// What a tenant stores in versions: each has a folder of its own under
/// the tenant's, one subfolder per name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Plugins,
    Adapters,
}

impl Kind {
    fn dir(self) -> &'static str {
        match self {
            Kind::Plugins => "plugins",
            Kind::Adapters => "adapters",
        }
    }
}

pub(super) fn slot_dir(root: &Path, id: &str, kind: Kind, name: &str) -> PathBuf {
    tenant_dir(root, id).join(kind.dir()).join(name)
}

fn plugin_dir(root: &Path, id: &str, name: &str) -> PathBuf {
    slot_dir(root, id, Kind::Plugins, name)
}

pub(super) fn fsync_dir(dir: &Path) -> Result<()> {
    std::fs::File::open(dir)
        .and_then(|f| f.sync_all())
        .with_context(|| format!("cannot fsync {}", dir.display()))
}

/// Creates `dir` and its missing parents, readable by the owner only.
pub fn create_private_dir(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
}

/// The salt of the API-key hashes: `key-salt` under `root`, created with
/// 32 random bytes on first start.
pub fn load_or_create_salt(root: &Path) -> Result<[u8; 32]> {
    let path = root.join("key-salt");
    match std::fs::read(&path) {
        Ok(b) => <[u8; 32]>::try_from(b.as_slice()).map_err(|_| {
            anyhow!(
                "{} holds {} bytes, not 32; restore it from a backup (without it, no stored API key matches)",
                path.display(),
                b.len()
            )
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let salt: [u8; 32] = rand::random();
            write_atomic(&path, &salt)?;
            Ok(salt)
        }
        Err(e) => Err(e).with_context(|| format!("cannot read {}", path.display())),
    }
}

/// Writes `bytes` to `path` atomically, as a file only its owner can read
/// (directories created on the way are the owner's alone too).
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let dir = path
        .parent()
        .ok_or_else(|| anyhow!("{} has no parent", path.display()))?;
    create_private_dir(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let tmp = dir.join(format!(
        ".tmp-{}-{:x}",
        path.file_name().and_then(|n| n.to_str()).unwrap_or("f"),
        rand::random::<u64>()
    ));
    let r = (|| -> Result<()> {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)
            .with_context(|| format!("cannot create {}", tmp.display()))?;
        f.write_all(bytes)?;
        f.sync_all()?;
        drop(f);
        std::fs::rename(&tmp, path)
            .with_context(|| format!("cannot rename into {}", path.display()))?;
        fsync_dir(dir)
    })();
    if r.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    r
}

pub fn save_tenant(root: &Path, c: &TenantConfig) -> Result<()> {
    write_atomic(
        &tenant_dir(root, &c.id).join("tenant.json"),
        &serde_json::to_vec_pretty(c)?,
    )
}

pub fn delete_tenant(root: &Path, id: &str) -> Result<()> {
    let dir = tenant_dir(root, id);
    if !dir.exists() {
        return Ok(());
    }
    // Rename first so a crash never leaves a half-deleted tenant that loads.
    let gone = root
        .join("tenants")
        .join(format!(".deleted-{id}-{:x}", rand::random::<u64>()));
    std::fs::rename(&dir, &gone)?;
    fsync_dir(&root.join("tenants"))?;
    let _ = std::fs::remove_dir_all(&gone);
    Ok(())
}

#[derive(serde::Serialize, serde::Deserialize)]
struct Active {
    active: u64,
    history: Vec<u64>,
}

pub fn save_active(root: &Path, id: &str, name: &str, active: u64, history: &[u64]) -> Result<()> {
    save_active_of(root, id, Kind::Plugins, name, active, history)
}

/// Points `kind` `name` of tenant `id` at version `active`.
pub fn save_active_of(
    root: &Path,
    id: &str,
    kind: Kind,
    name: &str,
    active: u64,
    history: &[u64],
) -> Result<()> {
    let a = Active {
        active,
        history: history.to_vec(),
    };
    write_atomic(
        &slot_dir(root, id, kind, name).join("active.json"),
        &serde_json::to_vec(&a)?,
    )
}

/// A stored version's record: it knows its own number.
pub trait Versioned: serde::de::DeserializeOwned {
    fn version(&self) -> u64;
}

impl Versioned for VersionRecord {
    fn version(&self) -> u64 {
        self.version
    }
}

/// The records and the active pointer in one slot's folder (nothing
/// loaded). Leftover temp files of an interrupted write are removed; a
/// record that does not parse is skipped with a warning, and an active
/// pointer naming a version without a record is dropped.
pub(super) fn read_slot<R: Versioned + Clone, L>(dir: &Path) -> VersionSlot<R, L> {
    let mut slot = VersionSlot::default();
    for f in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let fname = f.file_name().to_string_lossy().to_string();
        if let Some(v) = fname
            .strip_suffix(".json")
            .and_then(|v| v.parse::<u64>().ok())
        {
            match std::fs::read(f.path())
                .map_err(anyhow::Error::from)
                .and_then(|b| Ok(serde_json::from_slice::<R>(&b)?))
            {
                Ok(r) if r.version() == v => {
                    slot.versions.insert(v, r);
                }
                _ => tracing::warn!("ignoring unreadable version record {}", f.path().display()),
            }
        } else if fname.starts_with(".tmp-") {
            let _ = std::fs::remove_file(f.path());
        }
    }
    if let Ok(b) = std::fs::read(dir.join("active.json")) {
        if let Ok(a) = serde_json::from_slice::<Active>(&b) {
            slot.active = Some(a.active);
            slot.history = a
                .history
                .into_iter()
                .filter(|v| slot.versions.contains_key(v))
                .collect();
        }
    }
    if let Some(v) = slot.active {
        if !slot.versions.contains_key(&v) {
            tracing::error!("{}: the active version {v} has no record", dir.display());
            slot.active = None;
        }
    }
    slot
}

#[allow(clippy::too_many_arguments)]
pub fn save_version(
    root: &Path,
    id: &str,
    name: &str,
    r: &VersionRecord,
    wasm: &[u8],
    cwasm: &[u8],
    active: u64,
    history: &[u64],
) -> Result<()> {
    let dir = plugin_dir(root, id, name);
    write_atomic(&dir.join(format!("{}.wasm", r.version)), wasm)?;
    write_atomic(&dir.join(format!("{}.cwasm", r.version)), cwasm)?;
    write_atomic(
        &dir.join(format!("{}.json", r.version)),
        &serde_json::to_vec_pretty(r)?,
    )?;
    save_active(root, id, name, active, history)
}

/// Loads one version: the cached artifact if it is the one recorded and
/// this engine accepts it, else the component (if it is the one uploaded),
/// recompiled, with the artifact and its recorded hash rewritten.
pub fn load_version(
    rt: &Arc<PluginRuntime>,
    root: &Path,
    id: &str,
    name: &str,
    r: &VersionRecord,
    limits: &Limits,
) -> Result<Arc<LoadedPlugin>> {
    let dir = plugin_dir(root, id, name);
    let cpath = dir.join(format!("{}.cwasm", r.version));
    let cached = match &r.cwasm_sha256 {
        Some(sha) => rt.load_precompiled(&cpath, sha),
        None => Err(anyhow!("no artifact hash is recorded")),
    };
    let component = match cached {
        Ok(c) => c,
        Err(e) => {
            tracing::warn!(
                "recompiling {id}/{name} v{}: cached artifact unusable ({e:#})",
                r.version
            );
            let wpath = dir.join(format!("{}.wasm", r.version));
            let wasm = std::fs::read(&wpath)
                .with_context(|| format!("cannot read {id}/{name} v{}", r.version))?;
            let actual = crate::digest::sha256_hex(&wasm);
            if actual != r.sha256 {
                anyhow::bail!(
                    "{} has sha256 {actual}, not the uploaded {}; upload the plugin again",
                    wpath.display(),
                    r.sha256
                );
            }
            let c = rt.compile(&wasm)?;
            if let Ok(bytes) = rt.serialize(&c) {
                let record = VersionRecord {
                    cwasm_sha256: Some(crate::digest::sha256_hex(&bytes)),
                    ..r.clone()
                };
                // The artifact first, then the record that vouches for it.
                let saved = write_atomic(&cpath, &bytes).and_then(|()| {
                    write_atomic(
                        &dir.join(format!("{}.json", r.version)),
                        &serde_json::to_vec_pretty(&record)?,
                    )
                });
                if let Err(e) = saved {
                    tracing::warn!(
                        "cannot rewrite the artifact of {id}/{name} v{}: {e:#}",
                        r.version
                    );
                }
            }
            c
        }
    };
    let (pre, meta) = rt.prepare(component, limits)?;
    let config = validate_config(&meta, Some(&r.config))?;
    Ok(Arc::new(LoadedPlugin::new(
        name.to_string(),
        r.version,
        r.sha256.clone(),
        meta,
        config,
        pre,
    )))
}

/// A tenant as the state dir holds it.
pub struct Loaded {
    pub config: TenantConfig,
    /// Its plugins, active versions compiled.
    pub plugins: BTreeMap<String, PluginSlot>,
}

/// Every tenant with its plugin slots (active versions loaded).
pub fn load_all(rt: &Arc<PluginRuntime>, root: &Path) -> Result<Vec<Loaded>> {
    let tdir = root.join("tenants");
    let mut out = Vec::new();
    let Ok(entries) = std::fs::read_dir(&tdir) else {
        return Ok(out);
    };
    for e in entries.flatten() {
        let id = e.file_name().to_string_lossy().to_string();
        if !valid_name(&id) {
            continue;
        }
        let path = e.path().join("tenant.json");
        let config: TenantConfig = match std::fs::read(&path)
            .map_err(anyhow::Error::from)
            .and_then(|b| Ok(serde_json::from_slice(&b)?))
        {
            Ok(c) => c,
            Err(err) => {
                tracing::warn!(
                    "skipping tenant {id}: cannot read {}: {err:#}",
                    path.display()
                );
                continue;
            }
        };
        let mut slots = BTreeMap::new();
        if let Ok(plugins) = std::fs::read_dir(e.path().join("plugins")) {
            for p in plugins.flatten() {
                let name = p.file_name().to_string_lossy().to_string();
                if !valid_name(&name) {
                    continue;
                }
                let mut slot: PluginSlot = read_slot(&p.path());
                if let Some(r) = slot.active.and_then(|v| slot.versions.get(&v)) {
                    match load_version(rt, root, &id, &name, r, &config.plugin_limits) {
                        Ok(l) => {
                            slot.loaded.insert(r.version, l);
                        }
                        Err(err) => tracing::error!(
                            "tenant {id}: plugin {name} v{} failed to load: {err:#}",
                            r.version
                        ),
                    }
                }
                slots.insert(name, slot);
            }
        }
        out.push(Loaded {
            config,
            plugins: slots,
        });
    }
    Ok(out)
}

/// The version record `<v>.json` the cache holds, if readable.
pub fn cached_record(root: &Path, id: &str, name: &str, version: u64) -> Option<VersionRecord> {
    let b = std::fs::read(plugin_dir(root, id, name).join(format!("{version}.json"))).ok()?;
    serde_json::from_slice(&b).ok()
}

/// Writes record `r` into the cache unless one for its version (and
/// component) is there: the cached one may carry its artifact's hash.
pub fn save_record_if_absent(root: &Path, id: &str, name: &str, r: &VersionRecord) -> Result<()> {
    if cached_record(root, id, name, r.version).is_some_and(|c| c.sha256 == r.sha256) {
        return Ok(());
    }
    write_atomic(
        &plugin_dir(root, id, name).join(format!("{}.json", r.version)),
        &serde_json::to_vec_pretty(r)?,
    )
}

/// Whether the cache holds version `r`'s component, byte for byte.
pub fn cached_component(root: &Path, id: &str, name: &str, r: &VersionRecord) -> bool {
    std::fs::read(plugin_dir(root, id, name).join(format!("{}.wasm", r.version)))
        .is_ok_and(|b| crate::digest::sha256_hex(&b) == r.sha256)
}

/// Puts version `r`'s component into the cache, then its record.
pub fn save_component(
    root: &Path,
    id: &str,
    name: &str,
    r: &VersionRecord,
    wasm: &[u8],
) -> Result<()> {
    write_atomic(
        &plugin_dir(root, id, name).join(format!("{}.wasm", r.version)),
        wasm,
    )?;
    save_record_if_absent(root, id, name, r)
}
