//! The CUDA backend: [`Backend`] over device memory of one NVIDIA GPU, with
//! the kernels of `kernels.cu` (compiled by NVRTC at run time, see
//! [`module`]) and cuBLAS for the dense matmuls.
//!
//! Everything is loaded at run time through cudarc's `dynamic-loading`: a
//! binary built with `--features cuda` starts on machines without a driver,
//! and [`CudaBackend::new`] says why it cannot open a GPU instead of
//! panicking.
//!
//! All work is queued on one stream, in call order. Operations that return
//! nothing record the first launch error; the next call that returns a
//! `Result` ([`Backend::reserve`], [`Backend::upload_step`],
//! [`Backend::to_host`]) reports it.
//!
//! What runs where:
//! - quantized weights (Q4_0, Q4_1, Q8_0) stay quantized, repacked for
//!   aligned loads ([`weights`]); a matmul quantizes the activations to
//!   int8 per 32-block and runs a dp4a kernel: matrix-vector over
//!   [`plan::MMVQ_COLS`] rows at a time for few rows, 64 × 64 tiles through
//!   shared memory from [`plan::MMQ_MIN_ROWS`] rows on;
//! - F16/BF16 weights stay 16-bit and F32 weights f32; their matmuls are
//!   `cublasGemmEx` with f32 accumulation, after rounding the activations to
//!   the weight's type;
//! - attention is split-KV flash decoding for decode rows and a tiled
//!   online-softmax kernel for prefill rows, both through the step's block
//!   tables;
//! - sampling ([`Backend::sample`]) is three kernels of one block per row
//!   (the logit processors; the choice by radix selection over the
//!   probabilities, with masses in fixed point; the logprobs of rows that
//!   ask), so only ids and logprobs come back.
//!
//! Nothing here has been run on a GPU yet: the kernels are checked by
//! compiling them with NVRTC (`module::tests`), the host-side arithmetic by
//! unit tests, and the trickiest kernels by host transliterations tested
//! against the CPU (`emulate`).

#[cfg(test)]
mod emulate;
pub mod module;
pub mod plan;
pub mod weights;

use super::{Backend, BackendError, DeviceMatrix, HostMatrix, KvSpec, Rows, StepBatch};
use crate::ops::sample::{SampledRows, SamplingMetadata};
use crate::ops::{KvDtype, KvLayout, RopeStyle, RopeTable};
use crate::quant::GgmlType;
use cudarc::cublas::{result as blas_result, sys as blas_sys, CudaBlas};
use cudarc::driver::{
    sys as drv_sys, CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, DeviceRepr,
    DriverError, LaunchConfig, PushKernelArg, ValidAsZeroBits,
};
use cudarc::nvrtc::Ptx;
use plan::{AttnPlan, ATT_THREADS, ELEMWISE_THREADS, MMQ_THREADS, MMQ_TILE, MMVQ_COLS, MMVQ_WARPS};
use std::collections::HashMap;
use std::fmt::Debug;
use std::sync::Arc;

/// Whether the CUDA driver library (libcuda) can be loaded. cudarc panics
/// on its first driver call when it cannot, so [`CudaBackend::new`] asks
/// this first.
pub fn driver_available() -> bool {
    // SAFETY: only tries to open the library by its candidate names.
    unsafe { drv_sys::is_culib_present() }
}

/// The number of CUDA devices, or why there are none to use (no driver, a
/// driver that fails to initialize).
pub fn device_count() -> Result<usize, BackendError> {
    if !driver_available() {
        return Err(no_driver());
    }
    CudaContext::device_count()
        .map(|n| n.max(0) as usize)
        .map_err(|e| dev_err("cuda", "counting CUDA devices", e))
}

fn no_driver() -> BackendError {
    BackendError::Device {
        device: "cuda".into(),
        what: "loading the CUDA driver".into(),
        // The candidate names cudarc tries are many and alike; the one a
        // driver installs is libcuda.so.1.
        detail: "libcuda.so.1 could not be loaded (is the NVIDIA driver installed and on the library path?); install the NVIDIA driver, or use --device cpu".into(),
    }
}

fn dev_err(device: &str, what: impl Into<String>, e: impl Debug) -> BackendError {
    BackendError::Device {
        device: device.to_string(),
        what: what.into(),
        detail: format!("{e:?}"),
    }
}

/// A weight matrix on the GPU (see [`weights`] for the layout).
pub struct CudaMatrix {
    ty: GgmlType,
    rows: usize,
    cols: usize,
    data: CudaSlice<u8>,
    /// Byte offset of the scales of a quantized type.
    scale_off: usize,
}

impl DeviceMatrix for CudaMatrix {
    fn ty(&self) -> GgmlType {
        self.ty
    }
    fn rows(&self) -> usize {
        self.rows
    }
    fn cols(&self) -> usize {
        self.cols
    }
    fn size_bytes(&self) -> usize {
        self.data.len()
    }
}

/// An f32 vector on the GPU.
pub struct CudaVector {
    /// `None` for an empty vector (CUDA has no empty allocations).
    data: Option<CudaSlice<f32>>,
    len: usize,
}

/// An f32 activation buffer on the GPU; starts empty and grows with
/// [`Backend::reserve`].
#[derive(Default)]
pub struct CudaBuffer {
    data: Option<CudaSlice<f32>>,
}

impl CudaBuffer {
    /// Elements the buffer holds.
    pub fn len(&self) -> usize {
        self.data.as_ref().map_or(0, |d| d.len())
    }

