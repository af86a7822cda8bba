//! The CPU backend: [`Backend`] over host memory, running the kernels of
//! [`crate::ops`] and [`crate::quant`] on the context's thread pool.
//!
//! CPU-only choices live here and nowhere else: the layout quantized
//! weights get ([`crate::cpu::weight_level`]: int8 VNNI/AMX-INT8 kernels, or
//! bf16 tiles for engines that batch), and the prompt kernel that flagged
//! rows may take ([`crate::Weight::matmul_rows`]).

use super::{Backend, BackendError, DeviceMatrix, HostMatrix, KvSpec, Rows, StepBatch};
use crate::cpu::{simd_level, SimdLevel};
use crate::ops::sample::{SampleScratch, SampledRows, SamplingMetadata};
use crate::ops::{self, AttnSeq, KvDtype, KvElem, KvLayout, RopeTable};
use crate::quant::{GgmlType, MatmulScratch, Weight};
use crate::CpuContext;
use half::{bf16, f16};

/// The CPU as a [`Backend`].
pub struct CpuBackend {
    ctx: CpuContext,
    /// The LoRA kernel's visiting order (reused).
    lora_scratch: crate::ops::lora::LoraScratch,
    /// [`Backend::matmul_lora`]'s adapted tokens and their deltas, computed
    /// beside the matmul (reused).
    lora_order: Vec<u32>,
    lora_delta: Vec<f32>,
    /// What quantized weights are laid out for.
    level: SimdLevel,
    scratch: MatmulScratch,
    /// Kept empty between calls; only its capacity is reused (see
    /// [`CpuBackend::attention`]).
    attn_seqs: Vec<AttnSeq<'static>>,
    /// The step's sequences with their state slots, for the recurrent
    /// layers' ops (reused).
    recurrent_seqs: Vec<ops::RecurrentSeq>,
    /// One head's rows in and out of [`Backend::matmul_heads`].
    head_in: Vec<f32>,
    head_out: Vec<f32>,
    /// Each thread's sampling buffers ([`Backend::sample`]).
    sample_scratch: SampleScratch,
}

impl CpuBackend {
    /// A backend on `ctx` that lays quantized weights out for the kernels
    /// of `level` ([`crate::cpu::weight_level`] picks it per engine).
    pub fn new(ctx: CpuContext, level: SimdLevel) -> CpuBackend {
        CpuBackend {
            ctx,
            level,
            scratch: MatmulScratch::default(),
            attn_seqs: Vec::new(),
            recurrent_seqs: Vec::new(),
            head_in: Vec::new(),
            head_out: Vec::new(),
            sample_scratch: SampleScratch::default(),
            lora_scratch: Default::default(),
            lora_order: Vec::new(),
            lora_delta: Vec::new(),
        }
    }

    /// The context the kernels run on.
    pub fn context(&self) -> &CpuContext {
        &self.ctx
    }

    /// The level quantized weights are laid out for.
    pub fn weight_level(&self) -> SimdLevel {
        self.level
    }

    fn encoder_error(&self, detail: String) -> BackendError {
        BackendError::Device {
            device: self.describe(),
            what: "an encoder operation".into(),
            detail,
        }
    }

    /// The step's sequences as an encoder reads them: each must hold its
    /// whole prompt (start at position 0), since its rows attend both ways.
    fn encoder_seqs(&self, step: &CpuStep) -> Result<Vec<ops::EncoderSeq>, BackendError> {
        step.batch
            .seqs
            .iter()
            .map(|s| {
                if s.ctx_len != s.q_len {
                    return Err(self.encoder_error(format!(
                        "a sequence runs {} of its {} positions in this step; an encoder needs its whole prompt in one step",
                        s.q_len, s.ctx_len
                    )));
                }
                Ok(ops::EncoderSeq {
                    start: s.q_start as usize,
                    len: s.q_len as usize,
                })
            })
            .collect()
    }
}

impl DeviceMatrix for Weight {
    fn ty(&self) -> GgmlType {
        Weight::ty(self)
    }
    fn rows(&self) -> usize {
        Weight::rows(self)
    }
    fn cols(&self) -> usize {
        Weight::cols(self)
    }
    fn size_bytes(&self) -> usize {
        Weight::size_bytes(self)
    }
}

/// One layer's K and V in host memory, of `layout` each; for a latent
/// (MLA) layer, `k` holds `[slots, layout.head_dim]` latent rows and `v`
/// is empty.
pub struct LayerKv<T> {
    pub k: Vec<T>,
    pub v: Vec<T>,
    pub layout: KvLayout,
    pub latent: bool,
}

/// The KV pool of every layer, in one of the supported element types.
pub enum CpuKv {
    F32(Vec<LayerKv<f32>>),
    F16(Vec<LayerKv<f16>>),
    Bf16(Vec<LayerKv<bf16>>),
}

fn layers<T: KvElem + bytemuck::Zeroable>(layouts: &[(KvLayout, bool)]) -> Vec<LayerKv<T>> {
    // Zeroed allocations come from calloc, so the OS commits pages only as
    // blocks are first written: a large pool costs address space, not RSS.
    layouts
        .iter()
        .map(|&(l, latent)| LayerKv {
            k: bytemuck::zeroed_vec(l.elems()),
            v: if latent {
                Vec::new()
            } else {
                bytemuck::zeroed_vec(l.elems())
            },
            layout: l,
            latent,
        })
        .collect()
}

