//! The WebAssembly plugin runtime: tenants' request logic compiled to WASI
//! components (`sdk/wit`, world `plugin`) and run under wasmtime.
//!
//! - One [`PluginRuntime`] per server: one wasmtime `Engine` (component
//!   model, pooling allocator, epoch interruption driven by a 1 ms ticker
//!   thread, optional fuel) and one `Linker` with the host imports and an
//!   empty WASI p2 context.
//! - A [`LoadedPlugin`] is one uploaded version: its compiled `Component`,
//!   its cached `InstancePre`, its metadata and its validated config.
//! - A [`Session`] serves one request: one `Store` and one instance per
//!   plugin of the chain, created on first use and reused by every hook of
//!   that request (never per chunk). A hook call that traps, times out,
//!   runs out of memory or returns too much poisons its instance; it is
//!   never called again. Plugins never share a `Store`: wasmtime refuses
//!   every later call into a `Store` in which a call trapped, so a shared
//!   one would let a failing fail-open plugin disable the rest of the chain.

pub mod metrics;

use anyhow::{anyhow, bail, Context, Result};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use wasmtime::component::{Component, HasSelf, Linker, ResourceTable};
use wasmtime::{
    Config, Engine, InstanceAllocationStrategy, PoolingAllocationConfig, Store, Trap,
    UpdateDeadline,
};
use wasmtime_wasi::{WasiCtx, WasiCtxView, WasiView};

pub mod bindings {
    wasmtime::component::bindgen!({
        world: "plugin",
        path: "../sdk/wit",
    });
}

pub use bindings::pagoda::plugin::host::{LogLevel, RequestFacts as Facts};
pub use bindings::pagoda::plugin::types::{Hook, Metadata, Rejection, RouteDecision};
use bindings::{Plugin, PluginPre};

/// The ABI this host speaks (`abi-version` of pagoda:plugin@0.1.0).
pub const ABI_VERSION: u32 = 1;

/// The hooks, as the host names them (config keys, metrics labels).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum HookKind {
    Route,
    RenderPrompt,
    OnChunk,
    PostProcess,
}

impl HookKind {
    pub fn as_str(self) -> &'static str {
        match self {
            HookKind::Route => "route",
            HookKind::RenderPrompt => "render-prompt",
            HookKind::OnChunk => "on-chunk",
            HookKind::PostProcess => "post-process",
        }
    }
    fn of(h: Hook) -> HookKind {
        match h {
            Hook::Route => HookKind::Route,
            Hook::RenderPrompt => HookKind::RenderPrompt,
            Hook::OnChunk => HookKind::OnChunk,
            Hook::PostProcess => HookKind::PostProcess,
        }
    }
    pub fn parse(s: &str) -> Option<HookKind> {
        Some(match s {
            "route" => HookKind::Route,
            "render-prompt" | "render_prompt" => HookKind::RenderPrompt,
            "on-chunk" | "on_chunk" => HookKind::OnChunk,
            "post-process" | "post_process" => HookKind::PostProcess,
            _ => return None,
        })
    }
}

/// Limits of every hook call.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct Limits {
    /// Wall-clock deadline of `route` and `render-prompt`, ms.
    pub timeout_ms: u64,
    /// Wall-clock deadline of one `on-chunk` or `post-process` call, ms.
    pub chunk_timeout_ms: u64,
    /// Linear memory cap per instance, bytes.
    pub memory_bytes: usize,
    /// Fuel per call (only when the server runs with `--plugin-fuel`).
    pub fuel: Option<u64>,
    /// Largest string a hook may return, bytes.
    pub max_output_bytes: usize,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            timeout_ms: 100,
            chunk_timeout_ms: 100,
            memory_bytes: 64 << 20,
            fuel: None,
            max_output_bytes: 1 << 20,
        }
    }
}

