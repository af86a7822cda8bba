//! One decoder definition for the Llama family: Llama 2/3, Mistral, SmolLM2,
//! Qwen2 (which adds q/k/v biases) and Qwen3 (which adds an RMSNorm over
//! each q and k head). It is written against
//! `pagoda_accel`'s operations only, and runs one flattened batch per call:
//! prefill chunks and decodes of many sequences together, with attention
//! reading K/V from the paged cache.

use crate::engine::config::ModelConfig;
use crate::engine::loader::WeightSource;
use anyhow::{bail, Context, Result};
use pagoda_accel::ops::RopeTable;
use pagoda_accel::{Backend, DeviceMatrix, HostMatrix, Rows};

/// A projection whose output is several logical matrices side by side
/// (q|k|v or gate|up). Fused into one matrix when the parts share a storage
/// type and read their input alike, so the device runs one matmul instead
/// of several.
enum Projection<B: Backend> {
    Fused(B::Matrix),
    Split(Vec<B::Matrix>),
}

impl<B: Backend> Projection<B> {
    fn new(backend: &B, parts: Vec<HostMatrix<'_>>) -> Result<Projection<B>> {
        if HostMatrix::can_concat(&parts) {
            let fused = HostMatrix::concat_rows(&parts)?;
            Ok(Projection::Fused(backend.upload_matrix(&fused)?))
        } else {
            let mut up = Vec::with_capacity(parts.len());
            for p in &parts {
                up.push(backend.upload_matrix(p)?);
            }
            Ok(Projection::Split(up))
        }
    }

    /// out: [m, Σ rows], each row the parts' outputs side by side.
    fn matmul(
        &self,
        b: &mut B,
        x: &B::Buffer,
        m: usize,
        out: &mut B::Buffer,
        tmp: &mut B::Buffer,
        step: &B::Step,
    ) {
        match self {
            Projection::Fused(w) => b.matmul(w, x, m, out, step, Rows::Tokens),
            Projection::Split(parts) => {
                let width: usize = parts.iter().map(|p| p.rows()).sum();
                let mut col = 0;
                for p in parts {
                    b.matmul(p, x, m, tmp, step, Rows::Tokens);
                    b.copy_columns(tmp, p.rows(), 0, out, width, col, p.rows(), m);
                    col += p.rows();
                }
            }
        }
    }

    fn parts(&self) -> &[B::Matrix] {
        match self {
            Projection::Fused(w) => std::slice::from_ref(w),
            Projection::Split(p) => p,
        }
    }

    fn size_bytes(&self) -> usize {
        self.parts().iter().map(|p| p.size_bytes()).sum()
    }
}

struct Layer<B: Backend> {
    attn_norm: B::Vector,
    qkv: Projection<B>,
    /// q|k|v biases side by side (Qwen2, `attention_bias`).
    qkv_bias: Option<B::Vector>,
    /// Per-head RMSNorm weights of q and k (Qwen3), `head_dim` each.
    q_norm: Option<B::Vector>,
    k_norm: Option<B::Vector>,
    o: B::Matrix,
    o_bias: Option<B::Vector>,
    ffn_norm: B::Vector,
    gate_up: Projection<B>,
    /// gate|up biases side by side (`mlp_bias`).
    gate_up_bias: Option<B::Vector>,
    down: B::Matrix,
    down_bias: Option<B::Vector>,
}

/// A loaded Llama-family model, its weights on the device of `B`.
pub struct LlamaModel<B: Backend> {
    config: ModelConfig,
    embed: B::Matrix,
    /// `None` when the LM head is tied to the embedding.
    lm_head: Option<B::Matrix>,
    layers: Vec<Layer<B>>,
    /// Each layer's attention window, where it is shorter than the
    /// context (a longer one changes nothing).
    windows: Vec<Option<usize>>,
    norm: B::Vector,
    rope: B::Rope,
    /// See [`LlamaModel::has_prompt_kernel`]; fixed at load, since it
    /// depends only on the weights and the device.
    prompt_kernel: bool,
    weight_type: &'static str,
    /// The widest part of a split (unfused) projection, whose output goes
    /// through `Workspace::split_tmp`; `None` when every projection fused.
    split_width: Option<usize>,
}

