//! LoRA adapters on the served base model (vLLM's multi-LoRA): many
//! fine-tunes served from one set of base weights, mixed in one batch.
//!
//! - [`adapter`]: PEFT adapter folders, loaded and checked against the
//!   base, refusing by name what is not computed;
//! - [`LoraRegistry`]: the adapters a server knows by name (`--lora-modules`,
//!   `/v1/load_lora_adapter`), each with the id that keys its cache blocks;
//! - the runner's batch gives each running request's rows its adapter's
//!   device slot, and the model's layers add the deltas per slot
//!   ([`crate::engine::models::layers::lora`]).

pub mod adapter;
mod dtype;

pub use adapter::{LoraAdapter, LoraModule, LoraWeights};
pub use dtype::LoraDtype;

use crate::engine::config::ModelConfig;
use anyhow::{bail, Result};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// An adapter requests may name: its name, its id (never 0, which is the
/// base model; distinct for every adapter a server ever loads, so blocks
/// cached under an unloaded adapter never match a new one of the same
/// name) and its factors.
#[derive(Debug)]
pub struct LoadedLora {
    pub id: u32,
    pub name: String,
    pub path: PathBuf,
    pub adapter: LoraAdapter,
}

/// `--enable-lora` and its flags, as vLLM names them.
#[derive(Clone, Debug)]
pub struct LoraArgs {
    /// `--max-loras`: adapters resident on the device at once.
    pub max_loras: usize,
    /// `--max-lora-rank`: the largest rank accepted.
    pub max_lora_rank: usize,
    /// `--lora-dtype`: how the factors are stored on the device.
    pub dtype: LoraDtype,
    /// `--max-cpu-loras`: adapters whose factors stay in host memory
    /// (`None`: all).
    pub max_cpu_loras: Option<usize>,
    /// `--lora-modules name=path`: adapters loaded at start-up.
    pub modules: Vec<(String, PathBuf)>,
}

impl Default for LoraArgs {
    /// vLLM's defaults, no adapters.
    fn default() -> Self {
        LoraArgs {
            max_loras: 1,
            max_lora_rank: 16,
            dtype: LoraDtype::Auto,
            max_cpu_loras: None,
            modules: Vec::new(),
        }
    }
}

/// The limits of `--enable-lora`.
#[derive(Clone, Copy, Debug)]
pub struct LoraLimits {
    /// Adapters resident on the device at once (`--max-loras`): distinct
    /// adapters in one step.
    pub max_loras: usize,
    /// The largest rank accepted (`--max-lora-rank`).
    pub max_rank: usize,
    /// Adapters whose factors stay in host memory (`--max-cpu-loras`); the
    /// least recently used idle ones beyond are dropped and read again
    /// from their folder when named. `None`: every adapter stays.
    pub max_cpu_loras: Option<usize>,
}

impl Default for LoraLimits {
    /// vLLM's defaults.
    fn default() -> Self {
        LoraLimits {
            max_loras: 1,
            max_rank: 16,
            max_cpu_loras: None,
        }
    }
}

/// A registry the engine and its front end share.
pub type SharedLoras = Arc<std::sync::Mutex<LoraRegistry>>;

/// Locks `r`; a lock poisoned by a panic elsewhere still holds a
/// consistent registry (every change is one map operation).
pub fn lock(r: &SharedLoras) -> std::sync::MutexGuard<'_, LoraRegistry> {
    r.lock().unwrap_or_else(|e| e.into_inner())
}

/// What the registry knows of an adapter whether or not its factors are
/// in memory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LoraInfo {
    pub id: u32,
    pub name: String,
    pub path: PathBuf,
}

/// One named adapter: where it comes from, and its factors while they are
/// in host memory.
#[derive(Debug)]
struct Entry {
    id: u32,
    path: PathBuf,
    hot: Option<Arc<LoadedLora>>,
    /// When it was last named ([`LoraRegistry::get`]), for eviction.
    last_used: u64,
}

/// The adapters a server knows, by name.
#[derive(Debug)]
pub struct LoraRegistry {
    base: ModelConfig,
    limits: LoraLimits,
    by_name: BTreeMap<String, Entry>,
    next_id: u32,
    clock: u64,
}

impl LoraRegistry {
    /// An empty registry for adapters of a base model shaped by `base`.
    pub fn new(base: ModelConfig, limits: LoraLimits) -> LoraRegistry {
        LoraRegistry {
            base,
            limits,
            by_name: BTreeMap::new(),
            next_id: 1,
            clock: 0,
        }
    }

    /// The limits it loads under.
    pub fn limits(&self) -> LoraLimits {
        self.limits
    }

    /// The shape of the base model adapters must fit.
    pub fn base(&self) -> &ModelConfig {
        &self.base
    }