/// Why a hook call failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorKind {
    Timeout,
    Oom,
    Trap,
    OutOfFuel,
    OutputTooLarge,
    /// The instance could not be created (pool exhausted, link error).
    Instantiate,
    /// A previous call of this request poisoned the instance.
    Poisoned,
    /// The plugin returned something the host cannot use (e.g. bad JSON).
    BadOutput,
}

impl ErrorKind {
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorKind::Timeout => "timeout",
            ErrorKind::Oom => "oom",
            ErrorKind::Trap => "trap",
            ErrorKind::OutOfFuel => "out_of_fuel",
            ErrorKind::OutputTooLarge => "output_too_large",
            ErrorKind::Instantiate => "instantiate",
            ErrorKind::Poisoned => "poisoned",
            ErrorKind::BadOutput => "bad_output",
        }
    }
}

/// A failed hook call.
#[derive(Clone, Debug)]
pub struct HookError {
    pub plugin: String,
    pub hook: HookKind,
    pub kind: ErrorKind,
    pub detail: String,
}

impl std::fmt::Display for HookError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "plugin '{}' failed in {} ({}): {}",
            self.plugin,
            self.hook.as_str(),
            self.kind.as_str(),
            self.detail
        )
    }
}

/// The error a `ResourceLimiter` raises when an instance asks for more
/// memory than its cap; it traps the call and is recognized as `oom`.
#[derive(Debug)]
struct MemoryCapExceeded {
    desired: usize,
    cap: usize,
}

impl std::fmt::Display for MemoryCapExceeded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "memory growth to {} bytes exceeds the cap of {} bytes",
            self.desired, self.cap
        )
    }
}
impl std::error::Error for MemoryCapExceeded {}

struct MemLimiter {
    cap: usize,
}

impl wasmtime::ResourceLimiter for MemLimiter {
    fn memory_growing(
        &mut self,
        _current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        if desired > self.cap {
            return Err(wasmtime::Error::new(MemoryCapExceeded {
                desired,
                cap: self.cap,
            }));
        }
        Ok(true)
    }
    fn table_growing(
        &mut self,
        _current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        Ok(desired <= 100_000)
    }
}

/// Per-plugin data the host imports read.
struct PluginCtx {
    name: String,
    config: String,
}

/// The data of the `Store` of one plugin of a request.
pub struct HostState {
    wasi: WasiCtx,
    table: ResourceTable,
    limiter: MemLimiter,
    tenant: String,
    plugin: PluginCtx,
    facts: Facts,
}

impl WasiView for HostState {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView {
            ctx: &mut self.wasi,
            table: &mut self.table,
        }
    }
}

impl bindings::pagoda::plugin::types::Host for HostState {}

impl bindings::pagoda::plugin::host::Host for HostState {
    fn log(&mut self, level: LogLevel, message: String) {
        let mut message = message;
        if message.len() > 4096 {
            let mut cut = 4096;
            while !message.is_char_boundary(cut) {
                cut -= 1;
            }
            message.truncate(cut);
        }
        let plugin = self.plugin.name.as_str();
        let tenant = self.tenant.as_str();
        match level {
            LogLevel::Trace => {
                tracing::trace!(target: "pagoda::plugin", tenant, plugin, "{message}")
            }
            LogLevel::Debug => {
                tracing::debug!(target: "pagoda::plugin", tenant, plugin, "{message}")
            }
            LogLevel::Info => tracing::info!(target: "pagoda::plugin", tenant, plugin, "{message}"),
            LogLevel::Warn => tracing::warn!(target: "pagoda::plugin", tenant, plugin, "{message}"),
            LogLevel::Error => {
                tracing::error!(target: "pagoda::plugin", tenant, plugin, "{message}")
            }
        }
    }

    fn config(&mut self) -> String {
        self.plugin.config.clone()
    }

    fn facts(&mut self) -> Facts {
        self.facts.clone()
    }
}

/// Server-wide runtime settings.
#[derive(Clone, Debug)]
pub struct RuntimeConfig {
    /// Turn on fuel metering (each call then gets `Limits::fuel`).
    pub fuel: bool,
    /// Instances the pool holds at once (all tenants, all requests).
    pub max_instances: u32,
    /// The largest memory cap any tenant may set, bytes.
    pub max_memory_bytes: usize,
}