    /// Whether nothing has been reserved yet.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A device array of u32 that grows and is refilled each step.
#[derive(Default)]
struct DevU32 {
    data: Option<CudaSlice<u32>>,
}

/// The rotary table on the GPU.
pub struct CudaRope {
    cos: CudaSlice<f32>,
    sin: CudaSlice<f32>,
    head_dim: usize,
    max_positions: usize,
    style: RopeStyle,
}

/// The KV pool: per layer a K and a V cache of [`KvLayout`], as raw bytes of
/// the pool's element type.
pub struct CudaKv {
    dtype: KvDtype,
    layouts: Vec<KvLayout>,
    layers: Vec<(CudaSlice<u8>, CudaSlice<u8>)>,
}

impl CudaKv {
    /// The shape of layer `i`'s K (or V).
    pub fn layout(&self, i: usize) -> &KvLayout {
        &self.layouts[i]
    }
}

/// One step's metadata on the GPU, plus the host-side facts launches need
/// (counts, and maxima that bound-check the device reads before they run).
#[derive(Default)]
pub struct CudaStep {
    tokens: DevU32,
    positions: DevU32,
    slots: DevU32,
    logit_rows: DevU32,
    /// `[n_seqs][4]`: q_start, q_len, ctx_len, table_start.
    seq_meta: DevU32,
    tables: DevU32,
    /// Per token its LoRA slot ([`StepBatch::lora_slots`], widened).
    lora_slots: DevU32,
    /// Host staging for `seq_meta`, kept for its capacity.
    meta_host: Vec<u32>,
    /// Host staging for `lora_slots`.
    lora_host: Vec<u32>,
    /// Tokens with a LoRA slot entry: 0 when no token has an adapter.
    n_lora: usize,
    n_tokens: usize,
    n_seqs: usize,
    n_logit_rows: usize,
    max_token: Option<u32>,
    max_position: Option<u32>,
    max_slot: Option<u32>,
    max_block: Option<u32>,
    max_logit_row: Option<u32>,
    /// Longest context of a decode row (q_len == 1); 0 without one.
    max_decode_ctx: usize,
    /// Longest q_len of a prefill row (q_len > 1); 0 without one.
    max_prefill_q: usize,
}

/// Scratch the matmuls and the attention merge reuse across calls.
#[derive(Default)]
struct Scratch {
    xq: Option<CudaSlice<i8>>,
    /// `(d, sum)` pairs per 32-block.
    xd: Option<CudaSlice<f32>>,
    half: Option<CudaSlice<u16>>,
    /// LoRA's `h = scale · A x`, `[tokens, max rank]`.
    lora_h: Option<CudaSlice<f32>>,
    part_o: Option<CudaSlice<f32>>,
    part_ml: Option<CudaSlice<f32>>,
}

/// [`Backend::sample`]'s arrays: the metadata as the kernels read it, their
/// scratch and their results. Grown as needed and reused.
#[derive(Default)]
struct SampleBufs {
    /// Per row, [`plan::SAMPLE_U`] words (see kernels.cu).
    rows_u: DevU32,
    /// Per row, [`plan::SAMPLE_F`] floats.
    rows_f: Option<CudaSlice<f32>>,
    uniform: Option<CudaSlice<f64>>,
    /// The CSR lists: penalized, output tokens and counts, biases, bans and
    /// allowed ids, each list's offsets before its values.
    lists: [DevU32; 11],
    bias_val: Option<CudaSlice<f32>>,
    masks: DevU32,
    /// Per row, the allowed ids' and the repetition penalty's bit sets.
    bits: DevU32,
    /// The raw logits of the rows that want logprobs.
    raw: Option<CudaSlice<f32>>,
    tokens: DevU32,
    ranks: DevU32,
    logprobs: Option<CudaSlice<f32>>,
    top_ids: DevU32,
    top_lps: Option<CudaSlice<f32>>,
    /// Host staging for `rows_u`, `rows_f` and `uniform`.
    host_u: Vec<u32>,
    host_f: Vec<f32>,
    host_d: Vec<f64>,
}

/// One NVIDIA GPU as a [`Backend`].
pub struct CudaBackend {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    kernels: HashMap<&'static str, CudaFunction>,
    /// "cuda:0" (for errors).
    device: String,
    describe: String,
    sms: usize,
    host: Vec<f32>,
    scratch: Scratch,
    /// The first error of an operation that could not return it.
    pending: Option<BackendError>,
    /// [`Backend::sample`]'s device arrays.
    sampling: SampleBufs,
}

/// Launches kernel `$name` of `$b` with `$cfg` and the arguments, each
/// evaluated into a local that outlives the launch.
macro_rules! launch {
    ($b:expr, $name:expr, $cfg:expr; $($arg:expr),* $(,)?) => {{
        let func = &$b.kernels[$name];
        let mut builder = $b.stream.launch_builder(func);
        $(
            let a = $arg;
            builder.arg(&a);
        )*
        // SAFETY: the arguments match the kernel's parameter list in
        // kernels.cu in number, order and width (u32/u64/i32/f32, and u64
        // device addresses for pointers), and every address was checked to
        // cover the elements the launch touches.
        unsafe { builder.launch($cfg) }
            .map(|_| ())
            .map_err(|e| dev_err(&$b.device, format!("launching {}", $name), e))
    }};
}

fn cfg1(n: usize, what: &str) -> LaunchConfig {
    let blocks = match plan::blocks_for(n, ELEMWISE_THREADS, what) {
        Ok(b) => b,
        Err(e) => panic!("{e}"),
    };
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (ELEMWISE_THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The device address of `s`. Event tracking is off (one stream orders
/// everything), so the guard cudarc returns has nothing to do.
fn addr<T>(s: &CudaSlice<T>, stream: &CudaStream) -> u64 {
    let (p, _guard) = s.device_ptr(stream);
    p
}

impl CudaBackend {
    /// Opens GPU `ordinal`: loads the driver, cuBLAS and NVRTC, and the
    /// kernels (from the PTX cache, or compiled now for the GPU's
    /// architecture). Fails with a one-line reason when the driver or a
    /// library is missing or the GPU does not exist.
    pub fn new(ordinal: usize) -> Result<CudaBackend, BackendError> {
        let device = format!("cuda:{ordinal}");
        if !driver_available() {
            return Err(no_driver());
        }
        let n = device_count()?;
        if ordinal >= n {
            return Err(BackendError::Device {
                device,
                what: "opening the GPU".into(),
                detail: format!("there are {n} CUDA devices"),
            });
        }
        let ctx =
            CudaContext::new(ordinal).map_err(|e| dev_err(&device, "creating a context", e))?;
        // SAFETY: the backend uses one stream for every allocation, copy and
        // launch, so stream order alone keeps reads after writes and frees
        // after uses; per-buffer events would only add overhead.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx
            .new_stream()
            .map_err(|e| dev_err(&device, "creating a stream", e))?;
        // SAFETY: only tries to open the library by its candidate names.
        if !unsafe { blas_sys::is_culib_present() } {
            return Err(BackendError::Device {
                device,
                what: "loading cuBLAS".into(),
                detail: format!(
                    "libcublas could not be loaded (tried {:?}); install the CUDA toolkit's cuBLAS or `pip install nvidia-cublas-cu12` and add its lib/ directory to LD_LIBRARY_PATH",
                    cudarc::get_lib_name_candidates("cublas")
                ),
            });
        }
        let blas =
            CudaBlas::new(stream.clone()).map_err(|e| dev_err(&device, "creating cuBLAS", e))?;
        let (major, minor) = ctx
            .compute_capability()
            .map_err(|e| dev_err(&device, "reading the compute capability", e))?;
        if (major, minor) < (6, 1) {
            return Err(BackendError::Device {
                device,
                what: "opening the GPU".into(),
                detail: format!(
                    "compute capability {major}.{minor} lacks dp4a; the CUDA backend needs 6.1 or newer"
                ),
            });
        }
        let arch = module::arch_for(major, minor);
        // A GPU newer than this NVRTC knows runs compute_80 PTX through the
        // driver's JIT.
        let ptx = module::ptx_for(&arch)
            .or_else(|first| module::ptx_for("compute_80").map_err(|_| first))
            .map_err(|e| BackendError::Device {
                device: device.clone(),
                what: "compiling the kernels".into(),
                detail: e,
            })?;
        let m = ctx
            .load_module(Ptx::from_src(ptx))
            .map_err(|e| dev_err(&device, "loading the kernels' PTX", e))?;
        let mut kernels = HashMap::new();
        for &k in module::KERNELS {
            let f = m
                .load_function(k)
                .map_err(|e| dev_err(&device, format!("loading kernel {k}"), e))?;
            kernels.insert(k, f);
        }
        let sms = ctx
            .attribute(drv_sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(|e| dev_err(&device, "reading the multiprocessor count", e))?
            .max(1) as usize;
        let name = ctx.name().unwrap_or_else(|_| "unknown GPU".into());
        let describe = format!("{device}: {name}, sm_{major}{minor}, {sms} SMs");
        Ok(CudaBackend {
            ctx,
            stream,
            blas,
            kernels,
            device,
            describe,
            sms,
            host: Vec::new(),
            scratch: Scratch::default(),
            pending: None,
            sampling: SampleBufs::default(),
        })
    }

    /// Free and total device memory in bytes (for sizing the KV pool).
    pub fn memory_info(&self) -> Result<(usize, usize), BackendError> {
        self.ctx
            .mem_get_info()
            .map_err(|e| dev_err(&self.device, "querying device memory", e))
    }

    fn err(&self, what: impl Into<String>, e: impl Debug) -> BackendError {
        dev_err(&self.device, what, e)
    }

    /// Maps an allocation failure to [`BackendError::OutOfMemory`] when it is
    /// one.
    fn alloc_err(&self, what: &'static str, bytes: usize, e: DriverError) -> BackendError {
        if e.0 == drv_sys::cudaError_enum::CUDA_ERROR_OUT_OF_MEMORY {
            BackendError::OutOfMemory {
                device: self.device.clone(),
                what,
                bytes,
            }
        } else {
            self.err(format!("allocating {bytes} bytes for {what}"), e)
        }
    }

    fn alloc<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        len: usize,
        what: &'static str,
    ) -> Result<CudaSlice<T>, BackendError> {
        self.stream
            .alloc_zeros::<T>(len.max(1))
            .map_err(|e| self.alloc_err(what, len * std::mem::size_of::<T>(), e))
    }

    fn upload<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        data: &[T],
        what: &'static str,
    ) -> Result<CudaSlice<T>, BackendError> {
        let mut d = self.alloc::<T>(data.len(), what)?;
        if !data.is_empty() {
            self.stream
                .memcpy_htod(data, &mut d.slice_mut(0..data.len()))
                .map_err(|e| self.err(format!("copying {what} to the device"), e))?;
        }
        Ok(d)
    }

    /// Grows `slot` to at least `len` elements, keeping its contents.
    fn grow<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        slot: &mut Option<CudaSlice<T>>,
        len: usize,
        what: &'static str,
    ) -> Result<(), BackendError> {
        let have = slot.as_ref().map_or(0, |s| s.len());
        if have >= len {
            return Ok(());
        }
        let mut new = self.alloc::<T>(len, what)?;
        if let Some(old) = slot.as_ref() {
            self.stream
                .memcpy_dtod(old, &mut new.slice_mut(0..old.len()))
                .map_err(|e| self.err(format!("copying {what} into its grown buffer"), e))?;
        }
        *slot = Some(new);
        Ok(())
    }

    /// Copies `data` into the front of `dst`, growing it first.
    fn fill(&self, dst: &mut DevU32, data: &[u32], what: &'static str) -> Result<(), BackendError> {
        self.grow(&mut dst.data, data.len(), what)?;
        if let (Some(d), false) = (dst.data.as_mut(), data.is_empty()) {
            self.stream
                .memcpy_htod(data, &mut d.slice_mut(0..data.len()))
                .map_err(|e| self.err(format!("copying {what} to the device"), e))?;
        }
        Ok(())
    }

    /// Copies `data` into the front of `slot`, growing it first (to one
    /// element at least, so that its address is valid), and returns its
    /// address.
    fn fill_slice<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        slot: &mut Option<CudaSlice<T>>,
        data: &[T],
        what: &'static str,
    ) -> Result<u64, BackendError> {
        self.grow(slot, data.len().max(1), what)?;
        let Some(d) = slot.as_mut() else {
            unreachable!("grown above")
        };
        if !data.is_empty() {
            self.stream
                .memcpy_htod(data, &mut d.slice_mut(0..data.len()))
                .map_err(|e| self.err(format!("copying {what} to the device"), e))?;
        }
        Ok(addr(d, &self.stream))
    }

    /// Grows `slot` to `len` elements (one at least) and returns its
    /// address.
    fn scratch<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        slot: &mut Option<CudaSlice<T>>,
        len: usize,
        what: &'static str,
    ) -> Result<u64, BackendError> {
        self.grow(slot, len.max(1), what)?;
        let Some(d) = slot.as_ref() else {
            unreachable!("grown above")
        };
        Ok(addr(d, &self.stream))
    }

