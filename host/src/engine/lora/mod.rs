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
}

impl Default for LoraLimits {
    /// vLLM's defaults.
    fn default() -> Self {
        LoraLimits {
            max_loras: 1,
            max_rank: 16,
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

/// The adapters a server knows, by name.
#[derive(Debug)]
pub struct LoraRegistry {
    base: ModelConfig,
    limits: LoraLimits,
    by_name: BTreeMap<String, Arc<LoadedLora>>,
    next_id: u32,
}

impl LoraRegistry {
    /// An empty registry for adapters of a base model shaped by `base`.
    pub fn new(base: ModelConfig, limits: LoraLimits) -> LoraRegistry {
        LoraRegistry {
            base,
            limits,
            by_name: BTreeMap::new(),
            next_id: 1,
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
        self.by_name.insert(name.to_string(), Arc::clone(&lora));
        Ok(lora)
    }

    /// Forgets adapter `name`; requests already running with it finish.
    pub fn unload(&mut self, name: &str) -> Option<Arc<LoadedLora>> {
        self.by_name.remove(name)
    }

    /// The adapter named `name`.
    pub fn get(&self, name: &str) -> Option<&Arc<LoadedLora>> {
        self.by_name.get(name)
    }

    /// Every adapter, by name.
    pub fn iter(&self) -> impl Iterator<Item = &Arc<LoadedLora>> {
        self.by_name.values()
    }
}