impl Default for RuntimeConfig {
    fn default() -> Self {
        RuntimeConfig {
            fuel: false,
            max_instances: 256,
            max_memory_bytes: 256 << 20,
        }
    }
}

/// The wasmtime engine, the linker, and the epoch ticker.
pub struct PluginRuntime {
    engine: Engine,
    linker: Linker<HostState>,
    config: RuntimeConfig,
    stop: Arc<AtomicBool>,
}

/// Ticks per millisecond of deadline.
const EPOCH_TICK: Duration = Duration::from_millis(1);

impl PluginRuntime {
    pub fn new(config: RuntimeConfig) -> Result<Arc<PluginRuntime>> {
        let mut pool = PoolingAllocationConfig::default();
        // As `instance_pool_size` reports it.
        let n = config.max_instances.max(8);
        pool.total_component_instances(n)
            .total_core_instances(n * 8)
            .total_memories(n * 2)
            .total_tables(n * 4)
            .total_stacks(n)
            .max_memory_size(config.max_memory_bytes)
            .max_core_instances_per_component(32)
            .max_memories_per_component(8)
            .max_tables_per_component(16);
        let mut c = Config::new();
        c.wasm_component_model(true)
            .epoch_interruption(true)
            .consume_fuel(config.fuel)
            .parallel_compilation(true)
            .allocation_strategy(InstanceAllocationStrategy::Pooling(pool));
        let engine = Engine::new(&c).map_err(|e| anyhow!("cannot start the wasm engine: {e:#}"))?;
        let mut linker: Linker<HostState> = Linker::new(&engine);
        wasmtime_wasi::p2::add_to_linker_sync(&mut linker).map_err(|e| anyhow!("{e:#}"))?;
        Plugin::add_to_linker::<HostState, HasSelf<HostState>>(&mut linker, |s| s)
            .map_err(|e| anyhow!("{e:#}"))?;
        let stop = Arc::new(AtomicBool::new(false));
        {
            let engine = engine.clone();
            let stop = Arc::clone(&stop);
            std::thread::Builder::new()
                .name("pagoda-epoch".into())
                .spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        std::thread::sleep(EPOCH_TICK);
                        engine.increment_epoch();
                    }
                })
                .context("cannot start the epoch ticker")?;
        }
        Ok(Arc::new(PluginRuntime {
            engine,
            linker,
            config,
            stop,
        }))
    }

    /// The fuel of one call, when metering is on.
    fn fuel(&self, limits: &Limits) -> Option<u64> {
        self.config
            .fuel
            .then(|| limits.fuel.unwrap_or(u64::MAX / 2))
    }

    pub fn config(&self) -> &RuntimeConfig {
        &self.config
    }

    /// How many plugin instances can be alive at once (the pooling
    /// allocator's component instances).
    pub fn instance_pool_size(&self) -> usize {
        self.config.max_instances.max(8) as usize
    }

    /// Compiles component bytes (seconds for a large plugin: call it off
    /// the request path).
    pub fn compile(&self, wasm: &[u8]) -> Result<Component> {
        if wasmtime::Engine::detect_precompiled(wasm).is_some() {
            bail!("precompiled artifacts are not accepted; upload the component (.wasm)");
        }
        Component::new(&self.engine, wasm)
            .map_err(|e| anyhow!("not a valid WebAssembly component: {e:#}"))
    }

    /// The precompiled form of a component, to cache on disk.
    pub fn serialize(&self, c: &Component) -> Result<Vec<u8>> {
        c.serialize().map_err(|e| anyhow!("{e:#}"))
    }

    /// Loads a cached precompiled artifact whose bytes hash to `sha256`;
    /// errors when they do not (the file was changed since this server
    /// wrote it) or when an incompatible engine made it (another wasmtime
    /// version or settings).
    pub fn load_precompiled(&self, path: &Path, sha256: &str) -> Result<Component> {
        let bytes =
            std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
        let actual = crate::digest::sha256_hex(&bytes);
        if actual != sha256 {
            bail!("its sha256 is {actual}, not the recorded {sha256}");
        }
        // SAFETY: the bytes are the artifact this server serialized (their
        // hash is the one recorded when it wrote them, never uploaded);
        // wasmtime checks the engine's version and settings and fails on a
        // mismatch.
        unsafe { Component::deserialize(&self.engine, &bytes) }.map_err(|e| anyhow!("{e:#}"))
    }

    /// Type-checks a compiled component against the world, instantiates
    /// it once within `limits`, checks its ABI and reads its metadata.
    pub fn prepare(
        self: &Arc<Self>,
        component: Component,
        limits: &Limits,
    ) -> Result<(PluginPre<HostState>, PluginMeta)> {
        let pre = self
            .linker
            .instantiate_pre(&component)
            .map_err(|e| anyhow!("the component does not fit the pagoda:plugin world: {e:#}"))?;
        let pre = PluginPre::new(pre)
            .map_err(|e| anyhow!("the component does not export the pagoda:plugin world: {e:#}"))?;
        let mut store = self.store(
            "admin",
            PluginCtx {
                name: "upload".into(),
                config: "{}".into(),
            },
            limits,
        );
        arm(&mut store, limits.timeout_ms, self.fuel(limits));
        let inst = pre
            .instantiate(&mut store)
            .map_err(|e| anyhow!("instantiating the component failed: {}", describe(&e)))?;
        arm(&mut store, limits.timeout_ms, self.fuel(limits));
        let abi = inst
            .call_abi_version(&mut store)
            .map_err(|e| anyhow!("abi-version failed: {}", describe(&e)))?;
        if abi != ABI_VERSION {
            bail!("the component speaks plugin ABI {abi}; this server speaks ABI {ABI_VERSION} (pagoda:plugin@0.1.0)");
        }
        arm(&mut store, limits.timeout_ms, self.fuel(limits));
        let m = inst
            .call_metadata(&mut store)
            .map_err(|e| anyhow!("metadata failed: {}", describe(&e)))?;
        let meta = PluginMeta {
            name: m.name,
            version: m.version,
            hooks: m.hooks.into_iter().map(HookKind::of).collect(),
            config_schema: m.config_schema,
        };
        Ok((pre, meta))
    }

    fn store(&self, tenant: &str, plugin: PluginCtx, limits: &Limits) -> Store<HostState> {
        let state = HostState {
            wasi: WasiCtx::builder().build(),
            table: ResourceTable::new(),
            limiter: MemLimiter {
                cap: limits.memory_bytes.min(self.config.max_memory_bytes),
            },
            tenant: tenant.to_string(),
            plugin,
            facts: Facts {
                tenant_id: tenant.to_string(),
                request_id: String::new(),
                models: Vec::new(),
                prompt_tokens: 0,
                completion_tokens: 0,
            },
        };
        let mut store = Store::new(&self.engine, state);
        store.limiter(|s| &mut s.limiter);
        // Time is up: trap. Never yield or extend, or a loop runs forever.
        store.epoch_deadline_callback(|_| Ok(UpdateDeadline::Interrupt));
        store
    }
}

