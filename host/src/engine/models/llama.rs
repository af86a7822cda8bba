//! One decoder definition for the Llama family: Llama 2/3, Mistral, SmolLM2
//! and Qwen2 (which adds q/k/v biases). It is written against
//! `pagoda_accel`'s operations only, and runs one flattened batch per call:
//! prefill chunks and decodes of many sequences together, with attention
//! reading K/V from the paged cache.

use crate::engine::config::ModelConfig;
use crate::engine::kv_cache::storage::{KvCache, LayerKv};
use crate::engine::loader::WeightSource;
use anyhow::{bail, Context, Result};
use pagoda_accel::ops::{self, AttnSeq, KvElem, KvLayout, RopeTable};
use pagoda_accel::{CpuContext, MatmulScratch, Weight};

/// A projection whose output is several logical matrices side by side
/// (q|k|v or gate|up). Fused into one matrix when the parts share a storage
/// type, so the pool runs one parallel region instead of several.
enum Projection {
    Fused(Weight),
    Split(Vec<Weight>),
}

impl Projection {
    fn new(parts: Vec<Weight>) -> Result<Projection> {
        let ty = parts[0].ty();
        if parts.iter().all(|p| p.ty() == ty) {
            let refs: Vec<&Weight> = parts.iter().collect();
            Ok(Projection::Fused(Weight::concat_rows(&refs)?))
        } else {
            Ok(Projection::Split(parts))
        }
    }

    /// out: [m, Σ rows], each row the parts' outputs side by side.
    #[allow(clippy::too_many_arguments)]
    fn matmul(
        &self,
        ctx: &CpuContext,
        x: &[f32],
        m: usize,
        out: &mut [f32],
        tmp: &mut Vec<f32>,
        scratch: &mut MatmulScratch,
        prompt: &[bool],
    ) {
        match self {
            Projection::Fused(w) => w.matmul_rows(ctx.pool(), x, m, out, scratch, prompt),
            Projection::Split(parts) => {
                let width: usize = parts.iter().map(Weight::rows).sum();
                let mut col = 0;
                for p in parts {
                    let t = grow(tmp, m * p.rows());
                    p.matmul_rows(ctx.pool(), x, m, t, scratch, prompt);
                    for r in 0..m {
                        out[r * width + col..r * width + col + p.rows()]
                            .copy_from_slice(&t[r * p.rows()..(r + 1) * p.rows()]);
                    }
                    col += p.rows();
                }
            }
        }
    }

    fn has_wide_kernel(&self) -> bool {
        match self {
            Projection::Fused(w) => w.has_wide_kernel(),
            Projection::Split(p) => p.iter().any(Weight::has_wide_kernel),
        }
    }

    fn size_bytes(&self) -> usize {
        match self {
            Projection::Fused(w) => w.size_bytes(),
            Projection::Split(p) => p.iter().map(Weight::size_bytes).sum(),
        }
    }
}

struct Layer {
    attn_norm: Vec<f32>,
    qkv: Projection,
    /// q|k|v biases side by side (Qwen2).
    qkv_bias: Option<Vec<f32>>,
    o: Weight,
    ffn_norm: Vec<f32>,
    gate_up: Projection,
    down: Weight,
}

/// A loaded Llama-family model.
pub struct LlamaModel {
    config: ModelConfig,
    embed: Weight,
    /// `None` when the LM head is tied to the embedding.
    lm_head: Option<Weight>,
    layers: Vec<Layer>,
    norm: Vec<f32>,
    rope: RopeTable,
    /// See [`LlamaModel::has_prompt_kernel`]; fixed at load, since it
    /// depends only on the weights and the CPU.
    prompt_kernel: bool,
}

/// One step's flattened batch, as the model runner lays it out.
pub struct BatchInput<'a> {
    /// The tokens to run, all sequences back to back.
    pub tokens: &'a [u32],
    /// Each token's position in its sequence.
    pub positions: &'a [u32],
    /// Each token's KV slot: `block * block_size + offset`.
    pub slot_mapping: &'a [u32],
    /// The sequences, in the order their tokens appear.
    pub seqs: &'a [AttnSeq<'a>],
    /// Indices into `tokens` whose next-token logits are wanted.
    pub logit_rows: &'a [usize],
    /// Per token: whether it runs on the prompt kernel, the dense bf16
    /// matmuls of [`Weight::matmul_rows`] (where the CPU has them). The
    /// runner sets it for the prompt positions of sequences whose prompt is
    /// long enough to pay for that kernel (`request::PROMPT_KERNEL_MIN_LEN`);
    /// everything else, generated positions always, takes the exact
    /// kernels. A position's arithmetic thus depends on its sequence alone,
    /// so a sequence computes the same numbers alone, batched, chunked or
    /// recomputed after preemption.
    pub prompt_rows: &'a [bool],
}