impl CpuKv {
    /// Allocates the pool `spec` describes. The paged-attention kernel
    /// reads K and V heads of one width, so a layer whose widths differ is
    /// refused.
    pub fn new(spec: &KvSpec) -> Result<CpuKv, BackendError> {
        let layouts = (0..spec.layers.len())
            .map(|i| {
                let l = spec.layers[i];
                if l.is_latent() {
                    return Ok((
                        KvLayout {
                            num_blocks: spec.num_blocks,
                            block_size: spec.block_size,
                            n_kv_heads: 1,
                            head_dim: l.k_head_dim,
                        },
                        true,
                    ));
                }
                spec.symmetric_layout(i).map(|l| (l, false)).ok_or_else(|| BackendError::UnsupportedKv {
                    device: "cpu".into(),
                    detail: format!(
                        "layer {i} keeps K heads of {} and V heads of {} elements; the CPU attention kernel needs them equal",
                        spec.layers[i].k_head_dim, spec.layers[i].v_head_dim
                    ),
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(match spec.dtype {
            KvDtype::F32 => CpuKv::F32(layers(&layouts)),
            KvDtype::F16 => CpuKv::F16(layers(&layouts)),
            KvDtype::Bf16 => CpuKv::Bf16(layers(&layouts)),
        })
    }

    /// The shape of layer `i`'s K (or V).
    pub fn layout(&self, i: usize) -> &KvLayout {
        match self {
            CpuKv::F32(l) => &l[i].layout,
            CpuKv::F16(l) => &l[i].layout,
            CpuKv::Bf16(l) => &l[i].layout,
        }
    }
}

/// A step's metadata on the CPU: the batch itself, plus the prompt flags of
/// its logit rows.
#[derive(Default)]
pub struct CpuStep {
    batch: StepBatch,
    logit_prompt: Vec<bool>,
}

/// The first `n` elements of `v`.
fn first(v: &[f32], n: usize) -> &[f32] {
    &v[..n]
}

fn first_mut(v: &mut [f32], n: usize) -> &mut [f32] {
    &mut v[..n]
}

impl CpuBackend {
    /// Runs `f` on the step's sequences as the attention kernels take them,
    /// in a buffer reused across layers and steps, so a warm step
    /// allocates nothing.
    fn with_attn_seqs<R>(
        &mut self,
        step: &CpuStep,
        f: impl FnOnce(&crate::ThreadPool, &[AttnSeq<'_>]) -> R,
    ) -> R {
        let seqs = std::mem::take(&mut self.attn_seqs);
        // SAFETY: `seqs` is empty (it is cleared before being stored back),
        // so changing the lifetime parameter of its element type
        // reinterprets no element; this only lets a step reuse the buffer's
        // capacity instead of allocating one per layer.
        let mut seqs: Vec<AttnSeq<'_>> =
            unsafe { std::mem::transmute::<Vec<AttnSeq<'static>>, Vec<AttnSeq<'_>>>(seqs) };
        seqs.extend(step.batch.seqs.iter().map(|s| AttnSeq {
            q_start: s.q_start as usize,
            q_len: s.q_len as usize,
            ctx_len: s.ctx_len as usize,
            block_table: step.batch.block_table(s),
        }));
        let r = f(self.ctx.pool(), &seqs);
        seqs.clear();
        // SAFETY: empty again; see above.
        self.attn_seqs =
            unsafe { std::mem::transmute::<Vec<AttnSeq<'_>>, Vec<AttnSeq<'static>>>(seqs) };
        r
    }

    #[allow(clippy::too_many_arguments)]
    fn attention_typed<T: KvElem>(
        &mut self,
        layers: &[LayerKv<T>],
        layout: &KvLayout,
        layer: usize,
        q: &[f32],
        n_heads: usize,
        scale: f32,
        window: Option<usize>,
        sinks: Option<&[f32]>,
        step: &CpuStep,
        out: &mut [f32],
    ) {
        let cache = &layers[layer];
        self.with_attn_seqs(step, |pool, seqs| {
            ops::paged_attention_with_sinks(
                pool, layout, &cache.k, &cache.v, q, n_heads, seqs, scale, window, sinks, out,
            )
        });
    }
}

impl Backend for CpuBackend {
    type Matrix = Weight;
    type Vector = Vec<f32>;
    type Buffer = Vec<f32>;
    type Kv = CpuKv;
    type Rope = RopeTable;
    type Step = CpuStep;
    type Routes = ops::Routing;

    fn describe(&self) -> String {
        format!(
            "cpu: {} threads, {:?} kernels, quantized weights laid out for {:?}",
            self.ctx.pool().threads(),
            simd_level(),
            self.level
        )
    }

    fn upload_matrix(&self, m: &HostMatrix<'_>) -> Result<Weight, BackendError> {
        let w = if m.f32_activations() {
            Weight::from_mxfp4_f32_act(m.rows(), m.cols(), m.bytes())?
        } else {
            Weight::from_raw_at(self.level, m.ty(), m.rows(), m.cols(), m.bytes())?
        };
        Ok(w.with_affine(m.affine().cloned())?)
    }

    fn upload_vector(&self, v: &[f32]) -> Result<Vec<f32>, BackendError> {
        Ok(v.to_vec())
    }

    fn upload_rope(&self, table: &RopeTable) -> Result<RopeTable, BackendError> {
        Ok(table.clone())
    }

    fn alloc_kv(&self, spec: &KvSpec) -> Result<CpuKv, BackendError> {
        CpuKv::new(spec)
    }

    fn has_prompt_kernel(&self, m: &Weight) -> bool {
        m.has_wide_kernel()
    }

    fn supports_sliding_window(&self) -> bool {
        true
    }

    fn supports_attention_sinks(&self) -> bool {
        true
    }

    fn supports_experts(&self) -> bool {
        true
    }

    fn supports_latent_attention(&self) -> bool {
        true
    }

    fn supports_lora(&self) -> bool {
        true
    }

    fn supports_encoder(&self) -> bool {
        true
    }

    fn encoder_embed(
        &mut self,
        word: &Weight,
        position: &Weight,
        position_offset: usize,
        token_type: Option<&Weight>,
        step: &CpuStep,
        out: &mut Vec<f32>,
    ) -> Result<(), BackendError> {
        let d = word.cols();
        let batch = &step.batch;
        let n = batch.num_tokens();
        if position.cols() != d || token_type.is_some_and(|t| t.cols() != d) {
            return Err(self.encoder_error(format!(
                "encoder_embed: tables of {d}, {} and {:?} columns",
                position.cols(),
                token_type.map(|t| t.cols())
            )));
        }
        let mut tmp = vec![0.0f32; d];
        let out = &mut out[..n * d];
        for (t, row) in out.chunks_exact_mut(d).enumerate() {
            let (id, ty) = ops::encoder::unpack_token(batch.tokens[t]);
            let pos = batch.positions[t] as usize + position_offset;
            if id as usize >= word.rows() {
                return Err(self.encoder_error(format!(
                    "token id {id} lies past the {} rows of the word embeddings",
                    word.rows()
                )));
            }
            if pos >= position.rows() {
                return Err(self.encoder_error(format!(
                    "position {pos} lies past the {} rows of the position embeddings",
                    position.rows()
                )));
            }
            word.dequantize_row(id as usize, row);
            position.dequantize_row(pos, &mut tmp);
            ops::add_inplace(row, &tmp);
            match token_type {
                Some(tt) if (ty as usize) < tt.rows() => {
                    tt.dequantize_row(ty as usize, &mut tmp);
                    ops::add_inplace(row, &tmp);
                }
                Some(tt) => {
                    return Err(self.encoder_error(format!(
                        "token type {ty} lies past the {} rows of the token type embeddings",
                        tt.rows()
                    )))
                }
                None if ty != 0 => {
                    return Err(self.encoder_error(format!(
                        "token type {ty}, but the model has no token type embeddings"
                    )))
                }
                None => {}
            }
        }
        Ok(())
    }

    fn layer_norm(
        &mut self,
        x: &Vec<f32>,
        weight: &Vec<f32>,
        bias: &Vec<f32>,
        eps: f32,
        m: usize,
        d: usize,
        out: &mut Vec<f32>,
    ) -> Result<(), BackendError> {
        ops::for_row_ranges(
            self.ctx.pool(),
            first(x, m * d),
            d,
            first_mut(out, m * d),
            d,
            &|xr, or| ops::encoder::layer_norm(xr, weight, bias, eps, or),
        );
        Ok(())
    }

    fn activation(
        &mut self,
        x: &mut Vec<f32>,
        n: usize,
        act: ops::encoder::Activation,
    ) -> Result<(), BackendError> {
        let x = first_mut(x, n);
        let pool = self.ctx.pool();
        // Element-wise: any split gives the bits of one call. A prefill
        // step's GELU (tokens × intermediate) is worth spreading.
        if n < 1 << 14 || pool.threads() == 1 {
            ops::encoder::activation_inplace(x, act);
            return Ok(());
        }
        struct Ptr(*mut f32);
        // SAFETY: each range below touches only its own elements.
        unsafe impl Sync for Ptr {}
        let p = Ptr(x.as_mut_ptr());
        pool.run_ranges(n, 1024, &|a, b| {
            let p = &p;
            // SAFETY: a..b lies in x and is disjoint from every other range.
            let part = unsafe { std::slice::from_raw_parts_mut(p.0.add(a), b - a) };
            ops::encoder::activation_inplace(part, act);
        });
        Ok(())
    }

    fn bidirectional_attention(
        &mut self,
        q: &Vec<f32>,
        k: &Vec<f32>,
        v: &Vec<f32>,
        n_heads: usize,
        n_kv_heads: usize,
        head_dim: usize,
        scale: f32,
        window: Option<usize>,
        step: &CpuStep,
        out: &mut Vec<f32>,
    ) -> Result<(), BackendError> {
        let seqs = self.encoder_seqs(step)?;
        ops::encoder::bidirectional_attention(
            self.ctx.pool(),
            q,
            k,
            v,
            n_heads,
            n_kv_heads,
            head_dim,
            &seqs,
            scale,
            window,
            out,
        );
        Ok(())
    }

    fn act_mul(
        &mut self,
        x: &Vec<f32>,
        m: usize,
        ffn: usize,
        act: ops::encoder::Activation,
        out: &mut Vec<f32>,
    ) -> Result<(), BackendError> {
        ops::for_row_ranges(
            self.ctx.pool(),
            first(x, m * 2 * ffn),
            2 * ffn,
            first_mut(out, m * ffn),
            ffn,
            &|xr, or| ops::encoder::act_mul(xr, ffn, act, or),
        );
        Ok(())
    }

    fn pool_seqs(
        &mut self,
        x: &Vec<f32>,
        d: usize,
        how: ops::encoder::SeqPooling,
        step: &CpuStep,
        out: &mut Vec<f32>,
    ) -> Result<(), BackendError> {
        let seqs = self.encoder_seqs(step)?;
        let batch = &step.batch;
        for (i, &r) in batch.logit_rows.iter().enumerate() {
            let r = r as usize;
            let seq = seqs
                .iter()
                .find(|s| s.start <= r && r < s.start + s.len)
                .ok_or_else(|| {
                    self.encoder_error(format!("logit row {r} belongs to no sequence"))
                })?;
            ops::encoder::pool_rows(x, d, *seq, how, &mut out[i * d..(i + 1) * d]);
        }
        Ok(())
    }

    fn lora_add(
        &mut self,
        x: &Vec<f32>,
        in_dim: usize,
        slots: &[Option<super::DeviceLora<Weight>>],
        step: &CpuStep,
        out: &mut Vec<f32>,
        out_stride: usize,
        col: usize,
        out_dim: usize,
    ) -> Result<(), BackendError> {
        let token_slots = &step.batch.lora_slots;
        if token_slots.is_empty() {
            return Ok(());
        }
        // The kernel reads dense factors in place; anything else is the
        // loader's mistake, said here rather than skipped per token.
        for f in slots.iter().flatten() {
            lora_data(&f.a)?;
            lora_data(&f.b)?;
        }
        let factors = |s: u16| slot_factors(slots, s);
        let n = step.batch.tokens.len();
        crate::ops::lora::lora_add(
            &x[..n * in_dim],
            in_dim,
            token_slots,
            factors,
            &mut out[..n * out_stride],
            out_stride,
            col,
            out_dim,
            &mut self.lora_scratch,
            Some(self.ctx.pool()),
        );
        Ok(())
    }

    fn matmul_lora(
        &mut self,
        w: &Weight,
        x: &Vec<f32>,
        m: usize,
        out: &mut Vec<f32>,
        bias: Option<&Vec<f32>>,
        slices: &[super::LoraSlice<'_, Weight>],
        step: &CpuStep,
    ) -> Result<(), BackendError> {
        use crate::ops::lora::{lora_token_delta, LoraFactors, MAX_LORA_RANK};
        let (in_dim, width) = (w.cols(), w.rows());
        let bad = |detail: String| BackendError::Device {
            device: "cpu".into(),
            what: "matmul_lora".into(),
            detail,
        };
        // What `lora_token_delta` asserts, said as an error up front.
        for s in slices {
            if s.col + s.out_dim > width {
                return Err(bad(format!(
                    "LoRA columns {}..{} outside the projection's {width}",
                    s.col,
                    s.col + s.out_dim
                )));
            }
            for f in s.slots.iter().flatten() {
                let (a, b) = (lora_data(&f.a)?, lora_data(&f.b)?);
                if f.rank > MAX_LORA_RANK
                    || a.len() != f.rank * in_dim
                    || b.len() != f.rank * s.out_dim
                {
                    return Err(bad(format!(
                        "LoRA factors of rank {} are {} and {} values, not rank × {in_dim} and rank × {}",
                        f.rank,
                        a.len(),
                        b.len(),
                        s.out_dim
                    )));
                }
            }
        }
        fn factors<'a>(s: &super::LoraSlice<'a, Weight>, slot: u16) -> Option<LoraFactors<'a>> {
            slot_factors(s.slots, slot)
        }
        let token_slots = &step.batch.lora_slots;
        let order = &mut self.lora_order;
        order.clear();
        for t in 0..m.min(token_slots.len()) {
            if slices.iter().any(|s| factors(s, token_slots[t]).is_some()) {
                order.push(t as u32);
            }
        }
        let order = &self.lora_order[..];
        let delta = &mut self.lora_delta;
        if delta.len() < order.len() * width {
            delta.resize(order.len() * width, 0.0);
        }
        let d = SharedRows(delta.as_mut_ptr());
        let x = first(x, m * in_dim);
        // Token `order[i]`'s deltas, into row `i` of `delta`.
        let side = |i: usize| {
            let d = &d;
            let t = order[i] as usize;
            let xt = &x[t * in_dim..(t + 1) * in_dim];
            for s in slices {
                if let Some(f) = factors(s, token_slots[t]) {
                    // SAFETY: row `i` of `delta` (grown above) is this
                    // task's alone, and the slice's columns lie within it.
                    let dst = unsafe {
                        std::slice::from_raw_parts_mut(d.0.add(i * width + s.col), s.out_dim)
                    };
                    lora_token_delta(&f, xt, dst);
                }
            }
        };
        let pool = self.ctx.pool();
        let scratch = &mut self.scratch;
        let prompt = &step.batch.prompt_rows[..m];
        let out = first_mut(out, m * width);
        pool.run_with_side(order.len(), &side, || {
            w.matmul_rows(pool, x, m, out, scratch, prompt)
        });
        if let Some(bias) = bias {
            for row in out.chunks_exact_mut(width) {
                ops::add_inplace(row, bias);
            }
        }
        for (i, &t) in order.iter().enumerate() {
            let t = t as usize;
            for s in slices {
                if factors(s, token_slots[t]).is_some() {
                    let (o, c) = (t * width + s.col, i * width + s.col);
                    ops::add_inplace(
                        &mut out[o..o + s.out_dim],
                        &self.lora_delta[c..c + s.out_dim],
                    );
                }
            }
        }
        Ok(())
    }

    fn reserve(&mut self, buf: &mut Vec<f32>, len: usize) -> Result<(), BackendError> {
        // Growth happens only on the first steps of a new shape; steady
        // state reuses.
        if buf.len() < len {
            buf.resize(len, 0.0);
        }
        Ok(())
    }

    fn upload_step(&mut self, batch: &StepBatch, step: &mut CpuStep) -> Result<(), BackendError> {
        step.batch.copy_from(batch);
        step.logit_prompt.clear();
        step.logit_prompt.extend(
            batch
                .logit_rows
                .iter()
                .map(|&r| batch.prompt_rows[r as usize]),
        );
        Ok(())
    }

    fn to_host<'a>(
        &'a mut self,
        buf: &'a mut Vec<f32>,
        len: usize,
    ) -> Result<&'a mut [f32], BackendError> {
        Ok(&mut buf[..len])
    }

    fn embed(&mut self, table: &Weight, step: &CpuStep, out: &mut Vec<f32>) {
        let d = table.cols();
        for (row, &t) in out.chunks_exact_mut(d).zip(&step.batch.tokens) {
            table.dequantize_row(t as usize, row);
        }
    }

    fn matmul(
        &mut self,
        w: &Weight,
        x: &Vec<f32>,
        m: usize,
        out: &mut Vec<f32>,
        step: &CpuStep,
        rows: Rows,
    ) {
        let prompt = match rows {
            Rows::Tokens => &step.batch.prompt_rows[..m],
            Rows::Logits => &step.logit_prompt[..m],
        };
        w.matmul_rows(
            self.ctx.pool(),
            first(x, m * w.cols()),
            m,
            first_mut(out, m * w.rows()),
            &mut self.scratch,
            prompt,
        );
    }

    fn matmul_encoder(
        &mut self,
        w: &Weight,
        x: &Vec<f32>,
        m: usize,
        out: &mut Vec<f32>,
        _step: &CpuStep,
    ) {
        w.matmul_gemm(
            self.ctx.pool(),
            first(x, m * w.cols()),
            m,
            first_mut(out, m * w.rows()),
            &mut self.scratch,
        );
    }

    fn rms_norm(
        &mut self,
        x: &Vec<f32>,
        weight: &Vec<f32>,
        eps: f32,
        m: usize,
        d: usize,
        out: &mut Vec<f32>,
    ) {
        ops::for_row_ranges(
            self.ctx.pool(),
            first(x, m * d),
            d,
            first_mut(out, m * d),
            d,
            &|xr, hr| ops::rms_norm(xr, weight, eps, hr),
        );
    }

    fn add(&mut self, x: &mut Vec<f32>, y: &Vec<f32>, n: usize) {
        ops::add_inplace(first_mut(x, n), first(y, n));
    }

    fn add_bias(&mut self, x: &mut Vec<f32>, bias: &Vec<f32>, m: usize, d: usize) {
        for row in first_mut(x, m * d).chunks_exact_mut(d) {
            ops::add_inplace(row, bias);
        }
    }

    fn copy_columns(
        &mut self,
        src: &Vec<f32>,
        src_width: usize,
        src_col: usize,
        dst: &mut Vec<f32>,
        dst_width: usize,
        dst_col: usize,
        width: usize,
        m: usize,
    ) {
        for r in 0..m {
            let s = r * src_width + src_col;
            let d = r * dst_width + dst_col;
            dst[d..d + width].copy_from_slice(&src[s..s + width]);
        }
    }

    fn silu_mul(&mut self, gate_up: &Vec<f32>, m: usize, ffn: usize, out: &mut Vec<f32>) {
        ops::for_row_ranges(
            self.ctx.pool(),
            first(gate_up, m * 2 * ffn),
            2 * ffn,
            first_mut(out, m * ffn),
            ffn,
            &|g, a| ops::silu_mul(g, ffn, a),
        );
    }

    fn supports_gemma_ops(&self) -> bool {
        true
    }

    fn gelu_tanh_mul(
        &mut self,
        gate_up: &Vec<f32>,
        m: usize,
        ffn: usize,
        out: &mut Vec<f32>,
    ) -> Result<(), BackendError> {
        ops::for_row_ranges(
            self.ctx.pool(),
            first(gate_up, m * 2 * ffn),
            2 * ffn,
            first_mut(out, m * ffn),
            ffn,
            &|g, a| ops::gelu_tanh_mul(g, ffn, a),
        );
        Ok(())
    }

    fn scale(&mut self, x: &mut Vec<f32>, n: usize, s: f32) -> Result<(), BackendError> {
        ops::scale_inplace(first_mut(x, n), s);
        Ok(())
    }

    fn softcap(&mut self, x: &mut Vec<f32>, n: usize, cap: f32) -> Result<(), BackendError> {
        ops::softcap_inplace(first_mut(x, n), cap);
        Ok(())
    }

    fn rope(&mut self, table: &RopeTable, x: &mut Vec<f32>, n_heads: usize, step: &CpuStep) {
        let n = step.batch.num_tokens() * n_heads * table.head_dim();
        ops::rope_inplace(table, first_mut(x, n), n_heads, &step.batch.positions);
    }

    fn write_kv(
        &mut self,
        kv: &mut CpuKv,
        layer: usize,
        k: &Vec<f32>,
        v: &Vec<f32>,
        step: &CpuStep,
    ) {
        let slots = &step.batch.slot_mapping;
        match kv {
            CpuKv::F32(l) => write_layer(&mut l[layer], k, v, slots),
            CpuKv::F16(l) => write_layer(&mut l[layer], k, v, slots),
            CpuKv::Bf16(l) => write_layer(&mut l[layer], k, v, slots),
        }
    }

    fn attention(
        &mut self,
        kv: &CpuKv,
        layer: usize,
        q: &Vec<f32>,
        n_heads: usize,
        scale: f32,
        window: Option<usize>,
        sinks: Option<&Vec<f32>>,
        step: &CpuStep,
        out: &mut Vec<f32>,
    ) {
        let sinks = sinks.map(|s| s.as_slice());
        let layout = *kv.layout(layer);
        let n = step.batch.num_tokens() * n_heads * layout.head_dim;
        let (q, out) = (first(q, n), first_mut(out, n));
        match kv {
            CpuKv::F32(l) => self.attention_typed(
                l, &layout, layer, q, n_heads, scale, window, sinks, step, out,
            ),
            CpuKv::F16(l) => self.attention_typed(
                l, &layout, layer, q, n_heads, scale, window, sinks, step, out,
            ),
            CpuKv::Bf16(l) => self.attention_typed(
                l, &layout, layer, q, n_heads, scale, window, sinks, step, out,
            ),
        }
    }

    fn write_latent(&mut self, kv: &mut CpuKv, layer: usize, latent: &Vec<f32>, step: &CpuStep) {
        let slots = &step.batch.slot_mapping;
        fn write<T: KvElem>(l: &mut LayerKv<T>, latent: &[f32], slots: &[u32]) {
            assert!(l.latent, "write_latent: layer is not a latent layer");
            let w = l.layout.head_dim;
            ops::mla::write_latent(&mut l.k, w, &latent[..slots.len() * w], slots);
        }
        match kv {
            CpuKv::F32(l) => write(&mut l[layer], latent, slots),
            CpuKv::F16(l) => write(&mut l[layer], latent, slots),
            CpuKv::Bf16(l) => write(&mut l[layer], latent, slots),
        }
    }

    fn latent_attention(
        &mut self,
        kv: &CpuKv,
        layer: usize,
        q: &Vec<f32>,
        n_heads: usize,
        v_width: usize,
        scale: f32,
        step: &CpuStep,
        out: &mut Vec<f32>,
    ) {
        #[allow(clippy::too_many_arguments)]
        fn run<T: KvElem>(
            pool: &crate::ThreadPool,
            l: &LayerKv<T>,
            q: &[f32],
            n_heads: usize,
            v_width: usize,
            seqs: &[AttnSeq<'_>],
            scale: f32,
            out: &mut [f32],
        ) {
            assert!(l.latent, "latent_attention: layer is not a latent layer");
            let lay = l.layout;
            ops::mla::latent_attention(
                pool,
                &l.k,
                lay.block_size,
                lay.head_dim,
                q,
                n_heads,
                v_width,
                seqs,
                scale,
                out,
            );
        }
        self.with_attn_seqs(step, |pool, seqs| match kv {
            CpuKv::F32(l) => run(pool, &l[layer], q, n_heads, v_width, seqs, scale, out),
            CpuKv::F16(l) => run(pool, &l[layer], q, n_heads, v_width, seqs, scale, out),
            CpuKv::Bf16(l) => run(pool, &l[layer], q, n_heads, v_width, seqs, scale, out),
        });
    }

    fn matmul_heads(
        &mut self,
        w: &[Weight],
        x: &Vec<f32>,
        m: usize,
        x_stride: usize,
        x_col: usize,
        out: &mut Vec<f32>,
        out_stride: usize,
        out_col: usize,
    ) {
        let heads = w.len();
        let (x_row, out_row) = (heads * x_stride, heads * out_stride);
        for (h, wh) in w.iter().enumerate() {
            let (k, n) = (wh.cols(), wh.rows());
            self.head_in.clear();
            for r in 0..m {
                let at = r * x_row + h * x_stride + x_col;
                self.head_in.extend_from_slice(&x[at..at + k]);
            }
            self.head_out.resize(m * n, 0.0);
            wh.matmul(
                self.ctx.pool(),
                &self.head_in,
                m,
                &mut self.head_out,
                &mut self.scratch,
            );
            for r in 0..m {
                let at = r * out_row + h * out_stride + out_col;
                out[at..at + n].copy_from_slice(&self.head_out[r * n..(r + 1) * n]);
            }
        }
    }

    fn route_experts(
        &mut self,
        logits: &Vec<f32>,
        m: usize,
        spec: &ops::RouterSpec,
        bias: Option<&Vec<f32>>,
        routes: &mut ops::Routing,
    ) {
        ops::moe::route(logits, m, spec, bias.map(|b| b.as_slice()), routes);
    }

    fn gather_routed(&mut self, x: &Vec<f32>, d: usize, routes: &ops::Routing, out: &mut Vec<f32>) {
        for (s, dst) in out[..routes.pairs() * d].chunks_exact_mut(d).enumerate() {
            let t = routes.token_of(s);
            dst.copy_from_slice(&x[t * d..(t + 1) * d]);
        }
    }

    fn grouped_matmul(
        &mut self,
        experts: &[Weight],
        x: &Vec<f32>,
        routes: &ops::Routing,
        out: &mut Vec<f32>,
    ) {
        assert_eq!(
            experts.len() + 1,
            routes.offsets.len(),
            "grouped_matmul: one matrix per expert"
        );
        for (e, w) in experts.iter().enumerate() {
            let (r0, r1) = (routes.offsets[e], routes.offsets[e + 1]);
            if r0 == r1 {
                continue;
            }
            let (k, n) = (w.cols(), w.rows());
            w.matmul(
                self.ctx.pool(),
                &x[r0 * k..r1 * k],
                r1 - r0,
                &mut out[r0 * n..r1 * n],
                &mut self.scratch,
            );
        }
    }

    fn scatter_routed(
        &mut self,
        y: &Vec<f32>,
        d: usize,
        routes: &ops::Routing,
        out: &mut Vec<f32>,
    ) {
        let k = routes.k;
        let m = routes.pairs() / k.max(1);
        for (t, dst) in out[..m * d].chunks_exact_mut(d).enumerate() {
            dst.fill(0.0);
            for j in 0..k {
                let p = t * k + j;
                let s = routes.slot[p] as usize;
                let w = routes.weights[p];
                for (o, &v) in dst.iter_mut().zip(&y[s * d..(s + 1) * d]) {
                    *o += w * v;
                }
            }
        }
    }

    fn add_routed_bias(
        &mut self,
        x: &mut Vec<f32>,
        bias: &Vec<f32>,
        d: usize,
        routes: &ops::Routing,
    ) {
        let e = routes.offsets.len().saturating_sub(1);
        assert_eq!(
            bias.len(),
            e * d,
            "add_routed_bias: one bias row per expert"
        );
        for (b, r) in bias.chunks_exact(d).zip(routes.offsets.windows(2)) {
            for row in x[r[0] * d..r[1] * d].chunks_exact_mut(d) {
                ops::add_inplace(row, b);
            }
        }
    }

    fn swiglu_clamped(
        &mut self,
        gate_up: &Vec<f32>,
        m: usize,
        ffn: usize,
        alpha: f32,
        limit: f32,
        out: &mut Vec<f32>,
    ) {
        ops::swiglu_clamped(
            first(gate_up, m * 2 * ffn),
            ffn,
            alpha,
            limit,
            first_mut(out, m * ffn),
        );
    }

    fn add_gated(&mut self, x: &mut Vec<f32>, y: &Vec<f32>, gate: &Vec<f32>, m: usize, d: usize) {
        for t in 0..m {
            let g = 1.0 / (1.0 + (-gate[t]).exp());
            for (o, &v) in x[t * d..(t + 1) * d].iter_mut().zip(&y[t * d..(t + 1) * d]) {
                *o += g * v;
            }
        }
    }

    fn gather_logit_rows(&mut self, x: &Vec<f32>, d: usize, step: &CpuStep, out: &mut Vec<f32>) {
        for (dst, &t) in out.chunks_exact_mut(d).zip(&step.batch.logit_rows) {
            let t = t as usize;
            dst.copy_from_slice(&x[t * d..(t + 1) * d]);
        }
    }

    fn sample(
        &mut self,
        logits: &mut Vec<f32>,
        vocab: usize,
        meta: &SamplingMetadata,
        out: &mut SampledRows,
    ) -> Result<(), BackendError> {
        // The logits are already in host memory: sample them in place.
        ops::sample_rows(
            self.ctx.pool(),
            logits,
            vocab,
            meta,
            &mut self.sample_scratch,
            out,
        );
        Ok(())
    }

    fn supports_linear_attention(&self) -> bool {
        true
    }

    fn causal_conv1d(
        &mut self,
        spec: ops::ConvSpec,
        x: &Vec<f32>,
        x_stride: usize,
        weight: &Vec<f32>,
        state: &mut Vec<f32>,
        slots: &[u32],
        step: &CpuStep,
        out: &mut Vec<f32>,
    ) -> Result<(), BackendError> {
        let seqs = recurrent_seqs(&mut self.recurrent_seqs, step, slots);
        ops::causal_conv1d_silu(self.ctx.pool(), spec, x, x_stride, weight, seqs, state, out);
        Ok(())
    }

    fn gated_delta_rule(
        &mut self,
        spec: ops::GatedDeltaSpec,
        qkv: &Vec<f32>,
        ba: &Vec<f32>,
        ba_stride: usize,
        ba_col: usize,
        a_log: &Vec<f32>,
        dt_bias: &Vec<f32>,
        state: &mut Vec<f32>,
        slots: &[u32],
        step: &CpuStep,
        out: &mut Vec<f32>,
    ) -> Result<(), BackendError> {
        let seqs = recurrent_seqs(&mut self.recurrent_seqs, step, slots);
        ops::gated_delta_rule(
            self.ctx.pool(),
            spec,
            qkv,
            ba,
            ba_stride,
            ba_col,
            a_log,
            dt_bias,
            seqs,
            state,
            out,
        );
        Ok(())
    }

    fn mul_sigmoid(
        &mut self,
        x: &mut Vec<f32>,
        gate: &Vec<f32>,
        gate_stride: usize,
        gate_col: usize,
        m: usize,
        width: usize,
    ) -> Result<(), BackendError> {
        ops::mul_sigmoid(x, gate, gate_stride, gate_col, m, width);
        Ok(())
    }

    fn rms_norm_gated(
        &mut self,
        x: &Vec<f32>,
        z: &Vec<f32>,
        z_stride: usize,
        z_col: usize,
        weight: &Vec<f32>,
        eps: f32,
        m: usize,
        width: usize,
        out: &mut Vec<f32>,
    ) -> Result<(), BackendError> {
        ops::rms_norm_gated(
            self.ctx.pool(),
            x,
            z,
            z_stride,
            z_col,
            weight,
            eps,
            m,
            width,
            out,
        );
        Ok(())
    }
}

/// Fills `seqs` with the step's sequences, sequence `i` in state slot
/// `slots[i]`, its first token's position from its context length.
///
/// # Panics
/// If `slots` does not name one slot per sequence of the step.
fn recurrent_seqs<'a>(
    seqs: &'a mut Vec<ops::RecurrentSeq>,
    step: &CpuStep,
    slots: &[u32],
) -> &'a [ops::RecurrentSeq] {
    assert_eq!(
        slots.len(),
        step.batch.seqs.len(),
        "recurrent ops: one state slot per sequence of the step"
    );
    seqs.clear();
    seqs.extend(
        step.batch
            .seqs
            .iter()
            .zip(slots)
            .map(|(s, &slot)| ops::RecurrentSeq {
                q_start: s.q_start as usize,
                q_len: s.q_len as usize,
                start_pos: (s.ctx_len - s.q_len) as usize,
                slot: slot as usize,
            }),
    );
    seqs
}

fn write_layer<T: KvElem>(cache: &mut LayerKv<T>, k: &[f32], v: &[f32], slots: &[u32]) {
    let layout = cache.layout;
    let n = slots.len() * layout.n_kv_heads * layout.head_dim;
    ops::write_kv(&layout, &mut cache.k, &mut cache.v, &k[..n], &v[..n], slots);
}

/// A LoRA factor's dense elements, as the kernel reads them.
/// Slot `s`'s factors in `slots`, as the kernels read them in place;
/// `None` for an empty slot (or factors [`lora_data`] refuses, which the
/// callers have already reported).
fn slot_factors(
    slots: &[Option<super::DeviceLora<Weight>>],
    s: u16,
) -> Option<crate::ops::lora::LoraFactors<'_>> {
    let f = slots.get(s as usize)?.as_ref()?;
    Some(crate::ops::lora::LoraFactors {
        a: lora_data(&f.a).ok()?,
        b: lora_data(&f.b).ok()?,
        rank: f.rank,
        scale: f.scale,
    })
}

fn lora_data(w: &Weight) -> Result<crate::ops::lora::LoraData<'_>, BackendError> {
    use crate::ops::lora::LoraData;
    let bytes = w.dense_bytes();
    let data = match (w.ty(), bytes) {
        (GgmlType::F32, Some(b)) => bytemuck::try_cast_slice(b).ok().map(LoraData::F32),
        (GgmlType::BF16, Some(b)) => bytemuck::try_cast_slice(b).ok().map(LoraData::Bf16),
        (GgmlType::F16, Some(b)) => bytemuck::try_cast_slice(b).ok().map(LoraData::F16),
        _ => None,
    };
    data.ok_or_else(|| BackendError::Device {
        device: "cpu".into(),
        what: "lora_add".into(),
        detail: format!(
            "LoRA factors must be dense F32, BF16 or F16 matrices, not {} [{} x {}]",
            w.ty(),
            w.rows(),
            w.cols()
        ),
    })
}