impl Drop for PluginRuntime {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// Sets the deadline (and, when metering is on, the fuel) of the next call.
fn arm(store: &mut Store<HostState>, timeout_ms: u64, fuel: Option<u64>) {
    store.set_epoch_deadline(timeout_ms.max(1));
    if let Some(f) = fuel {
        let _ = store.set_fuel(f);
    }
}

/// What a plugin says about itself.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct PluginMeta {
    pub name: String,
    pub version: String,
    pub hooks: Vec<HookKind>,
    pub config_schema: String,
}

/// Classifies a wasmtime error.
fn classify(e: &wasmtime::Error) -> ErrorKind {
    if e.chain()
        .any(|c| c.downcast_ref::<MemoryCapExceeded>().is_some())
    {
        return ErrorKind::Oom;
    }
    match e
        .downcast_ref::<Trap>()
        .or_else(|| e.chain().find_map(|c| c.downcast_ref::<Trap>()))
    {
        Some(Trap::Interrupt) => ErrorKind::Timeout,
        Some(Trap::OutOfFuel) => ErrorKind::OutOfFuel,
        _ => ErrorKind::Trap,
    }
}

fn describe(e: &wasmtime::Error) -> String {
    match classify(e) {
        ErrorKind::Timeout => "the deadline passed".into(),
        ErrorKind::Oom => e
            .chain()
            .find_map(|c| c.downcast_ref::<MemoryCapExceeded>())
            .map_or_else(|| "out of memory".to_string(), |m| m.to_string()),
        ErrorKind::OutOfFuel => "all fuel consumed".into(),
        _ => {
            let s = format!("{e:#}");
            s.lines()
                .next()
                .unwrap_or("trap")
                .chars()
                .take(300)
                .collect()
        }
    }
}