/// Activation buffers reused across steps, so a warm step allocates nothing.
#[derive(Default)]
pub struct Workspace {
    x: Vec<f32>,
    h: Vec<f32>,
    qkv: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    attn: Vec<f32>,
    proj: Vec<f32>,
    gate_up: Vec<f32>,
    act: Vec<f32>,
    split_tmp: Vec<f32>,
    rows: Vec<f32>,
    /// `prompt_rows` of the logit rows.
    logit_prompt: Vec<bool>,
    scratch: MatmulScratch,
}

/// Returns the first `n` elements of `v`, growing it if needed. Growth
/// happens only on the first steps of a new shape; steady state reuses.
fn grow(v: &mut Vec<f32>, n: usize) -> &mut [f32] {
    if v.len() < n {
        v.resize(n, 0.0);
    }
    &mut v[..n]
}

impl LlamaModel {
    /// Builds the model from `source`, checking every tensor's shape against
    /// `config`. `max_positions` bounds the RoPE table (the engine's
    /// `--max-model-len`).
    pub fn load(
        source: &dyn WeightSource,
        config: ModelConfig,
        max_positions: usize,
    ) -> Result<LlamaModel> {
        if max_positions == 0 || max_positions > crate::engine::config::MAX_CONTEXT {
            bail!(
                "max_model_len {max_positions} must be between 1 and {}",
                crate::engine::config::MAX_CONTEXT
            );
        }
        let c = &config;
        let (d, q, kv, f) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.intermediate_size);
        let embed = source.matrix("model.embed_tokens.weight", c.vocab_size, d)?;
        let lm_head = if c.tie_word_embeddings && !source.contains("lm_head.weight") {
            None
        } else {
            Some(source.matrix("lm_head.weight", c.vocab_size, d)?)
        };
        let mut layers = Vec::new();
        for i in 0..c.num_layers {
            let p = |s: &str| format!("model.layers.{i}.{s}");
            let qkv = Projection::new(vec![
                source.matrix(&p("self_attn.q_proj.weight"), q, d)?,
                source.matrix(&p("self_attn.k_proj.weight"), kv, d)?,
                source.matrix(&p("self_attn.v_proj.weight"), kv, d)?,
            ])
            .with_context(|| format!("{}: layer {i} q/k/v", source.describe()))?;
            let qkv_bias = if c.attention_bias {
                let mut b = source.vector(&p("self_attn.q_proj.bias"), q)?;
                b.extend(source.vector(&p("self_attn.k_proj.bias"), kv)?);
                b.extend(source.vector(&p("self_attn.v_proj.bias"), kv)?);
                Some(b)
            } else {
                None
            };
            let gate_up = Projection::new(vec![
                source.matrix(&p("mlp.gate_proj.weight"), f, d)?,
                source.matrix(&p("mlp.up_proj.weight"), f, d)?,
            ])
            .with_context(|| format!("{}: layer {i} gate/up", source.describe()))?;
            layers.push(Layer {
                attn_norm: source.vector(&p("input_layernorm.weight"), d)?,
                qkv,
                qkv_bias,
                o: source.matrix(&p("self_attn.o_proj.weight"), d, q)?,
                ffn_norm: source.vector(&p("post_attention_layernorm.weight"), d)?,
                gate_up,
                down: source.matrix(&p("mlp.down_proj.weight"), d, f)?,
            });
        }
        let norm = source.vector("model.norm.weight", d)?;
        let rope = RopeTable::new(
            c.head_dim,
            c.rope_theta,
            max_positions,
            &c.rope_scaling,
            c.rope_style,
        );
        let head = lm_head.as_ref().unwrap_or(&embed);
        let prompt_kernel = head.has_wide_kernel()
            || layers.iter().any(|l| {
                l.qkv.has_wide_kernel()
                    || l.o.has_wide_kernel()
                    || l.gate_up.has_wide_kernel()
                    || l.down.has_wide_kernel()
            });
        Ok(LlamaModel {
            config,
            embed,
            lm_head,
            layers,
            norm,
            rope,
            prompt_kernel,
        })
    }

    /// The model's shape.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// Bytes of weights held in memory.
    pub fn weight_bytes(&self) -> usize {
        let layers: usize = self
            .layers
            .iter()
            .map(|l| {
                l.qkv.size_bytes() + l.o.size_bytes() + l.gate_up.size_bytes() + l.down.size_bytes()
            })
            .sum();
        layers + self.embed.size_bytes() + self.lm_head.as_ref().map_or(0, Weight::size_bytes)
    }

    /// Whether prompt rows can run on other kernels than generated rows on
    /// this CPU (see [`BatchInput::prompt_rows`]).
    pub fn has_prompt_kernel(&self) -> bool {
        self.prompt_kernel
    }

    /// The storage type of the layers' projections, for logs ("Q4_1").
    pub fn weight_type(&self) -> &'static str {
        self.layers.first().map_or("none", |l| l.o.ty().name())
    }

    /// Runs one flattened batch and writes the logits of `input.logit_rows`
    /// into `logits` (`[logit_rows.len(), vocab]`). K/V of every token are
    /// written into `kv` at the slots given.
    pub fn forward(
        &self,
        ctx: &CpuContext,
        input: &BatchInput<'_>,
        kv: &mut KvCache,
        ws: &mut Workspace,
        logits: &mut [f32],
    ) {
        match kv {
            KvCache::F32(layers, layout) => {
                self.forward_typed(ctx, input, layers, layout, ws, logits)
            }
            KvCache::F16(layers, layout) => {
                self.forward_typed(ctx, input, layers, layout, ws, logits)
            }
            KvCache::Bf16(layers, layout) => {
                self.forward_typed(ctx, input, layers, layout, ws, logits)
            }
        }
    }

    fn forward_typed<T: KvElem>(
        &self,
        ctx: &CpuContext,
        input: &BatchInput<'_>,
        kv: &mut [LayerKv<T>],
        layout: &KvLayout,
        ws: &mut Workspace,
        logits: &mut [f32],
    ) {
        let c = &self.config;
        let (d, qd, kvd, f) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.intermediate_size);
        let n = input.tokens.len();
        let prompt = input.prompt_rows;
        assert_eq!(prompt.len(), n, "forward: one prompt flag per token");
        let qkv_w = qd + 2 * kvd;
        let scale = 1.0 / (c.head_dim as f32).sqrt();

        let x = grow(&mut ws.x, n * d);
        for (row, &t) in x.chunks_exact_mut(d).zip(input.tokens) {
            self.embed.dequantize_row(t as usize, row);
        }
        for (layer, cache) in self.layers.iter().zip(kv.iter_mut()) {
            let x = &mut ws.x[..n * d];
            let h = grow(&mut ws.h, n * d);
            let eps = c.rms_norm_eps;
            let attn_norm = &layer.attn_norm;
            ops::for_row_ranges(ctx.pool(), x, d, h, d, &|xr, hr| {
                ops::rms_norm(xr, attn_norm, eps, hr)
            });
            let qkv = grow(&mut ws.qkv, n * qkv_w);
            layer
                .qkv
                .matmul(ctx, h, n, qkv, &mut ws.split_tmp, &mut ws.scratch, prompt);
            let (q, k, v) = (
                grow(&mut ws.q, n * qd),
                grow(&mut ws.k, n * kvd),
                grow(&mut ws.v, n * kvd),
            );
            for t in 0..n {
                let row = &mut qkv[t * qkv_w..(t + 1) * qkv_w];
                if let Some(b) = &layer.qkv_bias {
                    ops::add_inplace(row, b);
                }
                q[t * qd..(t + 1) * qd].copy_from_slice(&row[..qd]);
                k[t * kvd..(t + 1) * kvd].copy_from_slice(&row[qd..qd + kvd]);
                v[t * kvd..(t + 1) * kvd].copy_from_slice(&row[qd + kvd..]);
            }
            ops::rope_inplace(&self.rope, q, c.num_heads, input.positions);
            ops::rope_inplace(&self.rope, k, c.num_kv_heads, input.positions);
            ops::write_kv(layout, &mut cache.k, &mut cache.v, k, v, input.slot_mapping);
            let attn = grow(&mut ws.attn, n * qd);
            ops::paged_attention(
                ctx.pool(),
                layout,
                &cache.k,
                &cache.v,
                q,
                c.num_heads,
                input.seqs,
                scale,
                attn,
            );
            let proj = grow(&mut ws.proj, n * d);
            layer
                .o
                .matmul_rows(ctx.pool(), attn, n, proj, &mut ws.scratch, prompt);
            ops::add_inplace(x, proj);

            let ffn_norm = &layer.ffn_norm;
            ops::for_row_ranges(ctx.pool(), x, d, h, d, &|xr, hr| {
                ops::rms_norm(xr, ffn_norm, eps, hr)
            });
            let gu = grow(&mut ws.gate_up, n * 2 * f);
            layer
                .gate_up
                .matmul(ctx, h, n, gu, &mut ws.split_tmp, &mut ws.scratch, prompt);
            let act = grow(&mut ws.act, n * f);
            ops::for_row_ranges(ctx.pool(), gu, 2 * f, act, f, &|g, a| {
                ops::silu_mul(g, f, a)
            });
            layer
                .down
                .matmul_rows(ctx.pool(), act, n, proj, &mut ws.scratch, prompt);
            ops::add_inplace(x, proj);
        }
        let r = input.logit_rows.len();
        if r == 0 {
            return;
        }
        let rows = grow(&mut ws.rows, r * d);
        ws.logit_prompt.clear();
        for (dst, &t) in rows.chunks_exact_mut(d).zip(input.logit_rows) {
            dst.copy_from_slice(&ws.x[t * d..(t + 1) * d]);
            ws.logit_prompt.push(prompt[t]);
        }
        ops::rms_norm_inplace(rows, &self.norm, c.rms_norm_eps);
        let head = self.lm_head.as_ref().unwrap_or(&self.embed);
        head.matmul_rows(
            ctx.pool(),
            rows,
            r,
            &mut logits[..r * c.vocab_size],
            &mut ws.scratch,
            &ws.logit_prompt,
        );
    }
}