    /// Copies the first `dst.len()` elements of `src` to `dst`.
    fn read_back<T: DeviceRepr>(
        &self,
        src: &Option<CudaSlice<T>>,
        dst: &mut [T],
        what: &'static str,
    ) -> Result<(), BackendError> {
        if dst.is_empty() {
            return Ok(());
        }
        let src = match src {
            Some(s) if s.len() >= dst.len() => s,
            _ => panic!("{}: {what} was never written", self.device),
        };
        self.stream
            .memcpy_dtoh(&src.slice(0..dst.len()), dst)
            .map_err(|e| self.err(format!("copying {what} to the host"), e))
    }

    /// Uploads `meta`, runs the three sampling kernels over the logits at
    /// address `logits`, and reads the results into `out` (already shaped
    /// for `meta`).
    fn sample_launch(
        &mut self,
        sb: &mut SampleBufs,
        logits: u64,
        vocab: usize,
        meta: &SamplingMetadata,
        out: &mut SampledRows,
    ) -> Result<(), BackendError> {
        let n = meta.num_rows();
        sb.host_u.clear();
        sb.host_f.clear();
        sb.host_d.clear();
        let mut raw_rows = 0u32;
        for (r, p) in meta.rows().iter().enumerate() {
            let mut flags = 0;
            if p.greedy {
                flags |= plan::SAMPLE_GREEDY;
            }
            let raw_slot = raw_rows;
            if p.logprobs.is_some() {
                flags |= plan::SAMPLE_LOGPROBS;
                raw_rows += 1;
            }
            if crate::ops::sample::restricted(meta, r) {
                flags |= plan::SAMPLE_RESTRICTED;
            }
            sb.host_u.extend_from_slice(&[
                p.logit_row,
                flags,
                p.top_k,
                p.logprobs.unwrap_or(0),
                meta.mask_at()[r],
                out.top_ids.offsets()[r],
                raw_slot,
                0,
            ]);
            sb.host_f.extend_from_slice(&[
                p.temperature,
                p.top_p,
                p.min_p,
                p.repetition_penalty,
                p.presence_penalty,
                p.frequency_penalty,
                0.0,
                0.0,
            ]);
            sb.host_d.push(p.uniform);
        }
        debug_assert_eq!(sb.host_u.len(), n * plan::SAMPLE_U);
        debug_assert_eq!(sb.host_f.len(), n * plan::SAMPLE_F);
        let (out_tok, out_cnt) = meta.output_counts();
        let (bias_tok, bias_val) = meta.biases();
        let lists: [&[u32]; 11] = [
            meta.penalized().offsets(),
            meta.penalized().values(),
            out_tok.offsets(),
            out_tok.values(),
            out_cnt,
            bias_tok.offsets(),
            bias_tok.values(),
            meta.banned().offsets(),
            meta.banned().values(),
            meta.allowed().offsets(),
            meta.allowed().values(),
        ];
        let mut la = [0u64; 11];
        for (i, l) in lists.iter().enumerate() {
            la[i] = self.fill_slice(&mut sb.lists[i].data, l, "the sampling lists")?;
        }
        let rows_u = self.fill_slice(&mut sb.rows_u.data, &sb.host_u, "the sampling rows")?;
        let rows_f = self.fill_slice(&mut sb.rows_f, &sb.host_f, "the sampling rows")?;
        let uniform = self.fill_slice(&mut sb.uniform, &sb.host_d, "the sampling draws")?;
        let bias_v = self.fill_slice(&mut sb.bias_val, bias_val, "the logit biases")?;
        let masks = self.fill_slice(&mut sb.masks.data, meta.masks(), "the grammar masks")?;
        let words = vocab.div_ceil(32);
        let bits = self.scratch(&mut sb.bits.data, n * 2 * words, "the sampling bit sets")?;
        let raw = self.scratch(&mut sb.raw, raw_rows as usize * vocab, "the raw logits")?;
        let tokens = self.scratch(&mut sb.tokens.data, n, "the sampled ids")?;
        let ranks = self.scratch(&mut sb.ranks.data, n, "the sampled ranks")?;
        let lps = self.scratch(&mut sb.logprobs, n, "the sampled logprobs")?;
        let top = out.top_ids.values().len();
        let top_ids = self.scratch(&mut sb.top_ids.data, top, "the top logprob ids")?;
        let top_lps = self.scratch(&mut sb.top_lps, top, "the top logprobs")?;
        let cfg = LaunchConfig {
            grid_dim: (n as u32, 1, 1),
            block_dim: (plan::SAMPLE_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let v = vocab as u32;
        launch!(self, "pg_sample_process", cfg;
            logits, raw, v, rows_u, rows_f, la[0], la[1], la[2], la[3], la[4], la[5], la[6],
            bias_v, la[7], la[8], la[9], la[10], masks, bits)?;
        launch!(self, "pg_sample_pick", cfg; logits, v, rows_u, rows_f, uniform, tokens)?;
        launch!(self, "pg_sample_logprobs", cfg;
            raw, v, rows_u, tokens, lps, ranks, top_ids, top_lps)?;
        self.read_back(&sb.tokens.data, &mut out.tokens, "the sampled ids")?;
        self.read_back(&sb.logprobs, &mut out.logprobs, "the sampled logprobs")?;
        self.read_back(&sb.ranks.data, &mut out.ranks, "the sampled ranks")?;
        let (ids, top_lps_host) = out.top_lists_mut();
        self.read_back(&sb.top_ids.data, ids, "the top logprob ids")?;
        self.read_back(&sb.top_lps, top_lps_host, "the top logprobs")?;
        self.stream
            .synchronize()
            .map_err(|e| dev_err(&self.device, "waiting for the stream", e))
    }

    /// Keeps the first error of a call that cannot return one.
    fn record(&mut self, r: Result<(), BackendError>) {
        if let (Err(e), None) = (r, &self.pending) {
            self.pending = Some(e);
        }
    }

    fn take_pending(&mut self) -> Result<(), BackendError> {
        self.pending.take().map_or(Ok(()), Err)
    }

    /// The address of `buf`, which must hold `need` elements.
    fn buf(&self, buf: &CudaBuffer, need: usize, what: &str) -> u64 {
        match &buf.data {
            Some(d) if d.len() >= need => addr(d, &self.stream),
            _ if need == 0 => 0,
            _ => panic!(
                "{}: {what} holds {} elements, the operation needs {need} (reserve it first)",
                self.device,
                buf.len()
            ),
        }
    }

    fn step_arr(&self, a: &DevU32, need: usize) -> u64 {
        match &a.data {
            Some(d) if d.len() >= need => addr(d, &self.stream),
            _ if need == 0 => 0,
            _ => panic!("{}: step metadata not uploaded", self.device),
        }
    }

    fn vec_addr(&self, v: &CudaVector, need: usize, what: &str) -> u64 {
        assert!(
            v.len >= need,
            "{}: {what} has {} elements, the operation needs {need}",
            self.device,
            v.len
        );
        v.data.as_ref().map_or(0, |d| addr(d, &self.stream))
    }

    fn matmul_quant(
        &mut self,
        w: &CudaMatrix,
        x: u64,
        m: usize,
        out: u64,
    ) -> Result<(), BackendError> {
        let k = w.cols;
        let nb = k / 32;
        let n_blocks = m * nb;
        let mut xq = self.scratch.xq.take();
        let mut xd = self.scratch.xd.take();
        let r = (|| -> Result<(), BackendError> {
            self.grow(&mut xq, m * k, "quantized activations")?;
            self.grow(&mut xd, 2 * n_blocks, "activation scales")?;
            let (xq_p, xd_p) = match (&xq, &xd) {
                (Some(q), Some(d)) => (addr(q, &self.stream), addr(d, &self.stream)),
                _ => return Ok(()),
            };
            launch!(self, "pg_quantize_x", cfg1(n_blocks * 32, "quantize_x");
                x, n_blocks as u64, xq_p, xd_p)?;
            let tiled = plan::use_tiled_matmul(m);
            let name = match (w.ty, tiled) {
                (GgmlType::Q4_0, false) => "pg_mmvq_q4_0",
                (GgmlType::Q4_1, false) => "pg_mmvq_q4_1",
                (_, false) => "pg_mmvq_q8_0",
                (GgmlType::Q4_0, true) => "pg_mmq_q4_0",
                (GgmlType::Q4_1, true) => "pg_mmq_q4_1",
                (_, true) => "pg_mmq_q8_0",
            };
            let (per_x, per_y, threads) = if tiled {
                (MMQ_TILE, MMQ_TILE as usize, MMQ_THREADS)
            } else {
                (MMVQ_WARPS, MMVQ_COLS as usize, 32 * MMVQ_WARPS)
            };
            let gx = plan::blocks_for(w.rows, per_x, "quantized matmul")
                .map_err(|e| self.err("planning a quantized matmul", e))?;
            let gy = u32::try_from(m.div_ceil(per_y))
                .ok()
                .filter(|&g| g <= 65535)
                .ok_or_else(|| {
                    self.err(
                        "planning a quantized matmul",
                        format!("{m} rows exceed the grid"),
                    )
                })?;
            let cfg = LaunchConfig {
                grid_dim: (gx, gy, 1),
                block_dim: (threads, 1, 1),
                shared_mem_bytes: 0,
            };
            launch!(self, name, cfg;
                addr(&w.data, &self.stream), w.scale_off as u64, w.rows as u32, nb as u32,
                xq_p, xd_p, m as u32, out)
        })();
        self.scratch.xq = xq;
        self.scratch.xd = xd;
        r
    }

    fn matmul_dense(
        &mut self,
        w: &CudaMatrix,
        x: u64,
        m: usize,
        out: u64,
    ) -> Result<(), BackendError> {
        let (n, k) = (w.rows, w.cols);
        let (dtype, b_ptr) = match w.ty {
            GgmlType::F32 => (blas_sys::cudaDataType_t::CUDA_R_32F, x),
            ty => {
                let mut half = self.scratch.half.take();
                let r = self
                    .grow(&mut half, m * k, "16-bit activations")
                    .and_then(|()| {
                        let h = half.as_ref().map_or(0, |h| addr(h, &self.stream));
                        let name = if ty == GgmlType::F16 {
                            "pg_f32_to_f16"
                        } else {
                            "pg_f32_to_bf16"
                        };
                        launch!(self, name, cfg1(m * k, "to 16-bit"); x, (m * k) as u64, h)
                            .map(|()| h)
                    });
                self.scratch.half = half;
                let h = r?;
                let t = if ty == GgmlType::F16 {
                    blas_sys::cudaDataType_t::CUDA_R_16F
                } else {
                    blas_sys::cudaDataType_t::CUDA_R_16BF
                };
                (t, h)
            }
        };
        let dims = [n, m, k].map(|v| i32::try_from(v).ok());
        let [Some(n32), Some(m32), Some(k32)] = dims else {
            return Err(self.err("cublasGemmEx", format!("shape {m}x{k}·{n} exceeds i32")));
        };
        let (alpha, beta) = (1.0f32, 0.0f32);
        self.ctx
            .bind_to_thread()
            .map_err(|e| self.err("binding the context", e))?;
        // Row-major out[m][n] = x[m][k] · W[n][k]ᵀ is, in cuBLAS's column-major
        // terms, outᵀ (n × m) = Wᵀ · xᵀ with W read as a k × n matrix.
        // SAFETY: the pointers cover n·k, m·k and m·n elements (checked by
        // the callers), alpha/beta are host f32 as CUBLAS_COMPUTE_32F wants,
        // and the handle's stream is the backend's stream.
        unsafe {
            blas_result::gemm_ex(
                *self.blas.handle(),
                blas_sys::cublasOperation_t::CUBLAS_OP_T,
                blas_sys::cublasOperation_t::CUBLAS_OP_N,
                n32,
                m32,
                k32,
                (&alpha) as *const f32 as *const _,
                addr(&w.data, &self.stream) as *const _,
                dtype,
                k32,
                b_ptr as *const _,
                dtype,
                k32,
                (&beta) as *const f32 as *const _,
                out as *mut _,
                blas_sys::cudaDataType_t::CUDA_R_32F,
                n32,
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| self.err("cublasGemmEx", e))
    }

    #[allow(clippy::too_many_arguments)]
    fn attention_launch(
        &mut self,
        kv: &CudaKv,
        layer: usize,
        q: u64,
        n_heads: usize,
        scale: f32,
        step: &CudaStep,
        out: u64,
        plan: &AttnPlan,
    ) -> Result<(), BackendError> {
        let l = &kv.layouts[layer];
        let (k_c, v_c) = &kv.layers[layer];
        let (k_p, v_p) = (addr(k_c, &self.stream), addr(v_c, &self.stream));
        let name = match kv.dtype {
            KvDtype::F32 => "pg_attention_f32",
            KvDtype::F16 => "pg_attention_f16",
            KvDtype::Bf16 => "pg_attention_bf16",
        };
        let meta = self.step_arr(&step.seq_meta, 4 * step.n_seqs);
        let tables = self.step_arr(&step.tables, 0);
        let n_seqs = u32::try_from(step.n_seqs)
            .ok()
            .filter(|&s| s <= 65535)
            .ok_or_else(|| {
                self.err(
                    "planning attention",
                    format!("{} sequences exceed the grid", step.n_seqs),
                )
            })?;
        let (nkv, d) = (l.n_kv_heads as u32, l.head_dim as u32);
        if step.max_decode_ctx > 0 {
            let split = plan.n_splits > 1;
            let (mut po, mut pml) = (self.scratch.part_o.take(), self.scratch.part_ml.take());
            let parts = step.n_seqs * l.n_kv_heads * plan.n_splits * plan.group;
            let r = (|| -> Result<(), BackendError> {
                let (po_p, pml_p) = if split {
                    self.grow(&mut po, parts * l.head_dim, "attention partials")?;
                    self.grow(&mut pml, 2 * parts, "attention partial sums")?;
                    (
                        po.as_ref().map_or(0, |s| addr(s, &self.stream)),
                        pml.as_ref().map_or(0, |s| addr(s, &self.stream)),
                    )
                } else {
                    (0, 0)
                };
                let cfg = LaunchConfig {
                    grid_dim: (plan.n_splits as u32, nkv, n_seqs),
                    block_dim: (ATT_THREADS, 1, 1),
                    shared_mem_bytes: plan::attn_smem_bytes(plan.group, l.head_dim) as u32,
                };
                launch!(self, name, cfg;
                    q, out, k_p, v_p, meta, tables, n_heads as u32, nkv, d, l.block_size as u32,
                    scale, 1u32, plan.split_len as u32, plan.n_splits as u32, 1i32, po_p, pml_p)?;
                if split {
                    let cfg = LaunchConfig {
                        grid_dim: (n_heads as u32, n_seqs, 1),
                        block_dim: (d, 1, 1),
                        shared_mem_bytes: 0,
                    };
                    launch!(self, "pg_attn_merge", cfg;
                        po_p, pml_p, meta, n_heads as u32, nkv, d, plan.split_len as u32,
                        plan.n_splits as u32, out)?;
                }
                Ok(())
            })();
            self.scratch.part_o = po;
            self.scratch.part_ml = pml;
            r?;
        }
        if step.max_prefill_q > 0 {
            let tiles = step.max_prefill_q.div_ceil(plan.nq);
            let cfg = LaunchConfig {
                grid_dim: (tiles as u32, nkv, n_seqs),
                block_dim: (ATT_THREADS, 1, 1),
                shared_mem_bytes: plan.smem_bytes as u32,
            };
            launch!(self, name, cfg;
                q, out, k_p, v_p, meta, tables, n_heads as u32, nkv, d, l.block_size as u32,
                scale, plan.nq as u32, 0u32, 1u32, 0i32, 0u64, 0u64)?;
        }
        Ok(())
    }
}

impl Backend for CudaBackend {
    type Matrix = CudaMatrix;
    type Vector = CudaVector;
    type Buffer = CudaBuffer;
    type Kv = CudaKv;
    type Rope = CudaRope;
    type Step = CudaStep;
    /// The mixture-of-experts operations have no CUDA kernels yet
    /// (`supports_experts` is false), so there is no routing to hold.
    type Routes = ();

    fn describe(&self) -> String {
        self.describe.clone()
    }

    fn memory_info(&self) -> Result<Option<(usize, usize)>, BackendError> {
        CudaBackend::memory_info(self).map(Some)
    }

    fn upload_matrix(&self, m: &HostMatrix<'_>) -> Result<CudaMatrix, BackendError> {
        let unsupported = || {
            BackendError::Unsupported {
            device: self.device.clone(),
            ty: m.ty(),
            hint: " (the CUDA kernels read Q4_0, Q4_1, Q8_0, F16, BF16 and F32: use a GGUF of one of those types)",
        }
        };
        if m.affine().is_some() {
            return Err(BackendError::Unsupported {
                device: self.device.clone(),
                ty: m.ty(),
                hint: " with a column order, per-row output scales or a static input scale (GPTQ desc_act, compressed-tensors W8A8, ModelSlim W8A8): the CUDA kernels have no such epilogue yet; serve this checkpoint with --device cpu",
            });
        }
        let packed =
            weights::pack(m.ty(), m.rows(), m.cols(), m.bytes()).ok_or_else(unsupported)?;
        let data = self.upload(&packed.bytes, "a weight matrix")?;
        Ok(CudaMatrix {
            ty: m.ty(),
            rows: m.rows(),
            cols: m.cols(),
            data,
            scale_off: packed.scale_off,
        })
    }

    fn upload_vector(&self, v: &[f32]) -> Result<CudaVector, BackendError> {
        let data = if v.is_empty() {
            None
        } else {
            Some(self.upload(v, "a vector")?)
        };
        Ok(CudaVector { data, len: v.len() })
    }

    fn upload_rope(&self, table: &RopeTable) -> Result<CudaRope, BackendError> {
        Ok(CudaRope {
            cos: self.upload(table.cos_table(), "the rotary cosines")?,
            sin: self.upload(table.sin_table(), "the rotary sines")?,
            head_dim: table.head_dim(),
            max_positions: table.max_positions(),
            style: table.style(),
        })
    }

    fn alloc_kv(&self, spec: &KvSpec) -> Result<CudaKv, BackendError> {
        let mut layers = Vec::with_capacity(spec.layers.len());
        let mut layouts = Vec::with_capacity(spec.layers.len());
        for (i, ls) in spec.layers.iter().enumerate() {
            let layout = spec.symmetric_layout(i).ok_or_else(|| BackendError::UnsupportedKv {
                device: self.describe(),
                detail: format!(
                    "layer {i} keeps K heads of {} and V heads of {} elements; the CUDA attention kernel needs them equal",
                    ls.k_head_dim, ls.v_head_dim
                ),
            })?;
            let bytes = layout
                .elems()
                .checked_mul(spec.dtype.size())
                .ok_or_else(|| self.err("sizing the KV pool", "overflow"))?;
            let k = self.alloc::<u8>(bytes, "the K cache")?;
            let v = self.alloc::<u8>(bytes, "the V cache")?;
            layers.push((k, v));
            layouts.push(layout);
        }
        Ok(CudaKv {
            dtype: spec.dtype,
            layouts,
            layers,
        })
    }

    fn reserve(&mut self, buf: &mut CudaBuffer, len: usize) -> Result<(), BackendError> {
        self.take_pending()?;
        self.grow(&mut buf.data, len, "an activation buffer")
    }

    fn upload_step(&mut self, batch: &StepBatch, step: &mut CudaStep) -> Result<(), BackendError> {
        self.take_pending()?;
        let mut meta = std::mem::take(&mut step.meta_host);
        meta.clear();
        let (mut max_decode_ctx, mut max_prefill_q) = (0usize, 0usize);
        for s in &batch.seqs {
            assert!(
                s.q_len <= s.ctx_len,
                "upload_step: a sequence has q_len {} > ctx_len {}",
                s.q_len,
                s.ctx_len
            );
            meta.extend_from_slice(&[s.q_start, s.q_len, s.ctx_len, s.table_start]);
            match s.q_len {
                0 => {}
                1 => max_decode_ctx = max_decode_ctx.max(s.ctx_len as usize),
                q => max_prefill_q = max_prefill_q.max(q as usize),
            }
        }
        let r = (|| -> Result<(), BackendError> {
            self.fill(&mut step.tokens, &batch.tokens, "the step's tokens")?;
            self.fill(
                &mut step.positions,
                &batch.positions,
                "the step's positions",
            )?;
            self.fill(
                &mut step.slots,
                &batch.slot_mapping,
                "the step's slot mapping",
            )?;
            self.fill(
                &mut step.logit_rows,
                &batch.logit_rows,
                "the step's logit rows",
            )?;
            self.fill(&mut step.seq_meta, &meta, "the step's sequences")?;
            self.fill(
                &mut step.tables,
                &batch.block_tables,
                "the step's block tables",
            )?;
            step.lora_host.clear();
            step.lora_host
                .extend(batch.lora_slots.iter().map(|&s| s as u32));
            self.fill(
                &mut step.lora_slots,
                &step.lora_host,
                "the step's LoRA slots",
            )
        })();
        step.meta_host = meta;
        r?;
        step.n_lora = batch.lora_slots.len();
        step.n_tokens = batch.tokens.len();
        step.n_seqs = batch.seqs.len();
        step.n_logit_rows = batch.logit_rows.len();
        step.max_token = batch.tokens.iter().copied().max();
        step.max_position = batch.positions.iter().copied().max();
        step.max_slot = batch.slot_mapping.iter().copied().max();
        // Only the blocks a sequence's context reaches are read, but the
        // whole table is checked: a bad id anywhere is a scheduler bug.
        step.max_block = batch.block_tables.iter().copied().max();
        step.max_logit_row = batch.logit_rows.iter().copied().max();
        step.max_decode_ctx = max_decode_ctx;
        step.max_prefill_q = max_prefill_q;
        Ok(())
    }

    fn to_host<'a>(
        &'a mut self,
        buf: &'a mut CudaBuffer,
        len: usize,
    ) -> Result<&'a mut [f32], BackendError> {
        self.take_pending()?;
        self.host.resize(len, 0.0);
        if len > 0 {
            let src = match &buf.data {
                Some(d) if d.len() >= len => d,
                _ => panic!(
                    "{}: to_host of {len} elements from a buffer of {}",
                    self.device,
                    buf.len()
                ),
            };
            self.stream
                .memcpy_dtoh(&src.slice(0..len), &mut self.host[..len])
                .map_err(|e| dev_err(&self.device, "copying results to the host", e))?;
        }
        self.stream
            .synchronize()
            .map_err(|e| dev_err(&self.device, "waiting for the stream", e))?;
        Ok(&mut self.host[..len])
    }

    fn embed(&mut self, table: &CudaMatrix, step: &CudaStep, out: &mut CudaBuffer) {
        let n = step.n_tokens;
        if n == 0 {
            return;
        }
        if let Some(t) = step.max_token {
            assert!(
                (t as usize) < table.rows,
                "embed: token {t} outside the table's {} rows",
                table.rows
            );
        }
        let Some(code) = weights::kind_code(table.ty) else {
            panic!("embed: a {} table cannot be on the GPU", table.ty);
        };
        let o = self.buf(out, n * table.cols, "embed's output");
        let tokens = self.step_arr(&step.tokens, n);
        let cfg = LaunchConfig {
            grid_dim: (n as u32, 1, 1),
            block_dim: (ELEMWISE_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let r = launch!(self, "pg_embed", cfg;
            code, addr(&table.data, &self.stream), table.scale_off as u64,
            (table.cols / 32) as u32, table.cols as u32, tokens, n as u32, o);
        self.record(r);
    }

    fn matmul(
        &mut self,
        w: &CudaMatrix,
        x: &CudaBuffer,
        m: usize,
        out: &mut CudaBuffer,
        _step: &CudaStep,
        _rows: Rows,
    ) {
        if m == 0 || w.rows == 0 {
            return;
        }
        let xp = self.buf(x, m * w.cols, "matmul's input");
        let op = self.buf(out, m * w.rows, "matmul's output");
        let r = match w.ty {
            GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q8_0 => self.matmul_quant(w, xp, m, op),
            _ => self.matmul_dense(w, xp, m, op),
        };
        self.record(r);
    }

    fn rms_norm(
        &mut self,
        x: &CudaBuffer,
        weight: &CudaVector,
        eps: f32,
        m: usize,
        d: usize,
        out: &mut CudaBuffer,
    ) {
        if m == 0 {
            return;
        }
        let xp = self.buf(x, m * d, "rms_norm's input");
        let op = self.buf(out, m * d, "rms_norm's output");
        let wp = self.vec_addr(weight, d, "the norm weight");
        let cfg = LaunchConfig {
            grid_dim: (m as u32, 1, 1),
            block_dim: (ELEMWISE_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let r = launch!(self, "pg_rms_norm", cfg; xp, wp, eps, d as u32, op);
        self.record(r);
    }

    fn add(&mut self, x: &mut CudaBuffer, y: &CudaBuffer, n: usize) {
        if n == 0 {
            return;
        }
        let xp = self.buf(x, n, "add's x");
        let yp = self.buf(y, n, "add's y");
        let r = launch!(self, "pg_add", cfg1(n, "add"); xp, yp, n as u64);
        self.record(r);
    }

    fn add_bias(&mut self, x: &mut CudaBuffer, bias: &CudaVector, m: usize, d: usize) {
        if m * d == 0 {
            return;
        }
        let xp = self.buf(x, m * d, "add_bias's x");
        let bp = self.vec_addr(bias, d, "the bias");
        let r =
            launch!(self, "pg_add_bias", cfg1(m * d, "add_bias"); xp, bp, (m * d) as u64, d as u32);
        self.record(r);
    }

    fn copy_columns(
        &mut self,
        src: &CudaBuffer,
        src_width: usize,
        src_col: usize,
        dst: &mut CudaBuffer,
        dst_width: usize,
        dst_col: usize,
        width: usize,
        m: usize,
    ) {
        if m * width == 0 {
            return;
        }
        assert!(
            src_col + width <= src_width && dst_col + width <= dst_width,
            "copy_columns: columns outside the rows"
        );
        let sp = self.buf(src, m * src_width, "copy_columns' source");
        let dp = self.buf(dst, m * dst_width, "copy_columns' destination");
        let r = launch!(self, "pg_copy_columns", cfg1(m * width, "copy_columns");
            sp, src_width as u32, src_col as u32, dp, dst_width as u32, dst_col as u32,
            width as u32, m as u32);
        self.record(r);
    }

    fn silu_mul(&mut self, gate_up: &CudaBuffer, m: usize, ffn: usize, out: &mut CudaBuffer) {
        if m * ffn == 0 {
            return;
        }
        let gp = self.buf(gate_up, m * 2 * ffn, "silu_mul's input");
        let op = self.buf(out, m * ffn, "silu_mul's output");
        let r =
            launch!(self, "pg_silu_mul", cfg1(m * ffn, "silu_mul"); gp, m as u32, ffn as u32, op);
        self.record(r);
    }

    fn rope(&mut self, table: &CudaRope, x: &mut CudaBuffer, n_heads: usize, step: &CudaStep) {
        let n = step.n_tokens;
        if n == 0 || n_heads == 0 {
            return;
        }
        if let Some(p) = step.max_position {
            assert!(
                (p as usize) < table.max_positions,
                "rope: position {p} beyond the table's {}",
                table.max_positions
            );
        }
        let d = table.head_dim;
        let xp = self.buf(x, n * n_heads * d, "rope's input");
        let pos = self.step_arr(&step.positions, n);
        let neox = i32::from(table.style == RopeStyle::Neox);
        let r = launch!(self, "pg_rope", cfg1(n * n_heads * d / 2, "rope");
            xp, addr(&table.cos, &self.stream), addr(&table.sin, &self.stream), pos,
            n as u32, n_heads as u32, d as u32, neox);
        self.record(r);
    }

    fn write_kv(
        &mut self,
        kv: &mut CudaKv,
        layer: usize,
        k: &CudaBuffer,
        v: &CudaBuffer,
        step: &CudaStep,
    ) {
        let n = step.n_tokens;
        if n == 0 {
            return;
        }
        let l = kv.layouts[layer];
        let n_slots = l.num_blocks * l.block_size;
        if let Some(s) = step.max_slot {
            assert!(
                (s as usize) < n_slots,
                "write_kv: slot {s} outside the pool of {n_slots}"
            );
        }
        let row = l.n_kv_heads * l.head_dim;
        let kp = self.buf(k, n * row, "write_kv's k");
        let vp = self.buf(v, n * row, "write_kv's v");
        let slots = self.step_arr(&step.slots, n);
        let (kc, vc) = &kv.layers[layer];
        let name = match kv.dtype {
            KvDtype::F32 => "pg_write_kv_f32",
            KvDtype::F16 => "pg_write_kv_f16",
            KvDtype::Bf16 => "pg_write_kv_bf16",
        };
        let r = launch!(self, name, cfg1(n * row, "write_kv");
            kp, vp, slots, n as u32, l.n_kv_heads as u32, l.head_dim as u32,
            l.block_size as u32, n_slots as u64, addr(kc, &self.stream), addr(vc, &self.stream));
        self.record(r);
    }

    fn attention(
        &mut self,
        kv: &CudaKv,
        layer: usize,
        q: &CudaBuffer,
        n_heads: usize,
        scale: f32,
        window: Option<usize>,
        sinks: Option<&CudaVector>,
        step: &CudaStep,
        out: &mut CudaBuffer,
    ) {
        // `supports_sliding_window` and `supports_attention_sinks` are
        // false: models with windows that matter, or with sinks, are
        // refused at load.
        debug_assert!(window.is_none(), "no sliding-window kernel on CUDA");
        assert!(sinks.is_none(), "no attention-sink kernel on CUDA");
        let _ = window;
        if step.n_tokens == 0 {
            return;
        }
        let l = kv.layouts[layer];
        if let Some(b) = step.max_block {
            assert!(
                (b as usize) < l.num_blocks,
                "attention: block {b} outside the pool of {}",
                l.num_blocks
            );
        }
        let n = step.n_tokens * n_heads * l.head_dim;
        let qp = self.buf(q, n, "attention's q");
        let op = self.buf(out, n, "attention's output");
        let plan = plan::plan_attention(
            n_heads,
            l.n_kv_heads,
            l.head_dim,
            step.max_decode_ctx,
            step.n_seqs,
            self.sms,
        );
        let r = self.attention_launch(kv, layer, qp, n_heads, scale, step, op, &plan);
        self.record(r);
    }

    fn sample(
        &mut self,
        logits: &mut CudaBuffer,
        vocab: usize,
        meta: &SamplingMetadata,
        out: &mut SampledRows,
    ) -> Result<(), BackendError> {
        self.take_pending()?;
        crate::ops::sample::check_rows(meta, vocab, logits.len());
        out.shape_for(meta);
        let n = meta.num_rows();
        if n == 0 {
            return Ok(());
        }
        let last = meta.rows()[n - 1].logit_row as usize;
        let lp = self.buf(logits, (last + 1) * vocab, "the logits");
        let mut sb = std::mem::take(&mut self.sampling);
        let r = self.sample_launch(&mut sb, lp, vocab, meta, out);
        self.sampling = sb;
        r
    }

    fn supports_lora(&self) -> bool {
        true
    }

    fn lora_add(
        &mut self,
        x: &CudaBuffer,
        in_dim: usize,
        slots: &[Option<super::DeviceLora<CudaMatrix>>],
        step: &CudaStep,
        out: &mut CudaBuffer,
        out_stride: usize,
        col: usize,
        out_dim: usize,
    ) -> Result<(), BackendError> {
        if step.n_lora == 0 {
            return Ok(());
        }
        let n = step.n_tokens;
        assert_eq!(step.n_lora, n, "lora_add: a LoRA slot per token");
        assert!(
            col + out_dim <= out_stride,
            "lora_add: columns outside the rows"
        );
        let mut max_rank = 0;
        for f in slots.iter().flatten() {
            let ty = f.a.ty;
            let dense = matches!(ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16);
            if !dense
                || f.b.ty != ty
                || (f.a.rows, f.a.cols) != (f.rank, in_dim)
                || (f.b.rows, f.b.cols) != (f.rank, out_dim)
            {
                return Err(self.err(
                    "lora_add",
                    format!(
                        "factors must be dense F32, F16 or BF16, A rank x {in_dim} and Bt rank x {out_dim}; got {} [{} x {}] and {} [{} x {}] for rank {}",
                        f.a.ty, f.a.rows, f.a.cols, f.b.ty, f.b.rows, f.b.cols, f.rank
                    ),
                ));
            }
            max_rank = max_rank.max(f.rank);
        }
        if max_rank == 0 {
            return Ok(());
        }
        let xp = self.buf(x, n * in_dim, "lora_add's x");
        let op = self.buf(out, n * out_stride, "lora_add's out");
        let tp = self.step_arr(&step.lora_slots, n);
        let mut h_slot = self.scratch.lora_h.take();
        let hp = self.scratch(&mut h_slot, n * max_rank, "LoRA's h");
        self.scratch.lora_h = h_slot;
        let hp = hp?;
        for (s, f) in slots.iter().enumerate() {
            let Some(f) = f else { continue };
            let code = weights::kind_code(f.a.ty).unwrap_or(0);
            let ap = addr(&f.a.data, &self.stream);
            let bp = addr(&f.b.data, &self.stream);
            let shrink = LaunchConfig {
                grid_dim: (n as u32, 1, 1),
                block_dim: (plan::LORA_SHRINK_THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            launch!(self, "pg_lora_shrink", shrink;
                code, ap, xp, in_dim as u32, f.rank as u32, f.scale, tp, s as u32, hp,
                max_rank as u32)?;
            launch!(self, "pg_lora_expand", cfg1(n * out_dim, "lora_expand");
                code, bp, hp, max_rank as u32, f.rank as u32, tp, s as u32, n as u32, op,
                out_stride as u32, col as u32, out_dim as u32)?;
        }
        Ok(())
    }

    fn gather_logit_rows(
        &mut self,
        x: &CudaBuffer,
        d: usize,
        step: &CudaStep,
        out: &mut CudaBuffer,
    ) {
        let n = step.n_logit_rows;
        if n * d == 0 {
            return;
        }
        if let Some(r) = step.max_logit_row {
            assert!(
                (r as usize) < step.n_tokens,
                "gather_logit_rows: row {r} outside the step's {} tokens",
                step.n_tokens
            );
        }
        let xp = self.buf(x, step.n_tokens * d, "gather's input");
        let op = self.buf(out, n * d, "gather's output");
        let rows = self.step_arr(&step.logit_rows, n);
        let r = launch!(self, "pg_gather_rows", cfg1(n * d, "gather_logit_rows");
            xp, d as u32, rows, n as u32, op);
        self.record(r);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On a machine without the NVIDIA driver (CI, this crate's dev boxes)
    /// opening a GPU is a one-line error, not cudarc's panic.
    #[test]
    fn new_without_a_driver_is_an_error() {
        if driver_available() {
            eprintln!("libcuda is present: skipping the no-driver check");
            return;
        }
        let e = match CudaBackend::new(0) {
            Ok(_) => panic!("opened a GPU without a driver"),
            Err(e) => e.to_string(),
        };
        assert!(e.contains("libcuda.so.1 could not be loaded"), "{e}");
        assert!(e.contains("--device cpu"), "{e}");
        assert!(!e.contains('\n'), "{e}");
        let e = crate::Device::Cuda.open(1).err().map(|e| e.to_string());
        assert!(e.as_deref().is_some_and(|e| e.contains("libcuda")), "{e:?}");
    }
}