/// One uploaded, compiled and checked plugin version.
pub struct LoadedPlugin {
    pub name: String,
    pub version: u64,
    pub sha256: String,
    pub meta: PluginMeta,
    /// The validated config JSON ("{}" when none).
    pub config: String,
    pre: PluginPre<HostState>,
}

impl LoadedPlugin {
    pub fn new(
        name: String,
        version: u64,
        sha256: String,
        meta: PluginMeta,
        config: String,
        pre: PluginPre<HostState>,
    ) -> LoadedPlugin {
        LoadedPlugin {
            name,
            version,
            sha256,
            meta,
            config,
            pre,
        }
    }
    pub fn has(&self, h: HookKind) -> bool {
        self.meta.hooks.contains(&h)
    }
}

/// Validates `config` against the plugin's schema ("" = no config, only
/// "{}" accepted). Returns the normalized JSON.
pub fn validate_config(meta: &PluginMeta, config: Option<&str>) -> Result<String> {
    let raw = config
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .unwrap_or("{}");
    let value: serde_json::Value = serde_json::from_str(raw)
        .map_err(|e| anyhow!("the plugin config is not valid JSON: {e}"))?;
    if meta.config_schema.trim().is_empty() {
        if value != serde_json::json!({}) {
            bail!("plugin '{}' takes no config (its metadata has no config schema); only {{}} is accepted", meta.name);
        }
        return Ok("{}".into());
    }
    let schema: serde_json::Value = serde_json::from_str(&meta.config_schema).map_err(|e| {
        anyhow!(
            "plugin '{}' declares a config schema that is not JSON: {e}",
            meta.name
        )
    })?;
    let validator = jsonschema::validator_for(&schema).map_err(|e| {
        anyhow!(
            "plugin '{}' declares an invalid config schema: {e}",
            meta.name
        )
    })?;
    let errors: Vec<String> = validator
        .iter_errors(&value)
        .take(5)
        .map(|e| format!("{} (at '{}')", e, e.instance_path))
        .collect();
    if !errors.is_empty() {
        bail!(
            "the config does not match plugin '{}''s schema: {}",
            meta.name,
            errors.join("; ")
        );
    }
    Ok(value.to_string())
}

/// A plugin of a request's chain, with its hook policies.
#[derive(Clone)]
pub struct ChainEntry {
    pub plugin: Arc<LoadedPlugin>,
    /// Per hook: true = fail open (skip the plugin on error).
    pub fail_open: [bool; 4],
}

fn hook_index(h: HookKind) -> usize {
    match h {
        HookKind::Route => 0,
        HookKind::RenderPrompt => 1,
        HookKind::OnChunk => 2,
        HookKind::PostProcess => 3,
    }
}

impl ChainEntry {
    pub fn fail_open(&self, h: HookKind) -> bool {
        self.fail_open[hook_index(h)]
    }
}