    /// Gives `adapter` (parsed against [`LoraRegistry::base`] outside the
    /// registry's lock) an id of its own without making it nameable here:
    /// a tenant's adapter, which only its tenant resolves
    /// ([`crate::tenants::adapters`]). Its id is never reused, so its
    /// cached blocks never match another adapter's.
    pub fn adopt(&mut self, name: &str, path: PathBuf, adapter: LoraAdapter) -> Arc<LoadedLora> {
        let lora = Arc::new(LoadedLora {
            id: self.next_id,
            name: name.to_string(),
            path,
            adapter,
        });
        self.next_id += 1;
        lora
    }

    /// Loads the adapter in `path` under `name`. An adapter that does not
    /// fit the base, or a name already taken, is refused and changes
    /// nothing.
    pub fn load(&mut self, name: &str, path: &Path) -> Result<Arc<LoadedLora>> {
        if name.is_empty() {
            bail!("an adapter needs a name");
        }
        if self.by_name.contains_key(name) {
            bail!("an adapter named {name:?} is already loaded");
        }
        let adapter = LoraAdapter::load(path, &self.base, self.limits.max_rank)?;
        let lora = Arc::new(LoadedLora {
            id: self.next_id,
            name: name.to_string(),
            path: path.to_path_buf(),
            adapter,
        });
        self.next_id += 1;
        self.clock += 1;
        self.by_name.insert(
            name.to_string(),
            Entry {
                id: lora.id,
                path: path.to_path_buf(),
                hot: Some(Arc::clone(&lora)),
                last_used: self.clock,
            },
        );
        self.evict_idle(name);
        Ok(lora)
    }

    /// Forgets adapter `name`; requests already running with it finish.
    /// Returns whether it was known.
    pub fn unload(&mut self, name: &str) -> bool {
        self.by_name.remove(name).is_some()
    }

    /// The adapter named `name`, if known, without reading its factors.
    pub fn info(&self, name: &str) -> Option<LoraInfo> {
        self.by_name.get(name).map(|e| LoraInfo {
            id: e.id,
            name: name.to_string(),
            path: e.path.clone(),
        })
    }

    /// The adapter named `name`, its factors read again from its folder if
    /// `--max-cpu-loras` had dropped them (under the same id: the same
    /// folder gives the same factors, so its cached blocks stay valid).
    /// `Err` when that read fails (the folder changed or went away).
    pub fn get(&mut self, name: &str) -> Result<Option<Arc<LoadedLora>>> {
        self.clock += 1;
        let clock = self.clock;
        let Some(e) = self.by_name.get_mut(name) else {
            return Ok(None);
        };
        e.last_used = clock;
        if let Some(hot) = &e.hot {
            return Ok(Some(Arc::clone(hot)));
        }
        let adapter = LoraAdapter::load(&e.path, &self.base, self.limits.max_rank)
            .map_err(|err| {
                anyhow::anyhow!(
                    "adapter {name:?} was dropped from host memory (--max-cpu-loras) and no longer loads from {}: {err:#}",
                    e.path.display()
                )
            })?;
        let lora = Arc::new(LoadedLora {
            id: e.id,
            name: name.to_string(),
            path: e.path.clone(),
            adapter,
        });
        e.hot = Some(Arc::clone(&lora));
        tracing::info!("LoRA adapter {name:?} read again from {}", e.path.display());
        self.evict_idle(name);
        Ok(Some(lora))
    }

    /// Drops the factors of the least recently used adapters beyond
    /// `--max-cpu-loras` that nothing else holds (no request, no device
    /// slot), never `keep`'s.
    fn evict_idle(&mut self, keep: &str) {
        let Some(max) = self.limits.max_cpu_loras else {
            return;
        };
        loop {
            let hot = self.by_name.values().filter(|e| e.hot.is_some()).count();
            if hot <= max {
                return;
            }
            let victim = self
                .by_name
                .iter()
                .filter(|(n, e)| {
                    n.as_str() != keep && e.hot.as_ref().is_some_and(|h| Arc::strong_count(h) == 1)
                })
                .min_by_key(|(_, e)| e.last_used)
                .map(|(n, _)| n.clone());
            match victim.and_then(|v| self.by_name.get_mut(&v)) {
                Some(e) => e.hot = None,
                // Every other adapter in memory is in use: over the limit
                // until they finish.
                None => return,
            }
        }
    }

    /// Every adapter, by name.
    pub fn list(&self) -> Vec<LoraInfo> {
        self.by_name.keys().filter_map(|n| self.info(n)).collect()
    }

    /// Adapters whose factors are in host memory now.
    pub fn num_in_memory(&self) -> usize {
        self.by_name.values().filter(|e| e.hot.is_some()).count()
    }
}