/// Rows that tasks of one region write disjointly.
struct SharedRows(*mut f32);
// SAFETY: every task writes only its own rows (see the users).
unsafe impl Sync for SharedRows {}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{DeviceLora, LoraSlice, StepBatch, NO_LORA};
    use rand::{Rng, SeedableRng};

    fn random(rng: &mut rand::rngs::StdRng, n: usize) -> Vec<f32> {
        (0..n).map(|_| rng.random_range(-1.0..1.0)).collect()
    }

    /// `matmul_lora` beside the matmul gives the bits of `matmul`,
    /// `add_bias` and one `lora_add` per slice, on one thread or two, for a
    /// batch mixing adapters, the base and a slot adapted on some slices.
    #[test]
    fn matmul_lora_has_the_bits_of_its_parts_one_after_another() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        let (in_dim, parts) = (64, [48usize, 26, 26]);
        let width: usize = parts.iter().sum();
        let m = 9;
        for threads in [1, 2] {
            let mut be = CpuBackend::new(CpuContext::new(threads), crate::cpu::simd_level());
            let w = be
                .upload_matrix(
                    &HostMatrix::from_f32_as(
                        GgmlType::Q8_0,
                        width,
                        in_dim,
                        &random(&mut rng, width * in_dim),
                    )
                    .expect("weight"),
                )
                .expect("upload");
            let bias = random(&mut rng, width);
            let mut lora = |ty: GgmlType, rank: usize, out: usize, scale: f32| {
                Some(DeviceLora {
                    a: be
                        .upload_matrix(
                            &HostMatrix::from_f32_as(
                                ty,
                                rank,
                                in_dim,
                                &random(&mut rng, rank * in_dim),
                            )
                            .expect("A"),
                        )
                        .expect("upload"),
                    b: be
                        .upload_matrix(
                            &HostMatrix::from_f32_as(ty, rank, out, &random(&mut rng, rank * out))
                                .expect("B"),
                        )
                        .expect("upload"),
                    rank,
                    scale,
                })
            };
            // Slot 0 adapts every part, slot 1 the first and last, slot 2
            // none of them.
            let per_part: Vec<Vec<Option<DeviceLora<Weight>>>> = parts
                .iter()
                .enumerate()
                .map(|(p, &out)| {
                    vec![
                        lora(GgmlType::F32, 4, out, 0.5),
                        if p == 1 {
                            None
                        } else {
                            lora(GgmlType::BF16, 8, out, 2.0)
                        },
                        None,
                    ]
                })
                .collect();
            let mut col = 0;
            let slices: Vec<LoraSlice<'_, Weight>> = parts
                .iter()
                .zip(&per_part)
                .map(|(&out_dim, slots)| {
                    let s = LoraSlice {
                        slots,
                        col,
                        out_dim,
                    };
                    col += out_dim;
                    s
                })
                .collect();
            let batch = StepBatch {
                tokens: vec![1; m],
                prompt_rows: vec![false; m],
                lora_slots: vec![0, NO_LORA, 1, 0, 1, NO_LORA, 0, 2, 1],
                ..Default::default()
            };
            let mut step = CpuStep::default();
            be.upload_step(&batch, &mut step).expect("step");
            let x = random(&mut rng, m * in_dim);

            let mut apart = vec![0f32; m * width];
            be.matmul(&w, &x, m, &mut apart, &step, Rows::Tokens);
            let mut base = apart.clone();
            be.add_bias(&mut base, &bias, m, width);
            be.add_bias(&mut apart, &bias, m, width);
            for s in &slices {
                be.lora_add(
                    &x, in_dim, s.slots, &step, &mut apart, width, s.col, s.out_dim,
                )
                .expect("lora_add");
            }
            let mut fused = vec![f32::NAN; m * width];
            be.matmul_lora(&w, &x, m, &mut fused, Some(&bias), &slices, &step)
                .expect("matmul_lora");
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&fused), bits(&apart), "{threads} threads");
            for t in 0..m {
                let row = t * width..(t + 1) * width;
                let adapted = matches!(batch.lora_slots[t], 0 | 1);
                assert_eq!(fused[row.clone()] != base[row], adapted, "token {t}");
            }
        }
    }
}