/// Activation buffers reused across steps, so a warm step allocates nothing.
pub struct Workspace<B: Backend> {
    x: B::Buffer,
    h: B::Buffer,
    qkv: B::Buffer,
    q: B::Buffer,
    k: B::Buffer,
    v: B::Buffer,
    /// Where the per-head q/k norms write, swapped with `q` / `k` after.
    normed: B::Buffer,
    attn: B::Buffer,
    proj: B::Buffer,
    gate_up: B::Buffer,
    act: B::Buffer,
    split_tmp: B::Buffer,
    rows: B::Buffer,
    /// The logits of the step's logit rows.
    pub logits: B::Buffer,
}

impl<B: Backend> Default for Workspace<B> {
    fn default() -> Self {
        Workspace {
            x: Default::default(),
            h: Default::default(),
            qkv: Default::default(),
            q: Default::default(),
            k: Default::default(),
            v: Default::default(),
            normed: Default::default(),
            attn: Default::default(),
            proj: Default::default(),
            gate_up: Default::default(),
            act: Default::default(),
            split_tmp: Default::default(),
            rows: Default::default(),
            logits: Default::default(),
        }
    }
}

impl<B: Backend> LlamaModel<B> {
    /// Builds the model from `source` onto `backend`'s device, checking
    /// every tensor's shape against `config`. `max_positions` bounds the
    /// RoPE table (the engine's `--max-model-len`).
    pub fn load(
        backend: &B,
        source: &dyn WeightSource,
        config: ModelConfig,
        max_positions: usize,
    ) -> Result<LlamaModel<B>> {
        if max_positions == 0 || max_positions > crate::engine::config::MAX_CONTEXT {
            bail!(
                "max_model_len {max_positions} must be between 1 and {}",
                crate::engine::config::MAX_CONTEXT
            );
        }
        let c = &config;
        if let Some(w) = c.min_sliding_window() {
            if w < max_positions && !backend.supports_sliding_window() {
                bail!(
                    "the model attends over a sliding window of {w} tokens, which a context of {max_positions} would exceed, and this device's attention has no sliding window yet; serve it on the CPU, or with --max-model-len {w} or less"
                );
            }
        }
        let (d, q, kv, f) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.intermediate_size);
        let upload = |name: &str, rows: usize, cols: usize| -> Result<B::Matrix> {
            let m = source.matrix(name, rows, cols)?;
            backend
                .upload_matrix(&m)
                .with_context(|| format!("{}: tensor '{name}'", source.describe()))
        };
        let vector = |name: &str, len: usize| -> Result<B::Vector> {
            Ok(backend.upload_vector(&source.vector(name, len)?)?)
        };
        let embed = upload("model.embed_tokens.weight", c.vocab_size, d)?;
        let lm_head = if c.tie_word_embeddings && !source.contains("lm_head.weight") {
            None
        } else {
            Some(upload("lm_head.weight", c.vocab_size, d)?)
        };
        let mut layers = Vec::new();
        for i in 0..c.num_layers {
            let p = |s: &str| format!("model.layers.{i}.{s}");
            let qkv = Projection::new(
                backend,
                vec![
                    source.matrix(&p("self_attn.q_proj.weight"), q, d)?,
                    source.matrix(&p("self_attn.k_proj.weight"), kv, d)?,
                    source.matrix(&p("self_attn.v_proj.weight"), kv, d)?,
                ],
            )
            .with_context(|| format!("{}: layer {i} q/k/v", source.describe()))?;
            let qkv_bias = if c.attention_bias {
                let mut b = source.vector(&p("self_attn.q_proj.bias"), q)?;
                b.extend(source.vector(&p("self_attn.k_proj.bias"), kv)?);
                b.extend(source.vector(&p("self_attn.v_proj.bias"), kv)?);
                Some(backend.upload_vector(&b)?)
            } else {
                None
            };
            let q_norm = match c.qk_norm {
                true => Some(vector(&p("self_attn.q_norm.weight"), c.head_dim)?),
                false => None,
            };
            let k_norm = match c.qk_norm {
                true => Some(vector(&p("self_attn.k_norm.weight"), c.head_dim)?),
                false => None,
            };
            let o_bias = match c.o_bias {
                true => Some(vector(&p("self_attn.o_proj.bias"), d)?),
                false => None,
            };
            let (gate_up_bias, down_bias) = if c.mlp_bias {
                let mut b = source.vector(&p("mlp.gate_proj.bias"), f)?;
                b.extend(source.vector(&p("mlp.up_proj.bias"), f)?);
                (
                    Some(backend.upload_vector(&b)?),
                    Some(vector(&p("mlp.down_proj.bias"), d)?),
                )
            } else {
                (None, None)
            };
            let gate_up = Projection::new(
                backend,
                vec![
                    source.matrix(&p("mlp.gate_proj.weight"), f, d)?,
                    source.matrix(&p("mlp.up_proj.weight"), f, d)?,
                ],
            )
            .with_context(|| format!("{}: layer {i} gate/up", source.describe()))?;
            layers.push(Layer {
                attn_norm: vector(&p("input_layernorm.weight"), d)?,
                qkv,
                qkv_bias,
                q_norm,
                k_norm,
                o: upload(&p("self_attn.o_proj.weight"), d, q)?,
                o_bias,
                ffn_norm: vector(&p("post_attention_layernorm.weight"), d)?,
                gate_up,
                gate_up_bias,
                down: upload(&p("mlp.down_proj.weight"), d, f)?,
                down_bias,
            });
        }
        let norm = vector("model.norm.weight", d)?;
        let rope = backend.upload_rope(&RopeTable::new(
            c.head_dim,
            c.rope_theta,
            max_positions,
            &c.rope_scaling,
            c.rope_style,
        ))?;
        let head = lm_head.as_ref().unwrap_or(&embed);
        let prompt_kernel = backend.has_prompt_kernel(head)
            || layers.iter().any(|l| {
                l.qkv.parts().iter().any(|m| backend.has_prompt_kernel(m))
                    || backend.has_prompt_kernel(&l.o)
                    || l.gate_up
                        .parts()
                        .iter()
                        .any(|m| backend.has_prompt_kernel(m))
                    || backend.has_prompt_kernel(&l.down)
            });
        let weight_type = layers.first().map_or("none", |l| l.o.ty().name());
        let split_width = layers
            .iter()
            .flat_map(|l| [&l.qkv, &l.gate_up])
            .filter_map(|p| match p {
                Projection::Fused(_) => None,
                Projection::Split(parts) => parts.iter().map(|m| m.rows()).max(),
            })
            .max();
        let windows = (0..config.num_layers)
            .map(|i| config.sliding_window(i).filter(|&w| w < max_positions))
            .collect();
        Ok(LlamaModel {
            config,
            embed,
            lm_head,
            layers,
            windows,
            norm,
            rope,
            prompt_kernel,
            weight_type,
            split_width,
        })
    }

    /// The model's shape.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// Bytes of weights held on the device.
    pub fn weight_bytes(&self) -> usize {
        let layers: usize = self
            .layers
            .iter()
            .map(|l| {
                l.qkv.size_bytes() + l.o.size_bytes() + l.gate_up.size_bytes() + l.down.size_bytes()
            })
            .sum();
        layers + self.embed.size_bytes() + self.lm_head.as_ref().map_or(0, |h| h.size_bytes())
    }

    /// Whether prompt rows can run on other kernels than generated rows on
    /// this device (see [`Backend::has_prompt_kernel`]).
    pub fn has_prompt_kernel(&self) -> bool {
        self.prompt_kernel
    }

    /// The storage type of the layers' projections, for logs ("Q4_1").
    pub fn weight_type(&self) -> &'static str {
        self.weight_type
    }

    /// Runs one step, whose metadata `step` already holds on the device
    /// (`n_tokens` tokens, `n_logits` logit rows), and leaves the logits of
    /// the logit rows in `ws.logits` (`[n_logits, vocab]`). K/V of every
    /// token are written into `kv` at the step's slots.
    pub fn forward(
        &self,
        b: &mut B,
        step: &B::Step,
        n_tokens: usize,
        n_logits: usize,
        kv: &mut B::Kv,
        ws: &mut Workspace<B>,
    ) -> Result<(), pagoda_accel::BackendError> {
        let c = &self.config;
        let (d, qd, kvd, f) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.intermediate_size);
        let n = n_tokens;
        let qkv_w = qd + 2 * kvd;
        let scale = 1.0 / (c.head_dim as f32).sqrt();
        let eps = c.rms_norm_eps;
        b.reserve(&mut ws.x, n * d)?;
        b.reserve(&mut ws.h, n * d)?;
        b.reserve(&mut ws.qkv, n * qkv_w)?;
        // With the q/k norms, `q`, `k` and `normed` trade places layer by
        // layer, so each must hold the wider of the two.
        let k_len = if c.qk_norm { n * qd.max(kvd) } else { n * kvd };
        b.reserve(&mut ws.q, n * qd.max(kvd))?;
        b.reserve(&mut ws.k, k_len)?;
        b.reserve(&mut ws.v, n * kvd)?;
        if c.qk_norm {
            b.reserve(&mut ws.normed, k_len)?;
        }
        b.reserve(&mut ws.attn, n * qd)?;
        b.reserve(&mut ws.proj, n * d)?;
        b.reserve(&mut ws.gate_up, n * 2 * f)?;
        b.reserve(&mut ws.act, n * f)?;
        if let Some(w) = self.split_width {
            b.reserve(&mut ws.split_tmp, n * w)?;
        }

        b.embed(&self.embed, step, &mut ws.x);
        for (i, layer) in self.layers.iter().enumerate() {
            b.rms_norm(&ws.x, &layer.attn_norm, eps, n, d, &mut ws.h);
            layer
                .qkv
                .matmul(b, &ws.h, n, &mut ws.qkv, &mut ws.split_tmp, step);
            if let Some(bias) = &layer.qkv_bias {
                b.add_bias(&mut ws.qkv, bias, n, qkv_w);
            }
            b.copy_columns(&ws.qkv, qkv_w, 0, &mut ws.q, qd, 0, qd, n);
            b.copy_columns(&ws.qkv, qkv_w, qd, &mut ws.k, kvd, 0, kvd, n);
            b.copy_columns(&ws.qkv, qkv_w, qd + kvd, &mut ws.v, kvd, 0, kvd, n);
            if let (Some(qn), Some(kn)) = (&layer.q_norm, &layer.k_norm) {
                // Rows of `head_dim`: every head of every token alike.
                let hd = c.head_dim;
                b.rms_norm(&ws.q, qn, eps, n * c.num_heads, hd, &mut ws.normed);
                std::mem::swap(&mut ws.q, &mut ws.normed);
                b.rms_norm(&ws.k, kn, eps, n * c.num_kv_heads, hd, &mut ws.normed);
                std::mem::swap(&mut ws.k, &mut ws.normed);
            }
            b.rope(&self.rope, &mut ws.q, c.num_heads, step);
            b.rope(&self.rope, &mut ws.k, c.num_kv_heads, step);
            b.write_kv(kv, i, &ws.k, &ws.v, step);
            let window = self.windows.get(i).copied().flatten();
            b.attention(kv, i, &ws.q, c.num_heads, scale, window, step, &mut ws.attn);
            b.matmul(&layer.o, &ws.attn, n, &mut ws.proj, step, Rows::Tokens);
            if let Some(bias) = &layer.o_bias {
                b.add_bias(&mut ws.proj, bias, n, d);
            }
            b.add(&mut ws.x, &ws.proj, n * d);

            b.rms_norm(&ws.x, &layer.ffn_norm, eps, n, d, &mut ws.h);
            layer
                .gate_up
                .matmul(b, &ws.h, n, &mut ws.gate_up, &mut ws.split_tmp, step);
            if let Some(bias) = &layer.gate_up_bias {
                b.add_bias(&mut ws.gate_up, bias, n, 2 * f);
            }
            b.silu_mul(&ws.gate_up, n, f, &mut ws.act);
            b.matmul(&layer.down, &ws.act, n, &mut ws.proj, step, Rows::Tokens);
            if let Some(bias) = &layer.down_bias {
                b.add_bias(&mut ws.proj, bias, n, d);
            }
            b.add(&mut ws.x, &ws.proj, n * d);
        }
        let r = n_logits;
        if r == 0 {
            return Ok(());
        }
        // `ws.h` already holds `n ≥ r` rows.
        b.reserve(&mut ws.rows, r * d)?;
        b.reserve(&mut ws.logits, r * c.vocab_size)?;
        b.gather_logit_rows(&ws.x, d, step, &mut ws.rows);
        b.rms_norm(&ws.rows, &self.norm, eps, r, d, &mut ws.h);
        let head = self.lm_head.as_ref().unwrap_or(&self.embed);
        b.matmul(head, &ws.h, r, &mut ws.logits, step, Rows::Logits);
        Ok(())
    }
}