/// One request's plugin state: per chain entry, a Store and an instance,
/// both created lazily on the entry's first hook call.
pub struct Session {
    runtime: Arc<PluginRuntime>,
    /// One Store per chain entry. A call that traps (deadline, fuel, memory
    /// cap, or a trap of the guest's own) leaves its Store refusing every
    /// later call, so entries must not share one: a fail-open plugin's
    /// failure would otherwise fail every plugin after it in the chain.
    stores: Vec<Option<Store<HostState>>>,
    chain: Vec<ChainEntry>,
    instances: Vec<Option<Plugin>>,
    poisoned: Vec<bool>,
    limits: Limits,
    tenant: String,
    /// What `facts` answers, copied into each Store (token counts kept current).
    facts: Facts,
}

/// The result of a hook, wrapped with the store's fault handling.
impl Session {
    pub fn new(
        runtime: Arc<PluginRuntime>,
        tenant: &str,
        request_id: &str,
        models: Vec<String>,
        chain: Vec<ChainEntry>,
        limits: Limits,
    ) -> Session {
        let n = chain.len();
        Session {
            runtime,
            stores: (0..n).map(|_| None).collect(),
            chain,
            instances: (0..n).map(|_| None).collect(),
            poisoned: vec![false; n],
            limits,
            tenant: tenant.to_string(),
            facts: Facts {
                tenant_id: tenant.to_string(),
                request_id: request_id.to_string(),
                models,
                prompt_tokens: 0,
                completion_tokens: 0,
            },
        }
    }

    pub fn chain(&self) -> &[ChainEntry] {
        &self.chain
    }

    pub fn set_tokens(&mut self, prompt: u32, completion: u32) {
        self.facts.prompt_tokens = prompt;
        self.facts.completion_tokens = completion;
        for store in self.stores.iter_mut().flatten() {
            let f = &mut store.data_mut().facts;
            f.prompt_tokens = prompt;
            f.completion_tokens = completion;
        }
    }

    /// The entries that implement `h`, in chain order.
    pub fn with_hook(&self, h: HookKind) -> Vec<usize> {
        (0..self.chain.len())
            .filter(|&i| self.chain[i].plugin.has(h))
            .collect()
    }

    fn err(
        &self,
        i: usize,
        hook: HookKind,
        kind: ErrorKind,
        detail: impl Into<String>,
    ) -> HookError {
        HookError {
            plugin: self.chain[i].plugin.name.clone(),
            hook,
            kind,
            detail: detail.into(),
        }
    }

    /// Runs `f` on plugin `i`'s instance with the hook's limits, records
    /// metrics, and poisons the instance on any fault.
    fn call<R>(
        &mut self,
        i: usize,
        hook: HookKind,
        f: impl FnOnce(&Plugin, &mut Store<HostState>) -> wasmtime::Result<R>,
        out_len: impl Fn(&R) -> usize,
    ) -> Result<R, HookError> {
        let started = Instant::now();
        let labels = metrics::Labels::new(&self.tenant, &self.chain[i].plugin.name, hook);
        let r = self.call_inner(i, hook, f, out_len);
        // A call refused because of an earlier failure ran nothing.
        let ran = !matches!(&r, Err(e) if e.kind == ErrorKind::Poisoned);
        let fuel_used = self
            .runtime
            .fuel(&self.limits)
            .filter(|_| ran)
            .and_then(|given| {
                self.stores[i]
                    .as_ref()?
                    .get_fuel()
                    .ok()
                    .map(|left| given.saturating_sub(left))
            });
        metrics::record(
            &labels,
            started.elapsed(),
            r.as_ref().err().map(|e| e.kind),
            fuel_used,
        );
        if let Err(e) = &r {
            tracing::warn!(tenant = %self.tenant, plugin = %e.plugin, hook = hook.as_str(), kind = e.kind.as_str(), "{e}");
        }
        r
    }

    fn call_inner<R>(
        &mut self,
        i: usize,
        hook: HookKind,
        f: impl FnOnce(&Plugin, &mut Store<HostState>) -> wasmtime::Result<R>,
        out_len: impl Fn(&R) -> usize,
    ) -> Result<R, HookError> {
        if self.poisoned[i] {
            return Err(self.err(
                i,
                hook,
                ErrorKind::Poisoned,
                "an earlier call of this request failed",
            ));
        }
        let timeout = match hook {
            HookKind::Route | HookKind::RenderPrompt => self.limits.timeout_ms,
            _ => self.limits.chunk_timeout_ms,
        };
        let fuel = self.runtime.fuel(&self.limits);
        let store = self.stores[i].get_or_insert_with(|| {
            let ctx = PluginCtx {
                name: self.chain[i].plugin.name.clone(),
                config: self.chain[i].plugin.config.clone(),
            };
            let mut store = self.runtime.store(&self.tenant, ctx, &self.limits);
            store.data_mut().facts = self.facts.clone();
            store
        });
        if self.instances[i].is_none() {
            arm(store, timeout, fuel);
            match self.chain[i].plugin.pre.instantiate(&mut *store) {
                Ok(p) => self.instances[i] = Some(p),
                Err(e) => {
                    self.poisoned[i] = true;
                    let k = classify(&e);
                    let k = if k == ErrorKind::Trap {
                        ErrorKind::Instantiate
                    } else {
                        k
                    };
                    return Err(self.err(i, hook, k, describe(&e)));
                }
            }
        }
        arm(store, timeout, fuel);
        let inst = self.instances[i].as_ref().expect("instance");
        match f(inst, store) {
            Ok(r) => {
                let n = out_len(&r);
                if n > self.limits.max_output_bytes {
                    self.poisoned[i] = true;
                    return Err(self.err(
                        i,
                        hook,
                        ErrorKind::OutputTooLarge,
                        format!(
                            "returned {n} bytes; the limit is {} bytes",
                            self.limits.max_output_bytes
                        ),
                    ));
                }
                Ok(r)
            }
            Err(e) => {
                self.poisoned[i] = true;
                let k = classify(&e);
                let d = match k {
                    ErrorKind::Timeout => format!("exceeded its deadline of {timeout} ms"),
                    _ => describe(&e),
                };
                Err(self.err(i, hook, k, d))
            }
        }
    }

    pub fn route(&mut self, i: usize, request: &str) -> Result<RouteDecision, HookError> {
        let r = self.call(
            i,
            HookKind::Route,
            |p, s| p.call_route(s, request),
            |d| match d {
                RouteDecision::Modify(s) => s.len(),
                RouteDecision::Reject(r) => r.message.len(),
                RouteDecision::Continue => 0,
            },
        )?;
        if let RouteDecision::Reject(_) = &r {
            metrics::reject(&metrics::Labels::new(
                &self.tenant,
                &self.chain[i].plugin.name,
                HookKind::Route,
            ));
        }
        Ok(r)
    }

    pub fn render_prompt(
        &mut self,
        i: usize,
        request: &str,
        template: Option<&str>,
    ) -> Result<Result<Option<String>, String>, HookError> {
        self.call(
            i,
            HookKind::RenderPrompt,
            |p, s| p.call_render_prompt(s, request, template),
            |r| match r {
                Ok(Some(s)) | Err(s) => s.len(),
                Ok(None) => 0,
            },
        )
    }

    pub fn on_chunk(
        &mut self,
        i: usize,
        choice: u32,
        text: &str,
        finish: bool,
    ) -> Result<String, HookError> {
        self.call(
            i,
            HookKind::OnChunk,
            |p, s| p.call_on_chunk(s, choice, text, finish),
            String::len,
        )
    }

    pub fn post_process(
        &mut self,
        i: usize,
        choice: u32,
        text: &str,
    ) -> Result<Result<String, String>, HookError> {
        self.call(
            i,
            HookKind::PostProcess,
            |p, s| p.call_post_process(s, choice, text),
            |r| match r {
                Ok(s) | Err(s) => s.len(),
            },
        )
    }
}
