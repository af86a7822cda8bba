//! The model's shape and hyper-parameters, read from `config.json` or from
//! GGUF metadata into one form the model definition uses.

use crate::engine::loader::gguf::GgufFile;
use anyhow::{bail, Context, Result};
use pagoda_accel::ops::{GroupLimit, GroupScore, RopeScaling, RopeStyle, RouterScoring};
use serde_json::Value;

/// The longest context the engine accepts (16M tokens).
pub const MAX_CONTEXT: usize = 1 << 24;

/// The most decoder layers a config may declare.
pub const MAX_LAYERS: usize = 1 << 10;

/// Which architecture a config describes, the family id of the registry's
/// rows ([`crate::engine::models::registry`]): it picks the loader and
/// decides the small differences between the members of one family. An
/// open set, named by a string as vLLM's registry names them: the ids of
/// the families read here are below, and a new family's file defines its
/// own (`pub const MINE: Arch = Arch::new("Mine");`), so adding a family
/// touches no list here.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Arch(&'static str);

#[allow(non_upper_case_globals)]
impl Arch {
    /// Llama, Mistral and SmolLM2: no attention bias.
    pub const Llama: Arch = Arch("Llama");
    /// Qwen2: biases on the q, k and v projections.
    pub const Qwen2: Arch = Arch("Qwen2");
    /// Qwen3: RMSNorm over each q and k head before RoPE.
    pub const Qwen3: Arch = Arch("Qwen3");
    /// Mixtral: Mistral's attention, a mixture of experts in every layer.
    pub const Mixtral: Arch = Arch("Mixtral");
    /// Qwen2-MoE: Qwen2's attention; routed experts plus a shared expert
    /// behind a sigmoid gate.
    pub const Qwen2Moe: Arch = Arch("Qwen2Moe");
    /// Qwen3-MoE: Qwen3's attention; routed experts.
    pub const Qwen3Moe: Arch = Arch("Qwen3Moe");
    /// DeepSeek-V2 and V3: multi-head latent attention, shared and routed
    /// experts after the first dense layers.
    pub const Deepseek: Arch = Arch("Deepseek");
    /// Qwen3-Next: hybrid (see [`HybridConfig`]), experts with a gated
    /// shared expert, its Gated DeltaNet projections grouped by key head.
    pub const Qwen3Next: Arch = Arch("Qwen3Next");
    /// Qwen3.5 dense: hybrid, dense MLPs.
    pub const Qwen35: Arch = Arch("Qwen35");
    /// Qwen3.5-MoE: hybrid, experts with a gated shared expert in every
    /// layer.
    pub const Qwen35Moe: Arch = Arch("Qwen35Moe");
    /// Gemma 3 text: local (sliding-window) and global layers with their
    /// own RoPE, q/k norms, sandwich norms, GeGLU (see [`GemmaConfig`]).
    pub const Gemma3: Arch = Arch("Gemma3");
    /// gpt-oss: biased attention with a sink logit per head, alternating
    /// sliding-window and full layers, YaRN; experts in every layer stored
    /// fused, with biases and a clamped SwiGLU (see [`GptOssConfig`]).
    pub const GptOss: Arch = Arch("GptOss");
    /// BERT: a post-LayerNorm encoder whose rows attend both ways, served
    /// for pooling only (see [`EncoderConfig`]).
    pub const Bert: Arch = Arch("Bert");

    /// The id named `name` (unique among the registry's rows).
    pub const fn new(name: &'static str) -> Arch {
        Arch(name)
    }

    /// Its name, as logs and errors show it.
    pub fn name(self) -> &'static str {
        self.0
    }
}

impl std::fmt::Debug for Arch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.0)
    }
}

/// The gated MLP's activation: `down(act(gate(x)) · up(x))`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Activation {
    /// SiLU (`silu`, `swish`): SwiGLU.
    #[default]
    Silu,
    /// GELU's tanh approximation (`gelu_pytorch_tanh`): GeGLU.
    GeluTanh,
}

/// What Gemma 3 adds to the decoder: every RMSNorm scales by `1 + w`, the
/// embedding is scaled by `√hidden_size`, each layer normalizes its
/// attention and MLP outputs too (sandwich norms), the sliding-window
/// (local) layers rotate with their own RoPE base, and the logits may be
/// soft-capped.
#[derive(Clone, Debug, PartialEq)]
pub struct GemmaConfig {
    /// The attention's score scale, `query_pre_attn_scalar^-0.5`.
    pub attn_scale: f32,
    /// The local layers' RoPE base; the global layers use the config's
    /// `rope_theta` and `rope_scaling`.
    pub local_rope_theta: f32,
    pub local_rope_scaling: RopeScaling,
    /// `final_logit_softcapping`: logits become `tanh(l / cap) · cap`.
    pub final_logit_softcap: Option<f32>,
}

/// What gpt-oss's experts compute beyond a plain SwiGLU: `swiglu_limit`
/// clamps the gate from above and the up projection both ways, and
/// `swiglu_alpha` scales the gate inside the sigmoid (see
/// [`pagoda_accel::ops::swiglu_clamped`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GptOssConfig {
    pub swiglu_alpha: f32,
    pub swiglu_limit: f32,
}

/// The hybrid Qwen models (Qwen3-Next, Qwen3.5): most layers are Gated
/// DeltaNet (linear attention with a fixed-size state per sequence), the
/// others gated full attention (`q_proj` emits the query and a sigmoid
/// output gate per head) with RoPE over the first `rotary_dim` values of
/// each head. Their RMSNorms (not the Gated DeltaNet's gated norm) scale
/// by `1 + w`.
#[derive(Clone, Debug, PartialEq)]
pub struct HybridConfig {
    /// Per layer: Gated DeltaNet (`linear_attention`) or full attention.
    pub linear_layers: Vec<bool>,
    /// `linear_num_key_heads`.
    pub n_k_heads: usize,
    /// `linear_num_value_heads` (a multiple of the key heads).
    pub n_v_heads: usize,
    /// `linear_key_head_dim`.
    pub k_dim: usize,
    /// `linear_value_head_dim`.
    pub v_dim: usize,
    /// `linear_conv_kernel_dim`.
    pub conv_kernel: usize,
    /// Dimensions of each attention head that RoPE rotates:
    /// `int(head_dim · partial_rotary_factor)`, the rest pass through.
    pub rotary_dim: usize,
}

/// DeepSeek's multi-head latent attention.
#[derive(Clone, Debug, PartialEq)]
pub struct MlaConfig {
    /// The query's low-rank width (`q_lora_rank`); `None`: a full `q_proj`
    /// (V2-Lite).
    pub q_lora_rank: Option<usize>,
    /// The compressed KV latent's width (`kv_lora_rank`).
    pub kv_lora_rank: usize,
    /// Per head: the query/key part without RoPE.
    pub qk_nope_head_dim: usize,
    /// Per head: the query/key part with RoPE (the key's is shared by all
    /// heads).
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
    /// Multiplies the softmax scale `1/√(nope + rope)`: YaRN's mscale²
    /// where the RoPE scaling sets `mscale_all_dim`, else 1.
    pub softmax_mscale: f32,
}

impl MlaConfig {
    /// Values the latent KV cache keeps per token and layer.
    pub fn latent_width(&self) -> usize {
        self.kv_lora_rank + self.qk_rope_head_dim
    }
}

/// The mixture-of-experts part of a config.
#[derive(Clone, Debug, PartialEq)]
pub struct MoeConfig {
    /// Routed experts per MoE layer.
    pub n_experts: usize,
    /// Experts per token (`num_experts_per_tok`).
    pub top_k: usize,
    /// Whether the chosen experts' weights are renormalized to sum to 1
    /// (`norm_topk_prob`; Mixtral always).
    pub normalize: bool,
    /// Each routed expert's intermediate width (`moe_intermediate_size`;
    /// Mixtral's `intermediate_size`).
    pub expert_ffn: usize,
    /// The shared expert's intermediate width, where the model has one
    /// (Qwen2-MoE's `shared_expert_intermediate_size`).
    pub shared_ffn: Option<usize>,
    /// Which layers are mixtures (the rest are dense MLPs of
    /// `intermediate_size`): `decoder_sparse_step` and `mlp_only_layers`,
    /// or DeepSeek's `first_k_dense_replace`.
    pub sparse_layers: Vec<bool>,
    /// How router logits become scores (DeepSeek-V3: sigmoid).
    pub scoring: RouterScoring,
    /// `routed_scaling_factor` (1 elsewhere).
    pub routed_scale: f32,
    /// DeepSeek's group-limited choice (`n_group`, `topk_group`).
    pub groups: Option<GroupLimit>,
    /// The router has `e_score_correction_bias` (DeepSeek-V3).
    pub score_bias: bool,
    /// The shared expert's output goes through a sigmoid gate (Qwen2-MoE);
    /// DeepSeek's shared experts are always added.
    pub shared_gated: bool,
}

/// What an encoder (BERT) has that a decoder does not.
#[derive(Clone, Debug, PartialEq)]
pub struct EncoderConfig {
    /// The LayerNorms' epsilon (`layer_norm_eps`).
    pub layer_norm_eps: f32,
    /// Rows of the token type table (`type_vocab_size`); 0 for none.
    pub type_vocab_size: usize,
    /// What is added to each position before its embedding is read (0 for
    /// BERT's absolute positions; XLM-R's `padding_idx + 1`).
    pub position_offset: usize,
    /// Rows of the position table (`max_position_embeddings` as the
    /// checkpoint gives it; the context is this less the offset).
    pub position_rows: usize,
    /// `Some(num_labels)` for a `*ForSequenceClassification` checkpoint:
    /// the pooler (dense and tanh) and the classifier follow the encoder.
    pub num_labels: Option<usize>,
    /// ModernBERT's keys, for that family (`models::modernbert`).
    pub modernbert: Option<ModernBertConfig>,
}

/// What ModernBERT has beyond [`EncoderConfig`]: pre-LayerNorm layers
/// with rotary positions, local layers attending a window around each
/// token with their own RoPE base, a gated MLP, and a classifier head of
/// dense, activation and LayerNorm.
#[derive(Clone, Debug, PartialEq)]
pub struct ModernBertConfig {
    /// The LayerNorms carry a bias (`norm_bias`).
    pub norm_bias: bool,
    /// Per layer: `Some(w)` for a local (`sliding_attention`) layer, which
    /// sees the tokens at most `w = local_attention / 2` positions away on
    /// either side; `None` for a global one.
    pub windows: Vec<Option<usize>>,
    /// The local layers' RoPE base; the global layers' is the config's
    /// `rope_theta`.
    pub local_rope_theta: f32,
    /// The MLP's activation (`hidden_activation`) on the input half of
    /// `Wi`'s output, times the gate half.
    pub hidden_act: pagoda_accel::ops::Activation,
    /// The classifier head's dense layer has a bias (`classifier_bias`).
    pub classifier_bias: bool,
    /// The classifier head's activation (`classifier_activation`).
    pub classifier_act: pagoda_accel::ops::Activation,
}

/// Everything the forward pass needs to know about the model's shape.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub arch: Arch,
    pub hidden_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub intermediate_size: usize,
    pub vocab_size: usize,
    pub rms_norm_eps: f32,
    pub rope_theta: f32,
    pub rope_scaling: RopeScaling,
    pub rope_style: RopeStyle,
    /// The context length the model was trained for.
    pub max_position_embeddings: usize,
    /// The LM head reuses the token embedding.
    pub tie_word_embeddings: bool,
    /// The q, k and v projections carry a bias (Qwen2; Llama and Qwen3
    /// with `attention_bias`).
    pub attention_bias: bool,
    /// The output projection carries a bias (Llama and Qwen3 with
    /// `attention_bias`).
    pub o_bias: bool,
    /// The gate, up and down projections carry biases (`mlp_bias`).
    pub mlp_bias: bool,
    /// The attention window of each layer: `Some(w)` when a query sees
    /// only the `w` most recent positions (itself included), `None` for
    /// full attention. Empty means full attention everywhere.
    pub sliding_windows: Vec<Option<usize>>,
    /// The mixture of experts, for the MoE families.
    pub moe: Option<MoeConfig>,
    /// Multi-head latent attention, for DeepSeek.
    pub mla: Option<MlaConfig>,
    /// The layer mix and linear-attention shape of the hybrid Qwen models.
    pub hybrid: Option<HybridConfig>,
    /// The gated MLP's activation.
    pub hidden_act: Activation,
    /// Gemma 3's additions to the decoder.
    pub gemma: Option<GemmaConfig>,
    /// gpt-oss's expert activation.
    pub gpt_oss: Option<GptOssConfig>,
    /// The encoder's own keys, for BERT.
    pub encoder: Option<EncoderConfig>,
}

impl ModelConfig {
    /// Interprets the parsed `config.json` of a decoder of `family`
    /// (the reading the decoder families share; which keys each honours
    /// follows `family`). [`crate::engine::models::registry`] picks the
    /// family from `architectures` or `model_type`.
    pub fn from_hf_decoder(v: &Value, family: HfFamily) -> Result<ModelConfig> {
        let usize_of = |key: &str| required_count(v, key);
        let f32_of = |key: &str, default: f32| -> Result<f32> {
            match v.get(key) {
                None | Some(Value::Null) => Ok(default),
                Some(x) => x
                    .as_f64()
                    .map(|x| x as f32)
                    .with_context(|| format!("'{key}' must be a number")),
            }
        };
        let hidden_size = usize_of("hidden_size")?;
        let num_heads = usize_of("num_attention_heads")?;
        let num_kv_heads = match v.get("num_key_value_heads") {
            None | Some(Value::Null) => num_heads,
            Some(_) => usize_of("num_key_value_heads")?,
        };
        let head_dim = match v.get("head_dim") {
            None | Some(Value::Null) => {
                if num_heads == 0 {
                    bail!("'num_attention_heads' must be positive");
                }
                hidden_size / num_heads
            }
            Some(_) => usize_of("head_dim")?,
        };
        let arch = match family {
            HfFamily::Llama | HfFamily::Mistral => Arch::Llama,
            HfFamily::Qwen2 => Arch::Qwen2,
            HfFamily::Qwen3 => Arch::Qwen3,
            HfFamily::Mixtral => Arch::Mixtral,
            HfFamily::Qwen2Moe => Arch::Qwen2Moe,
            HfFamily::Qwen3Moe => Arch::Qwen3Moe,
            HfFamily::DeepseekV2 | HfFamily::DeepseekV3 => Arch::Deepseek,
            HfFamily::Qwen3Next => Arch::Qwen3Next,
            HfFamily::Qwen35 => Arch::Qwen35,
            HfFamily::Qwen35Moe => Arch::Qwen35Moe,
            HfFamily::Gemma3 => Arch::Gemma3,
            HfFamily::GptOss => Arch::GptOss,
        };
        let hybrid_family = matches!(
            family,
            HfFamily::Qwen3Next | HfFamily::Qwen35 | HfFamily::Qwen35Moe
        );
        let max_position_embeddings = match v.get("max_position_embeddings") {
            None | Some(Value::Null) => 2048,
            Some(_) => usize_of("max_position_embeddings")?,
        };
        let gemma_family = family == HfFamily::Gemma3;
        let (rope_theta, rope_scaling, rotary_factor, local_rope) = if gemma_family {
            let ((theta, scaling), local) = read_gemma_rope(v, max_position_embeddings)?;
            (theta, scaling, 1.0, Some(local))
        } else {
            let (theta, scaling, factor) = read_hf_rope(v, max_position_embeddings, hybrid_family)?;
            (theta, scaling, factor, None)
        };
        let num_layers = usize_of("num_hidden_layers")?;
        // Checked before anything is sized by it (validate checks again).
        if num_layers > MAX_LAYERS {
            bail!("'num_hidden_layers' = {num_layers} is beyond the supported maximum of {MAX_LAYERS}");
        }
        let act_key = match v.get("hidden_act").filter(|x| !x.is_null()) {
            Some(_) => "hidden_act",
            None => "hidden_activation",
        };
        let act = match v.get(act_key) {
            None | Some(Value::Null) => None,
            Some(x) => Some(
                x.as_str()
                    .with_context(|| format!("'{act_key}' must be a string, got {x}"))?,
            ),
        };
        let hidden_act = match (gemma_family, act) {
            (false, None | Some("silu" | "swish")) => Activation::Silu,
            (false, Some(act)) => {
                bail!("{act_key} '{act}' is not supported: the MLP is built for SiLU (silu)")
            }
            // `Gemma3TextConfig`'s default.
            (true, None | Some("gelu_pytorch_tanh")) => Activation::GeluTanh,
            (true, Some(act)) => bail!(
                "{act_key} '{act}' is not supported for Gemma 3: its MLP is built for GELU's tanh approximation (gelu_pytorch_tanh)"
            ),
        };
        let gemma = match local_rope {
            Some((local_rope_theta, local_rope_scaling)) => {
                Some(read_gemma(v, local_rope_theta, local_rope_scaling)?)
            }
            None => {
                // Keys only Gemma's modeling code reads: on another family
                // they would mean math that is not built here.
                for key in [
                    "query_pre_attn_scalar",
                    "rope_local_base_freq",
                    "final_logit_softcapping",
                    "attn_logit_softcapping",
                ] {
                    if v.get(key).is_some_and(|x| !x.is_null()) {
                        bail!("'{key}' is set, and this architecture's attention does not compute it (only Gemma 3 reads it)");
                    }
                }
                None
            }
        };
        let flag = |key: &str| -> Result<bool> {
            match v.get(key) {
                None | Some(Value::Null) => Ok(false),
                Some(Value::Bool(b)) => Ok(*b),
                Some(other) => bail!("'{key}' must be true or false, got {other}"),
            }
        };
        // Which biases each family's modeling code builds: Mistral's and
        // Qwen2's are fixed by the architecture (their configs carry no
        // `attention_bias`); Llama and Qwen3 read the key, which puts a
        // bias on q, k, v and o alike.
        let (attention_bias, o_bias) = match family {
            HfFamily::Mistral | HfFamily::Mixtral => (false, false),
            HfFamily::DeepseekV2 | HfFamily::DeepseekV3 => {
                if flag("attention_bias")? {
                    bail!("'attention_bias' on DeepSeek's latent-attention projections is not supported");
                }
                (false, false)
            }
            HfFamily::Qwen2 => (true, false),
            // transformers 5 writes Qwen2-MoE's `qkv_bias`; 4 has none and
            // always builds the biases.
            HfFamily::Qwen2Moe => match v.get("qkv_bias") {
                None | Some(Value::Null) => (true, false),
                Some(_) => (flag("qkv_bias")?, false),
            },
            // gpt-oss's `attention_bias` (true in every published config)
            // puts a bias on q, k, v and o alike.
            HfFamily::Llama | HfFamily::Qwen3 | HfFamily::Qwen3Moe | HfFamily::GptOss => {
                let b = flag("attention_bias")?;
                (b, b)
            }
            HfFamily::Gemma3 => {
                let b = flag("attention_bias")?;
                (b, b)
            }
            HfFamily::Qwen3Next | HfFamily::Qwen35 | HfFamily::Qwen35Moe => {
                if flag("attention_bias")? {
                    bail!("'attention_bias' on the gated attention of a hybrid Qwen model is not supported; no published checkpoint sets it");
                }
                (false, false)
            }
        };
        let mlp_bias = match family {
            HfFamily::Llama => flag("mlp_bias")?,
            _ => false,
        };
        let sliding_windows = read_hf_sliding_windows(v, family, num_layers)?;
        let intermediate_size = match (family, v.get("intermediate_size")) {
            // Qwen3.5-MoE has no dense MLP (every layer is a mixture), and
            // its config no `intermediate_size`: the experts' width stands
            // in, so that the shape checks have a value.
            (HfFamily::Qwen35Moe, None | Some(Value::Null)) => usize_of("moe_intermediate_size")?,
            _ => usize_of("intermediate_size")?,
        };
        let moe = read_hf_moe(v, family, num_layers, intermediate_size)?;
        let quant_method = v
            .get("quantization_config")
            .and_then(|q| q.get("quant_method"))
            .and_then(Value::as_str);
        if quant_method == Some("mxfp4") && family != HfFamily::GptOss {
            bail!("'quantization_config.quant_method' 'mxfp4' is read for gpt-oss's experts only, not for this architecture");
        }
        let mla = read_hf_mla(v, family, &rope_scaling)?;
        let hybrid = match hybrid_family {
            true => Some(read_hf_hybrid(
                v,
                family,
                num_layers,
                head_dim,
                rotary_factor,
                &rope_scaling,
            )?),
            false => None,
        };
        // DeepSeek's heads: the RoPE table covers the rotary part only, and
        // the latent cache has one KV head.
        let (head_dim, num_kv_heads) = match &mla {
            Some(m) => (m.qk_rope_head_dim, num_heads),
            None => (head_dim, num_kv_heads),
        };
        let rope_style = match family {
            // DeepSeek rotates adjacent pairs: V2 as complex numbers, V3
            // with `rope_interleave` (its default).
            HfFamily::DeepseekV2 => RopeStyle::Interleaved,
            HfFamily::DeepseekV3 => match v.get("rope_interleave") {
                Some(Value::Bool(false)) => RopeStyle::Neox,
                None | Some(Value::Null) | Some(Value::Bool(true)) => RopeStyle::Interleaved,
                Some(other) => bail!("'rope_interleave' must be true or false, got {other}"),
            },
            _ => RopeStyle::Neox,
        };
        let cfg = ModelConfig {
            arch,
            hidden_size,
            num_layers,
            num_heads,
            num_kv_heads,
            head_dim,
            intermediate_size,
            vocab_size: usize_of("vocab_size")?,
            rms_norm_eps: f32_of("rms_norm_eps", 1e-6)?,
            rope_theta,
            rope_scaling,
            rope_style,
            max_position_embeddings,
            // `Gemma3TextConfig` ties them by default; the others do not.
            tie_word_embeddings: v
                .get("tie_word_embeddings")
                .and_then(Value::as_bool)
                .unwrap_or(gemma_family),
            attention_bias,
            o_bias,
            mlp_bias,
            sliding_windows,
            moe,
            mla,
            hybrid,
            hidden_act,
            gemma,
            // gpt-oss's own keys are read by `models::gpt_oss::hf_config`.
            gpt_oss: None,
            encoder: None,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// The smallest attention window of any layer, if any layer has one.
    pub fn min_sliding_window(&self) -> Option<usize> {
        self.sliding_windows.iter().flatten().copied().min()
    }

    /// The attention window of layer `i` (`None`: full attention).
    pub fn sliding_window(&self, layer: usize) -> Option<usize> {
        self.sliding_windows.get(layer).copied().flatten()
    }

    /// Reads the shape of a Llama-like decoder (`llama`, `mistral`,
    /// `qwen2`, `qwen3`, `qwen2moe`, `qwen3moe`) from GGUF metadata
    /// (`{name}.*` keys): `arch` as the registry names it, a `llama` file
    /// with experts being Mixtral.
    pub fn from_gguf_decoder(g: &GgufFile, name: &str, arch: Arch) -> Result<ModelConfig> {
        let m = GgufMeta::new(g, name);
        let experts = m.opt("expert_count")?.unwrap_or(0);
        let arch = match arch {
            Arch::Llama | Arch::Mixtral if experts > 0 => Arch::Mixtral,
            Arch::Llama | Arch::Mixtral => Arch::Llama,
            other => other,
        };
        let hidden_size = m.req("embedding_length")?;
        let num_heads = m.req("attention.head_count")?;
        let num_kv_heads = m.opt("attention.head_count_kv")?.unwrap_or(num_heads);
        let head_dim = match m.opt("attention.key_length")? {
            Some(x) => x,
            None if num_heads > 0 => hidden_size / num_heads,
            None => bail!("attention.head_count is 0"),
        };
        // The rotary embedding covers whole heads in every architecture
        // served here; a file that says otherwise (0 included) would be
        // computed wrongly, so it is refused rather than ignored.
        if let Some(n) = m.opt("rope.dimension_count")? {
            if n != head_dim {
                bail!(
                    "{} is {n}, but the attention heads are {head_dim} wide; only a rotary embedding over whole heads is supported",
                    m.key("rope.dimension_count")
                );
            }
        }
        let vocab_size = m.vocab_size()?;
        let rope_scaling = match m.str("rope.scaling.type")? {
            None | Some("none") => RopeScaling::None,
            Some("linear") => RopeScaling::Linear {
                factor: m.f32("rope.scaling.factor")?.unwrap_or(1.0),
            },
            Some(other) => {
                bail!("rope scaling '{other}' is not supported (supported: none, linear)")
            }
        };
        // llama.cpp's converter turns a Llama 3.1 `rope_scaling` into one
        // divisor per rotary pair, stored as the tensor `rope_freqs.weight`.
        let rope_scaling = match g.tensors().iter().find(|t| t.name == "rope_freqs.weight") {
            None => rope_scaling,
            Some(info) => {
                if !rope_scaling.is_none() {
                    bail!(
                        "both rope_freqs.weight and {} are set; only one RoPE scaling is supported",
                        m.key("rope.scaling.type")
                    );
                }
                let t = g.tensor(&info.name)?;
                let n = t.shape.iter().product::<usize>();
                let f = pagoda_accel::HostMatrix::new(t.ty, 1, n, t.data)
                    .and_then(|m| m.dequantize())
                    .context("tensor 'rope_freqs.weight'")?;
                RopeScaling::Factors(f)
            }
        };
        let tie_word_embeddings = !g.tensors().iter().any(|t| t.name == "output.weight");
        let num_layers = m.block_count()?;
        let sliding_windows = match m.opt("attention.sliding_window")? {
            Some(w) if w > 0 => vec![Some(w); num_layers],
            _ => Vec::new(),
        };
        let intermediate_size = m.req("feed_forward_length")?;
        let moe = match arch {
            Arch::Mixtral | Arch::Qwen2Moe | Arch::Qwen3Moe => {
                let n_experts = experts;
                let top_k = m.req("expert_used_count")?;
                if n_experts > 1 << 12 {
                    bail!(
                        "{} = {n_experts} is beyond the supported maximum of 4096",
                        m.key("expert_count")
                    );
                }
                if top_k == 0 || top_k > n_experts {
                    bail!(
                        "{} = {top_k} must be between 1 and {} ({n_experts})",
                        m.key("expert_used_count"),
                        m.key("expert_count")
                    );
                }
                let expert_ffn = match arch {
                    Arch::Mixtral => intermediate_size,
                    _ => m.req("expert_feed_forward_length")?,
                };
                let shared_ffn = match arch {
                    Arch::Qwen2Moe => m
                        .opt("expert_shared_feed_forward_length")?
                        .filter(|&f| f > 0),
                    _ => None,
                };
                Some(MoeConfig {
                    n_experts,
                    top_k,
                    // As llama.cpp builds these architectures: Mixtral and
                    // Qwen3-MoE renormalize the chosen weights, Qwen2-MoE
                    // does not.
                    normalize: arch != Arch::Qwen2Moe,
                    expert_ffn,
                    shared_ffn,
                    // A layer is a mixture where the file has its router.
                    sparse_layers: (0..num_layers)
                        .map(|i| m.has(&format!("blk.{i}.ffn_gate_inp.weight")))
                        .collect(),
                    scoring: RouterScoring::Softmax,
                    routed_scale: 1.0,
                    groups: None,
                    score_bias: false,
                    shared_gated: true,
                })
            }
            _ => None,
        };
        let cfg = ModelConfig {
            arch,
            hidden_size,
            num_layers,
            num_heads,
            num_kv_heads,
            head_dim,
            intermediate_size,
            vocab_size,
            rms_norm_eps: m.f32("attention.layer_norm_rms_epsilon")?.unwrap_or(1e-5),
            rope_theta: m.f32("rope.freq_base")?.unwrap_or(10_000.0),
            rope_scaling,
            // llama.cpp's converter permutes the q/k rows of llama-arch
            // models so that rotation pairs are adjacent; qwen2 keeps HF's
            // half-split layout.
            rope_style: if matches!(arch, Arch::Llama | Arch::Mixtral) {
                RopeStyle::Interleaved
            } else {
                RopeStyle::Neox
            },
            max_position_embeddings: m.opt("context_length")?.unwrap_or(2048),
            tie_word_embeddings,
            attention_bias: arch == Arch::Qwen2 || m.has("blk.0.attn_q.bias"),
            o_bias: m.has("blk.0.attn_output.bias"),
            mlp_bias: m.has("blk.0.ffn_down.bias"),
            sliding_windows,
            moe,
            mla: None,
            hybrid: None,
            hidden_act: Activation::Silu,
            gemma: None,
            gpt_oss: None,
            encoder: None,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Rejects shapes the kernels cannot run, with the reason.
    pub fn validate(&self) -> Result<()> {
        let positive = [
            ("hidden_size", self.hidden_size),
            ("num_hidden_layers", self.num_layers),
            ("num_attention_heads", self.num_heads),
            ("num_key_value_heads", self.num_kv_heads),
            ("head_dim", self.head_dim),
            ("intermediate_size", self.intermediate_size),
            ("vocab_size", self.vocab_size),
            ("max_position_embeddings", self.max_position_embeddings),
        ];
        for (name, x) in positive {
            if x == 0 {
                bail!("'{name}' must be positive");
            }
        }
        // Bounds far above any real model, so a corrupt or hostile config
        // fails here instead of in a giant allocation.
        let limits = [
            ("num_hidden_layers", self.num_layers, MAX_LAYERS),
            ("hidden_size", self.hidden_size, 1 << 17),
            ("intermediate_size", self.intermediate_size, 1 << 19),
            ("num_attention_heads", self.num_heads, 1 << 10),
            ("vocab_size", self.vocab_size, 1 << 22),
            (
                "max_position_embeddings",
                self.max_position_embeddings,
                MAX_CONTEXT,
            ),
        ];
        for (name, x, max) in limits {
            if x > max {
                bail!("'{name}' = {x} is beyond the supported maximum of {max}");
            }
        }
        self.check_rope_scaling(&self.rope_scaling)?;
        if let Some(g) = &self.gemma {
            self.check_rope_scaling(&g.local_rope_scaling)?;
            if !(g.local_rope_theta.is_finite() && g.local_rope_theta > 0.0) {
                bail!(
                    "the local layers' RoPE base {} must be a positive number",
                    g.local_rope_theta
                );
            }
            if !(g.attn_scale.is_finite() && g.attn_scale > 0.0) {
                bail!("query_pre_attn_scalar must be a positive number");
            }
            if let Some(cap) = g.final_logit_softcap {
                if !(cap.is_finite() && cap > 0.0) {
                    bail!("final_logit_softcapping {cap} must be a positive number");
                }
            }
        }
        if !self.num_heads.is_multiple_of(self.num_kv_heads) {
            bail!(
                "num_attention_heads ({}) must be a multiple of num_key_value_heads ({})",
                self.num_heads,
                self.num_kv_heads
            );
        }
        if self.num_heads / self.num_kv_heads > 16 {
            bail!(
                "a GQA group of {} query heads per KV head is more than the 16 supported",
                self.num_heads / self.num_kv_heads
            );
        }
        if !self.head_dim.is_multiple_of(2) || self.head_dim > 256 {
            bail!(
                "head_dim {} is not supported (must be even and at most 256)",
                self.head_dim
            );
        }
        if !self.sliding_windows.is_empty() && self.sliding_windows.len() != self.num_layers {
            bail!(
                "{} attention windows for {} layers",
                self.sliding_windows.len(),
                self.num_layers
            );
        }
        if self.sliding_windows.contains(&Some(0)) {
            bail!("a sliding window of 0 tokens would let a token see nothing");
        }
        if let Some(h) = &self.hybrid {
            if h.linear_layers.len() != self.num_layers {
                bail!(
                    "the layer types list {} layers, but the model has {}",
                    h.linear_layers.len(),
                    self.num_layers
                );
            }
            if h.linear_layers.iter().all(|&l| l) {
                // The KV pool and the engine's capacity figures are per
                // attention layer; a model of linear layers only has none.
                bail!("'layer_types' lists no full_attention layer; a model of linear-attention layers only is not supported");
            }
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 0.0) {
            bail!("rope_theta {} must be a positive number", self.rope_theta);
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps >= 0.0) {
            bail!(
                "rms_norm_eps {} must be a non-negative number",
                self.rms_norm_eps
            );
        }
        Ok(())
    }

    /// Checks a RoPE scaling's parameters.
    fn check_rope_scaling(&self, scaling: &RopeScaling) -> Result<()> {
        match *scaling {
            RopeScaling::None => {}
            RopeScaling::Linear { factor } => {
                if !(factor.is_finite() && factor > 0.0) {
                    bail!("rope_scaling factor {factor} must be a positive number");
                }
            }
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position,
            } => {
                if !(factor.is_finite() && factor > 0.0) {
                    bail!("rope_scaling factor {factor} must be a positive number");
                }
                if !(low_freq_factor > 0.0
                    && high_freq_factor > low_freq_factor
                    && high_freq_factor.is_finite())
                {
                    bail!("llama3 rope_scaling needs 0 < low_freq_factor < high_freq_factor, got {low_freq_factor} and {high_freq_factor}");
                }
                if original_max_position == 0 {
                    bail!("llama3 rope_scaling needs a positive original_max_position_embeddings");
                }
            }
            RopeScaling::Factors(ref f) => {
                if f.len() != self.head_dim / 2 {
                    bail!(
                        "rope_freqs.weight holds {} factors, but heads of {} have {} rotary pairs",
                        f.len(),
                        self.head_dim,
                        self.head_dim / 2
                    );
                }
                if let Some(x) = f.iter().find(|x| !(x.is_finite() && **x > 0.0)) {
                    bail!("rope_freqs.weight holds {x}; every factor must be a positive number");
                }
            }
            RopeScaling::Yarn {
                factor,
                original_max_position,
                beta_fast,
                beta_slow,
                attention_factor,
                ..
            } => {
                if !(factor.is_finite() && factor > 0.0) {
                    bail!("yarn rope scaling factor {factor} must be a positive number");
                }
                if original_max_position == 0 {
                    bail!("yarn rope scaling needs a positive original_max_position_embeddings");
                }
                if !(beta_fast.is_finite()
                    && beta_slow.is_finite()
                    && beta_fast > 0.0
                    && beta_slow > 0.0)
                {
                    bail!(
                        "yarn beta_fast ({beta_fast}) and beta_slow ({beta_slow}) must be positive"
                    );
                }
                if !(attention_factor.is_finite() && attention_factor > 0.0) {
                    bail!("yarn attention_factor {attention_factor} must be a positive number");
                }
            }
        }
        Ok(())
    }

    /// Width of the query projection output.
    pub fn q_dim(&self) -> usize {
        self.num_heads * self.head_dim
    }

    /// Width of the key (and value) projection output.
    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }
}

/// The `{arch}.*` metadata of a GGUF file, which every GGUF config reader
/// reads the same way: keys by their suffix (`m.req("block_count")` reads
/// `llama.block_count`), each error naming the whole key.
pub struct GgufMeta<'a> {
    pub g: &'a GgufFile,
    arch: &'a str,
}

impl<'a> GgufMeta<'a> {
    /// The keys of `g` under `arch` (its `general.architecture`).
    pub fn new(g: &'a GgufFile, arch: &'a str) -> Self {
        GgufMeta { g, arch }
    }

    /// The whole key: `{arch}.{k}`.
    pub fn key(&self, k: &str) -> String {
        format!("{}.{k}", self.arch)
    }

    /// An integer key, if present.
    pub fn opt(&self, k: &str) -> Result<Option<usize>> {
        self.g
            .get_u64(&self.key(k))?
            .map(|x| usize::try_from(x).with_context(|| format!("'{}' is too large", self.key(k))))
            .transpose()
    }

    /// An integer key that must be present.
    pub fn req(&self, k: &str) -> Result<usize> {
        self.opt(k)?
            .with_context(|| format!("missing metadata '{}'", self.key(k)))
    }

    /// A float key, if present.
    pub fn f32(&self, k: &str) -> Result<Option<f32>> {
        self.g.get_f32(&self.key(k))
    }

    /// A string key, if present.
    pub fn str(&self, k: &str) -> Result<Option<&'a str>> {
        self.g.get_str(&self.key(k))
    }

    /// A bool key, if present.
    pub fn bool(&self, k: &str) -> Result<Option<bool>> {
        self.g.get_bool(&self.key(k))
    }

    /// Whether the file holds tensor `name`.
    pub fn has(&self, name: &str) -> bool {
        self.g.tensors().iter().any(|t| t.name == name)
    }

    /// `block_count`, at most [`MAX_LAYERS`] (checked before anything is
    /// sized by it).
    pub fn block_count(&self) -> Result<usize> {
        let n = self.req("block_count")?;
        if n > MAX_LAYERS {
            bail!(
                "{} = {n} is beyond the supported maximum of {MAX_LAYERS}",
                self.key("block_count")
            );
        }
        Ok(n)
    }

    /// `vocab_size`, else the number of the tokenizer's tokens.
    pub fn vocab_size(&self) -> Result<usize> {
        match self.opt("vocab_size")? {
            Some(x) => Ok(x),
            None => self
                .g
                .get_str_array("tokenizer.ggml.tokens")?
                .map(|t| t.len())
                .context("no vocab_size and no tokenizer"),
        }
    }
}

/// The decoder families whose `config.json` is read here; they differ in
/// which keys their modeling code honours.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HfFamily {
    Llama,
    Mistral,
    Qwen2,
    Qwen3,
    Mixtral,
    Qwen2Moe,
    Qwen3Moe,
    DeepseekV2,
    DeepseekV3,
    Qwen3Next,
    Qwen35,
    Qwen35Moe,
    Gemma3,
    GptOss,
}

/// The integer `key` of a config, which must be present (the readers of
/// every family share it, so a missing or mistyped count reads the same).
pub(crate) fn required_count(v: &Value, key: &str) -> Result<usize> {
    let x = v
        .get(key)
        .with_context(|| format!("missing '{key}'"))?
        .as_u64()
        .with_context(|| format!("'{key}' must be a positive integer"))?;
    usize::try_from(x).with_context(|| format!("'{key}' is too large"))
}

/// The integer `key` of a config, absent or null as `None`; a value below
/// `min` (or not an integer) is refused with the key named.
fn optional_count(v: &Value, key: &str, min: u64) -> Result<Option<usize>> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(x) => match x.as_u64().filter(|&n| n >= min) {
            Some(n) => Ok(Some(n as usize)),
            None if min == 0 => bail!("'{key}' must be a non-negative integer, got {x}"),
            None => bail!("'{key}' must be a positive integer, got {x}"),
        },
    }
}

/// YaRN's magnitude correction, `0.1 · mscale · ln(scale) + 1` (1 when the
/// context is not extended), as DeepSeek and transformers define it.
pub fn yarn_mscale(scale: f64, mscale: f64) -> f64 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * mscale * scale.ln() + 1.0
    }
}

/// DeepSeek's latent attention: `q_lora_rank` (null: a full `q_proj`),
/// `kv_lora_rank`, the nope/rope head split and `v_head_dim`; and the
/// softmax scale's YaRN correction, `mscale(factor, mscale_all_dim)²`, as
/// DeepSeek's own code and vLLM apply it for V2 and V3.
fn read_hf_mla(v: &Value, family: HfFamily, rope: &RopeScaling) -> Result<Option<MlaConfig>> {
    if !matches!(family, HfFamily::DeepseekV2 | HfFamily::DeepseekV3) {
        return Ok(None);
    }
    let int = |key: &str| optional_count(v, key, 1);
    let req =
        |key: &str| -> Result<usize> { int(key)?.with_context(|| format!("missing '{key}'")) };
    let mla = MlaConfig {
        q_lora_rank: int("q_lora_rank")?,
        kv_lora_rank: req("kv_lora_rank")?,
        qk_nope_head_dim: req("qk_nope_head_dim")?,
        qk_rope_head_dim: req("qk_rope_head_dim")?,
        v_head_dim: req("v_head_dim")?,
        softmax_mscale: {
            let params = v
                .get("rope_parameters")
                .filter(|p| p.is_object())
                .or_else(|| v.get("rope_scaling").filter(|p| p.is_object()));
            match (rope, params) {
                (RopeScaling::Yarn { .. }, Some(p)) => {
                    let all_dim = p
                        .get("mscale_all_dim")
                        .and_then(Value::as_f64)
                        .unwrap_or(0.0);
                    let factor = p.get("factor").and_then(Value::as_f64).unwrap_or(1.0);
                    if all_dim != 0.0 {
                        let m = yarn_mscale(factor, all_dim);
                        (m * m) as f32
                    } else {
                        1.0
                    }
                }
                _ => 1.0,
            }
        },
    };
    if let Some(qk) = int("qk_head_dim")? {
        if qk != mla.qk_nope_head_dim + mla.qk_rope_head_dim {
            bail!(
                "'qk_head_dim' ({qk}) is not qk_nope_head_dim + qk_rope_head_dim ({} + {})",
                mla.qk_nope_head_dim,
                mla.qk_rope_head_dim
            );
        }
    }
    if mla.latent_width() > pagoda_accel::ops::mla::MAX_LATENT {
        bail!(
            "kv_lora_rank + qk_rope_head_dim = {} is beyond the supported maximum of {}",
            mla.latent_width(),
            pagoda_accel::ops::mla::MAX_LATENT
        );
    }
    if !mla.qk_rope_head_dim.is_multiple_of(2) {
        bail!(
            "'qk_rope_head_dim' must be even, got {}",
            mla.qk_rope_head_dim
        );
    }
    Ok(Some(mla))
}

/// The mixture of experts of the MoE families: Mixtral's
/// `num_local_experts` experts of `intermediate_size` in every layer,
/// always renormalized; Qwen-MoE's `num_experts` (transformers 5 may write
/// `num_local_experts`) of `moe_intermediate_size` in the layers that
/// `decoder_sparse_step` and `mlp_only_layers` pick, renormalized with
/// `norm_topk_prob`, and Qwen2-MoE's shared expert.
fn read_hf_moe(
    v: &Value,
    family: HfFamily,
    num_layers: usize,
    intermediate_size: usize,
) -> Result<Option<MoeConfig>> {
    if !matches!(
        family,
        HfFamily::Mixtral
            | HfFamily::Qwen2Moe
            | HfFamily::Qwen3Moe
            | HfFamily::DeepseekV2
            | HfFamily::DeepseekV3
            | HfFamily::Qwen3Next
            | HfFamily::Qwen35Moe
            | HfFamily::GptOss
    ) {
        return Ok(None);
    }
    let int = |key: &str| optional_count(v, key, 0);
    let n_experts = match (
        int("num_experts")?.or(int("n_routed_experts")?),
        int("num_local_experts")?,
    ) {
        (Some(a), Some(b)) if a != b => {
            bail!("'num_experts' ({a}) and 'num_local_experts' ({b}) disagree")
        }
        (Some(a), _) | (None, Some(a)) => a,
        (None, None) => {
            bail!("a mixture-of-experts config needs 'num_local_experts' or 'num_experts'")
        }
    };
    let top_k = int("num_experts_per_tok")?.context("missing 'num_experts_per_tok'")?;
    if n_experts == 0 || n_experts > 1 << 12 {
        bail!("'num_experts' = {n_experts} must be between 1 and 4096");
    }
    if top_k == 0 || top_k > n_experts {
        bail!("'num_experts_per_tok' = {top_k} must be between 1 and the number of experts ({n_experts})");
    }
    let moe = match family {
        HfFamily::Mixtral => MoeConfig {
            n_experts,
            top_k,
            normalize: true,
            expert_ffn: intermediate_size,
            shared_ffn: None,
            sparse_layers: vec![true; num_layers],
            scoring: RouterScoring::Softmax,
            routed_scale: 1.0,
            groups: None,
            score_bias: false,
            shared_gated: false,
        },
        HfFamily::DeepseekV2 | HfFamily::DeepseekV3 => {
            read_deepseek_moe(v, family, num_layers, n_experts, top_k)?
        }
        // gpt-oss: experts of `intermediate_size` in every layer, the top-k
        // of the (biased) router logits weighted by their own softmax.
        // OpenAI's configs repeat the top-k as `experts_per_token`.
        HfFamily::GptOss if int("experts_per_token")?.is_some_and(|k| k != top_k) => bail!(
            "'experts_per_token' ({}) and 'num_experts_per_tok' ({top_k}) disagree",
            int("experts_per_token")?.unwrap_or(0)
        ),
        HfFamily::GptOss => MoeConfig {
            n_experts,
            top_k,
            normalize: false,
            expert_ffn: intermediate_size,
            shared_ffn: None,
            sparse_layers: vec![true; num_layers],
            scoring: RouterScoring::TopKSoftmax,
            routed_scale: 1.0,
            groups: None,
            score_bias: false,
            shared_gated: false,
        },
        // transformers' Qwen3.5-MoE config has no `decoder_sparse_step`,
        // `mlp_only_layers` or `norm_topk_prob`: every layer is a mixture,
        // its router always renormalizes, and its shared expert is gated.
        HfFamily::Qwen35Moe => MoeConfig {
            n_experts,
            top_k,
            normalize: true,
            expert_ffn: int("moe_intermediate_size")?.context("missing 'moe_intermediate_size'")?,
            shared_ffn: Some(
                int("shared_expert_intermediate_size")?
                    .context("missing 'shared_expert_intermediate_size'")?,
            )
            .filter(|&f| f > 0),
            sparse_layers: vec![true; num_layers],
            scoring: RouterScoring::Softmax,
            routed_scale: 1.0,
            groups: None,
            score_bias: false,
            shared_gated: true,
        },
        _ => {
            let step = int("decoder_sparse_step")?.unwrap_or(1);
            if step == 0 {
                bail!("'decoder_sparse_step' must be positive");
            }
            let dense: Vec<usize> = match v.get("mlp_only_layers") {
                None | Some(Value::Null) => Vec::new(),
                Some(Value::Array(a)) => a
                    .iter()
                    .map(|x| {
                        x.as_u64().map(|x| x as usize).with_context(|| {
                            format!("'mlp_only_layers' entries must be layer indices, got {x}")
                        })
                    })
                    .collect::<Result<_>>()?,
                Some(other) => bail!("'mlp_only_layers' must be a list, got {other}"),
            };
            let normalize = match v.get("norm_topk_prob") {
                // Qwen3-Next's config class defaults it to true, the
                // Qwen2/3-MoE ones to false.
                None | Some(Value::Null) => family == HfFamily::Qwen3Next,
                Some(Value::Bool(b)) => *b,
                Some(other) => bail!("'norm_topk_prob' must be true or false, got {other}"),
            };
            let expert_ffn =
                int("moe_intermediate_size")?.context("missing 'moe_intermediate_size'")?;
            let shared_ffn = match family {
                HfFamily::Qwen2Moe | HfFamily::Qwen3Next => Some(
                    int("shared_expert_intermediate_size")?
                        .context("missing 'shared_expert_intermediate_size'")?,
                )
                .filter(|&f| f > 0),
                _ => None,
            };
            MoeConfig {
                n_experts,
                top_k,
                normalize,
                expert_ffn,
                shared_ffn,
                sparse_layers: (0..num_layers)
                    .map(|i| !dense.contains(&i) && (i + 1) % step == 0)
                    .collect(),
                scoring: RouterScoring::Softmax,
                routed_scale: 1.0,
                groups: None,
                score_bias: false,
                shared_gated: true,
            }
        }
    };
    if moe.expert_ffn == 0 || moe.expert_ffn > 1 << 19 {
        bail!(
            "the experts' intermediate size {} must be between 1 and {}",
            moe.expert_ffn,
            1 << 19
        );
    }
    if moe.shared_ffn.is_some_and(|f| f > 1 << 19) {
        bail!(
            "'shared_expert_intermediate_size' is beyond the supported maximum of {}",
            1 << 19
        );
    }
    Ok(Some(moe))
}

/// DeepSeek's experts: `n_routed_experts` of `moe_intermediate_size` from
/// layer `first_k_dense_replace` on, `n_shared_experts` of them shared;
/// V2 routes by softmax (`topk_method` greedy, or group_limited_greedy over
/// `n_group` groups scored by their best), V3 by sigmoid with the
/// router's `e_score_correction_bias` and groups scored by their two best;
/// `norm_topk_prob` and `routed_scaling_factor` weigh the choice.
fn read_deepseek_moe(
    v: &Value,
    family: HfFamily,
    num_layers: usize,
    n_experts: usize,
    top_k: usize,
) -> Result<MoeConfig> {
    let int = |key: &str| optional_count(v, key, 0);
    if let Some(f) = int("moe_layer_freq")? {
        if f != 1 {
            bail!("'moe_layer_freq' = {f}: only every layer after first_k_dense_replace being a mixture (1) is supported");
        }
    }
    let first_dense = int("first_k_dense_replace")?.unwrap_or(0);
    let expert_ffn = int("moe_intermediate_size")?.context("missing 'moe_intermediate_size'")?;
    let shared_ffn = int("n_shared_experts")?
        .filter(|&n| n > 0)
        .map(|n| n * expert_ffn);
    let scoring = match v.get("scoring_func").and_then(Value::as_str) {
        None => match family {
            HfFamily::DeepseekV3 => RouterScoring::Sigmoid,
            _ => RouterScoring::Softmax,
        },
        Some("softmax") => RouterScoring::Softmax,
        Some("sigmoid") => RouterScoring::Sigmoid,
        Some(other) => bail!("'scoring_func' '{other}' is not supported (softmax, sigmoid)"),
    };
    let method = v.get("topk_method").and_then(Value::as_str);
    let n_group = int("n_group")?;
    let topk_group = int("topk_group")?;
    let group_score = match (family, method) {
        (HfFamily::DeepseekV3, None | Some("noaux_tc")) => Some(GroupScore::SumTop2),
        (HfFamily::DeepseekV2, None | Some("greedy")) => None,
        (HfFamily::DeepseekV2, Some("group_limited_greedy")) => Some(GroupScore::Max),
        (_, Some(other)) => bail!("'topk_method' '{other}' is not supported for this architecture"),
        _ => None,
    };
    let groups = match (group_score, n_group, topk_group) {
        (Some(score), Some(n_group), Some(topk_group)) if n_group > 1 => Some(GroupLimit {
            n_group,
            topk_group,
            score,
        }),
        (Some(GroupScore::Max), _, _) => {
            bail!("'topk_method' group_limited_greedy needs 'n_group' and 'topk_group'")
        }
        _ => None,
    };
    let routed_scale = match v.get("routed_scaling_factor") {
        None | Some(Value::Null) => 1.0,
        Some(x) => x
            .as_f64()
            .filter(|x| x.is_finite())
            .with_context(|| format!("'routed_scaling_factor' must be a number, got {x}"))?
            as f32,
    };
    let normalize = match v.get("norm_topk_prob") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(other) => bail!("'norm_topk_prob' must be true or false, got {other}"),
    };
    let moe = MoeConfig {
        n_experts,
        top_k,
        normalize,
        expert_ffn,
        shared_ffn,
        sparse_layers: (0..num_layers).map(|i| i >= first_dense).collect(),
        scoring,
        routed_scale,
        groups,
        score_bias: family == HfFamily::DeepseekV3,
        shared_gated: false,
    };
    let spec = pagoda_accel::ops::RouterSpec {
        n_experts,
        top_k,
        scoring,
        normalize,
        scale: routed_scale,
        groups,
    };
    if let Err(why) = spec.check() {
        bail!("{why}");
    }
    Ok(moe)
}

/// RoPE's base and scaling, from either form transformers writes:
/// transformers 5's `rope_parameters` (`rope_theta` and `rope_type` inside)
/// or transformers 4's top-level `rope_theta` and `rope_scaling`. A value
/// that both forms give must agree; a scaling that is not implemented, and
/// a `partial_rotary_factor` below 1, are refused with the key named.
///
/// With `partial_ok` (the hybrid Qwen families), a `partial_rotary_factor`
/// in (0, 1] is returned instead (1 where none is given).
fn read_hf_rope(
    v: &Value,
    max_position_embeddings: usize,
    partial_ok: bool,
) -> Result<(f32, RopeScaling, f32)> {
    let params = match v.get("rope_parameters") {
        None | Some(Value::Null) => None,
        Some(Value::Object(o)) => Some(o),
        Some(other) => bail!("'rope_parameters' must be an object, got {other}"),
    };
    if let Some(p) = params {
        // transformers 5 nests one set per attention type (Gemma 3 style)
        // when the layer types differ in RoPE; nothing here builds that.
        if p.values().any(Value::is_object) {
            bail!("'rope_parameters' holds one set per layer type ({}); per-layer-type RoPE is not supported",
                p.keys().cloned().collect::<Vec<_>>().join(", "));
        }
    }
    let number = |x: &Value, what: &str| -> Result<f32> {
        x.as_f64()
            .map(|x| x as f32)
            .with_context(|| format!("'{what}' must be a number, got {x}"))
    };
    let top_theta = match v.get("rope_theta") {
        None | Some(Value::Null) => None,
        Some(x) => Some(number(x, "rope_theta")?),
    };
    let nested_theta = match params.and_then(|p| p.get("rope_theta")) {
        None | Some(Value::Null) => None,
        Some(x) => Some(number(x, "rope_parameters.rope_theta")?),
    };
    let theta = match (nested_theta, top_theta) {
        (Some(a), Some(b)) if a != b => bail!(
            "'rope_parameters.rope_theta' ({a}) and 'rope_theta' ({b}) disagree; remove the stale one"
        ),
        (Some(a), _) | (None, Some(a)) => a,
        // transformers' own default for these families.
        (None, None) => 10_000.0,
    };
    let mut partial: Option<(f32, &str)> = None;
    for (what, factor) in [
        ("partial_rotary_factor", v.get("partial_rotary_factor")),
        (
            "rope_parameters.partial_rotary_factor",
            params.and_then(|p| p.get("partial_rotary_factor")),
        ),
    ] {
        if let Some(f) = factor.filter(|f| !f.is_null()) {
            let f = number(f, what)?;
            if !partial_ok && f != 1.0 {
                bail!("'{what}' is {f}: RoPE over part of each head is not supported for this architecture (only 1.0)");
            }
            if !(f > 0.0 && f <= 1.0) {
                bail!("'{what}' is {f}: it must be in (0, 1]");
            }
            if let Some((g, other)) = partial {
                if g != f {
                    bail!("'{what}' ({f}) and '{other}' ({g}) disagree; remove the stale one");
                }
            }
            partial = Some((f, what));
        }
    }
    let partial = partial.map_or(1.0, |(f, _)| f);
    // transformers 5 keeps the scaling inside `rope_parameters`; 4 in
    // `rope_scaling`.
    let (scaling, key) = match params {
        Some(p) => (Some(p), "rope_parameters"),
        None => match v.get("rope_scaling") {
            None | Some(Value::Null) => (None, "rope_scaling"),
            Some(Value::Object(o)) => (Some(o), "rope_scaling"),
            Some(other) => bail!("'rope_scaling' must be an object, got {other}"),
        },
    };
    let Some(obj) = scaling else {
        return Ok((theta, RopeScaling::None, partial));
    };
    let kind = obj
        .get("rope_type")
        .or_else(|| obj.get("type"))
        .and_then(Value::as_str)
        .unwrap_or("default");
    let num = |k: &str| -> Result<f32> {
        let x = obj
            .get(k)
            .filter(|x| !x.is_null())
            .with_context(|| format!("{key} of type '{kind}' needs '{k}'"))?;
        number(x, &format!("{key}.{k}"))
    };
    let scaling = match kind {
        "default" => RopeScaling::None,
        "linear" => RopeScaling::Linear {
            factor: num("factor")?,
        },
        "llama3" => RopeScaling::Llama3 {
            factor: num("factor")?,
            low_freq_factor: num("low_freq_factor")?,
            high_freq_factor: num("high_freq_factor")?,
            original_max_position: num("original_max_position_embeddings")? as usize,
        },
        "yarn" => {
            let factor = num("factor")?;
            let opt = |k: &str| -> Result<Option<f32>> {
                match obj.get(k) {
                    None | Some(Value::Null) => Ok(None),
                    Some(x) => Ok(Some(number(x, &format!("{key}.{k}"))?)),
                }
            };
            let original = opt("original_max_position_embeddings")?
                .map_or(max_position_embeddings, |o| o as usize);
            // transformers derives the factor from the two lengths when the
            // original is given; DeepSeek and vLLM read `factor`. They agree
            // on every published config; where they would not, refuse.
            if obj.contains_key("original_max_position_embeddings")
                && (max_position_embeddings as f64 / original as f64 - factor as f64).abs() > 1e-6
            {
                bail!(
                    "{key}: yarn factor {factor} is not max_position_embeddings / original_max_position_embeddings ({max_position_embeddings} / {original}), and transformers and vLLM would compute different models; set max_position_embeddings to factor × original_max_position_embeddings"
                );
            }
            let mscale = opt("mscale")?.unwrap_or(0.0) as f64;
            let mscale_all_dim = opt("mscale_all_dim")?.unwrap_or(0.0) as f64;
            let attention_factor = match opt("attention_factor")? {
                Some(a) => a,
                None if mscale != 0.0 && mscale_all_dim != 0.0 => {
                    (yarn_mscale(factor as f64, mscale) / yarn_mscale(factor as f64, mscale_all_dim))
                        as f32
                }
                None => yarn_mscale(factor as f64, 1.0) as f32,
            };
            let truncate = match obj.get("truncate") {
                None | Some(Value::Null) => true,
                Some(Value::Bool(b)) => *b,
                Some(other) => bail!("{key}.truncate must be true or false, got {other}"),
            };
            RopeScaling::Yarn {
                factor,
                original_max_position: original,
                beta_fast: opt("beta_fast")?.filter(|&b| b != 0.0).unwrap_or(32.0),
                beta_slow: opt("beta_slow")?.filter(|&b| b != 0.0).unwrap_or(1.0),
                attention_factor,
                truncate,
            }
        }
        other => bail!(
            "{key}: rope_type '{other}' is not supported yet (supported: default, linear, llama3, yarn)"
        ),
    };
    Ok((theta, scaling, partial))
}

/// Gemma 3's RoPE: one set for the global (`full_attention`) layers and one
/// for the local (`sliding_attention`) ones, each `(base, scaling)`. From
/// transformers 5's `rope_parameters` keyed by layer type, or 4's
/// `rope_theta` and `rope_scaling` (global; default base 1e6) and
/// `rope_local_base_freq` (local, unscaled; default 1e4). Stale keys of the
/// other form must agree.
fn read_gemma_rope(
    v: &Value,
    max_position_embeddings: usize,
) -> Result<((f32, RopeScaling), (f32, RopeScaling))> {
    let number = |key: &str| -> Result<Option<f32>> {
        match v.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(x) => x
                .as_f64()
                .map(|x| Some(x as f32))
                .with_context(|| format!("'{key}' must be a number, got {x}")),
        }
    };
    let local_base = number("rope_local_base_freq")?;
    let nested = v
        .get("rope_parameters")
        .and_then(Value::as_object)
        .filter(|p| p.values().any(Value::is_object));
    let Some(p) = nested else {
        let has_theta = number("rope_theta")?.is_some()
            || v.get("rope_parameters")
                .and_then(|p| p.get("rope_theta"))
                .is_some_and(|t| !t.is_null());
        let (theta, scaling, _) = read_hf_rope(v, max_position_embeddings, false)?;
        let theta = if has_theta { theta } else { 1_000_000.0 };
        return Ok((
            (theta, scaling),
            (local_base.unwrap_or(10_000.0), RopeScaling::None),
        ));
    };
    if let Some(k) = p
        .keys()
        .find(|k| !matches!(k.as_str(), "full_attention" | "sliding_attention"))
    {
        bail!("'rope_parameters' entry '{k}' is not a layer type of Gemma 3 (full_attention, sliding_attention)");
    }
    let one = |t: &str| -> Result<(f32, RopeScaling)> {
        let sub = p
            .get(t)
            .with_context(|| format!("'rope_parameters' has no '{t}' set"))?;
        if !sub.is_object() {
            bail!("'rope_parameters.{t}' must be an object, got {sub}");
        }
        let (theta, scaling, _) = read_hf_rope(
            &serde_json::json!({ "rope_parameters": sub }),
            max_position_embeddings,
            false,
        )
        .with_context(|| format!("'rope_parameters.{t}'"))?;
        Ok((theta, scaling))
    };
    let (global, local) = (one("full_attention")?, one("sliding_attention")?);
    if let Some(t) = number("rope_theta")? {
        if t != global.0 {
            bail!("'rope_parameters.full_attention.rope_theta' ({}) and 'rope_theta' ({t}) disagree; remove the stale one", global.0);
        }
    }
    if let Some(t) = local_base {
        if t != local.0 {
            bail!("'rope_parameters.sliding_attention.rope_theta' ({}) and 'rope_local_base_freq' ({t}) disagree; remove the stale one", local.0);
        }
    }
    if v.get("rope_scaling").is_some_and(|x| !x.is_null()) {
        bail!("'rope_scaling' beside per-layer-type 'rope_parameters': remove the stale one");
    }
    Ok((global, local))
}

/// The rest of [`GemmaConfig`]: `query_pre_attn_scalar` (default 256),
/// `final_logit_softcapping`; refuses `attn_logit_softcapping` and
/// `use_bidirectional_attention`, which are not computed.
fn read_gemma(
    v: &Value,
    local_rope_theta: f32,
    local_rope_scaling: RopeScaling,
) -> Result<GemmaConfig> {
    let number = |key: &str| -> Result<Option<f64>> {
        match v.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(x) => x
                .as_f64()
                .map(Some)
                .with_context(|| format!("'{key}' must be a number, got {x}")),
        }
    };
    if let Some(cap) = number("attn_logit_softcapping")? {
        bail!("'attn_logit_softcapping' ({cap}): soft-capping the attention scores is not computed yet; only null is served");
    }
    match v.get("use_bidirectional_attention") {
        None | Some(Value::Null) | Some(Value::Bool(false)) => {}
        Some(x) => bail!("'use_bidirectional_attention' ({x}): bidirectional attention is not computed; only false is served"),
    }
    let scalar = number("query_pre_attn_scalar")?.unwrap_or(256.0);
    if !(scalar.is_finite() && scalar > 0.0) {
        bail!("'query_pre_attn_scalar' ({scalar}) must be a positive number");
    }
    Ok(GemmaConfig {
        // transformers: `config.query_pre_attn_scalar**-0.5`, a Python
        // float, handed to the attention as its scale.
        attn_scale: scalar.powf(-0.5) as f32,
        local_rope_theta,
        local_rope_scaling,
        final_logit_softcap: number("final_logit_softcapping")?.map(|c| c as f32),
    })
}

/// The attention window of each layer, as the family's modeling code
/// decides it: Mistral puts `sliding_window` on every layer; Qwen2 and
/// Qwen3 only with `use_sliding_window`, on the layers that transformers 5's
/// `layer_types` marks `sliding_attention` (transformers 4: the layers from
/// `max_window_layers` on); Llama has none. Empty: full attention.
fn read_hf_sliding_windows(
    v: &Value,
    family: HfFamily,
    num_layers: usize,
) -> Result<Vec<Option<usize>>> {
    let window = match v.get("sliding_window") {
        // `Gemma3TextConfig`'s default.
        None if family == HfFamily::Gemma3 => Some(4096),
        None | Some(Value::Null) => None,
        // Qwen2-MoE's configs write 0 when the window is off.
        Some(x) => x
            .as_u64()
            .with_context(|| format!("'sliding_window' must be a non-negative integer, got {x}"))
            .map(|w| (w > 0).then_some(w as usize))?,
    };
    if matches!(
        family,
        HfFamily::Qwen3Next | HfFamily::Qwen35 | HfFamily::Qwen35Moe
    ) {
        // Their `layer_types` name linear and full attention (read by
        // `read_hf_hybrid`); their modeling code builds no window.
        if window.is_some() {
            bail!("'sliding_window' on a hybrid Qwen model is not supported: its attention layers attend over the whole context");
        }
        return Ok(Vec::new());
    }
    let layer_types: Option<Vec<&str>> = match v.get("layer_types") {
        None | Some(Value::Null) => None,
        Some(Value::Array(a)) => Some(
            a.iter()
                .map(|t| {
                    t.as_str()
                        .with_context(|| format!("'layer_types' entries must be strings, got {t}"))
                })
                .collect::<Result<_>>()?,
        ),
        Some(other) => bail!("'layer_types' must be a list, got {other}"),
    };
    if let Some(types) = &layer_types {
        if types.len() != num_layers {
            bail!(
                "'layer_types' lists {} layers, but num_hidden_layers is {num_layers}",
                types.len()
            );
        }
        if let Some(t) = types
            .iter()
            .find(|t| !matches!(**t, "full_attention" | "sliding_attention"))
        {
            bail!("'layer_types' entry '{t}' is not supported (full_attention, sliding_attention)");
        }
    }
    if window.is_none()
        && matches!(family, HfFamily::Mistral | HfFamily::Mixtral)
        && v.get("sliding_window").is_some_and(|x| !x.is_null())
    {
        bail!("'sliding_window' must be a positive integer or null, got 0");
    }
    let sliding: Vec<bool> = match family {
        HfFamily::Llama
        | HfFamily::DeepseekV2
        | HfFamily::DeepseekV3
        | HfFamily::Qwen3Next
        | HfFamily::Qwen35
        | HfFamily::Qwen35Moe => vec![false; num_layers],
        HfFamily::Mistral | HfFamily::Mixtral => vec![window.is_some(); num_layers],
        // `layer_types`, else every `sliding_window_pattern`-th layer global
        // (transformers 4.5x; default 6) and the others local. transformers
        // 5 also writes a stale `_sliding_window_pattern` beside
        // `layer_types`, which it ignores.
        HfFamily::Gemma3 => match &layer_types {
            Some(types) => types.iter().map(|t| *t == "sliding_attention").collect(),
            None => {
                let pattern = ["sliding_window_pattern", "_sliding_window_pattern"]
                    .into_iter()
                    .find_map(|k| optional_count(v, k, 1).transpose())
                    .transpose()?
                    .unwrap_or(6);
                (0..num_layers).map(|i| (i + 1) % pattern != 0).collect()
            }
        },
        // gpt-oss: `layer_types`, by default sliding on even layers (as
        // transformers' `GptOssConfig` fills it in).
        HfFamily::GptOss => match &layer_types {
            Some(types) => types.iter().map(|t| *t == "sliding_attention").collect(),
            None => (0..num_layers).map(|i| i % 2 == 0).collect(),
        },
        HfFamily::Qwen2 | HfFamily::Qwen3 | HfFamily::Qwen2Moe | HfFamily::Qwen3Moe => {
            let enabled = matches!(v.get("use_sliding_window"), Some(Value::Bool(true)));
            match (&layer_types, enabled) {
                (_, false) => vec![false; num_layers],
                (Some(types), true) => types.iter().map(|t| *t == "sliding_attention").collect(),
                (None, true) => {
                    let from = v
                        .get("max_window_layers")
                        .and_then(Value::as_u64)
                        .map_or(num_layers, |x| x as usize);
                    (0..num_layers).map(|i| i >= from).collect()
                }
            }
        }
    };
    if !sliding.contains(&true) {
        return Ok(Vec::new());
    }
    let w =
        window.context("layers use sliding-window attention, but 'sliding_window' is not set")?;
    Ok(sliding.into_iter().map(|s| s.then_some(w)).collect())
}

/// The hybrid Qwen models' layer mix, Gated DeltaNet shape and partial RoPE
/// (see [`HybridConfig`]), as transformers' `Qwen3NextConfig` and
/// `Qwen3_5TextConfig` read them: `layer_types` (`linear_attention`,
/// `full_attention`), or where it is absent every `full_attention_interval`-th
/// layer (default 4) full attention; the `linear_*` shape keys; the RoPE
/// dimensions `int(head_dim · partial_rotary_factor)`. Qwen3.5's M-RoPE
/// sections (`mrope_section`) split the rotary pairs between temporal,
/// height and width positions; text-only positions give all three the same
/// position, so any split is plain RoPE over the rotary dimensions, and the
/// sections are only checked to cover them.
fn read_hf_hybrid(
    v: &Value,
    family: HfFamily,
    num_layers: usize,
    head_dim: usize,
    rotary_factor: f32,
    rope_scaling: &RopeScaling,
) -> Result<HybridConfig> {
    let count = |key: &str| -> Result<usize> {
        optional_count(v, key, 1)?.with_context(|| format!("missing '{key}'"))
    };
    let linear_layers: Vec<bool> = match v.get("layer_types") {
        None | Some(Value::Null) => {
            let every = optional_count(v, "full_attention_interval", 1)?.unwrap_or(4);
            (0..num_layers).map(|i| (i + 1) % every != 0).collect()
        }
        Some(Value::Array(a)) => a
            .iter()
            .map(|t| match t.as_str() {
                Some("linear_attention") => Ok(true),
                Some("full_attention") => Ok(false),
                _ => bail!(
                    "'layer_types' entry {t} is not supported (linear_attention, full_attention)"
                ),
            })
            .collect::<Result<_>>()?,
        Some(other) => bail!("'layer_types' must be a list, got {other}"),
    };
    if linear_layers.len() != num_layers {
        bail!(
            "'layer_types' lists {} layers, but num_hidden_layers is {num_layers}",
            linear_layers.len()
        );
    }
    if let Some(every) = optional_count(v, "full_attention_interval", 1)? {
        if v.get("layer_types").is_some_and(|t| !t.is_null())
            && linear_layers
                .iter()
                .enumerate()
                .any(|(i, &l)| l != ((i + 1) % every != 0))
        {
            bail!("'layer_types' and 'full_attention_interval' ({every}) disagree; remove the stale one");
        }
    }
    if let Some(x) = v.get("attn_output_gate").filter(|x| !x.is_null()) {
        if x.as_bool() != Some(true) {
            bail!("'attn_output_gate' = {x}: only the gated attention (true) of the published models is built");
        }
    }
    let h = HybridConfig {
        linear_layers,
        n_k_heads: count("linear_num_key_heads")?,
        n_v_heads: count("linear_num_value_heads")?,
        k_dim: count("linear_key_head_dim")?,
        v_dim: count("linear_value_head_dim")?,
        conv_kernel: count("linear_conv_kernel_dim")?,
        // transformers: `int(head_dim * partial_rotary_factor)`.
        rotary_dim: (head_dim as f64 * rotary_factor as f64) as usize,
    };
    if !h.n_v_heads.is_multiple_of(h.n_k_heads) {
        bail!(
            "'linear_num_value_heads' ({}) must be a multiple of 'linear_num_key_heads' ({})",
            h.n_v_heads,
            h.n_k_heads
        );
    }
    if h.conv_kernel < 2 || h.conv_kernel > 64 {
        bail!(
            "'linear_conv_kernel_dim' = {} must be between 2 and 64",
            h.conv_kernel
        );
    }
    for (key, x) in [
        ("linear_num_value_heads", h.n_v_heads),
        ("linear_key_head_dim", h.k_dim),
        ("linear_value_head_dim", h.v_dim),
    ] {
        if x > 1 << 12 {
            bail!(
                "'{key}' = {x} is beyond the supported maximum of {}",
                1 << 12
            );
        }
    }
    if h.rotary_dim == 0 || !h.rotary_dim.is_multiple_of(2) {
        bail!(
            "partial_rotary_factor {rotary_factor} of head_dim {head_dim} rotates {} dimensions; RoPE needs a positive even number",
            h.rotary_dim
        );
    }
    if !rope_scaling.is_none() {
        bail!("RoPE scaling (rope_parameters.rope_type other than 'default') on the partial RoPE of a hybrid Qwen model is not supported");
    }
    if matches!(family, HfFamily::Qwen35 | HfFamily::Qwen35Moe) {
        let params = v.get("rope_parameters").filter(|p| !p.is_null());
        if let Some(sec) = params
            .and_then(|p| p.get("mrope_section"))
            .filter(|s| !s.is_null())
        {
            let pairs: Option<Vec<u64>> = sec
                .as_array()
                .and_then(|a| a.iter().map(Value::as_u64).collect());
            match pairs {
                Some(p) if p.iter().sum::<u64>() as usize == h.rotary_dim / 2 => {}
                _ => bail!(
                    "rope_parameters.mrope_section {sec} must be rotary-pair counts summing to {} (half the {} rotary dimensions)",
                    h.rotary_dim / 2,
                    h.rotary_dim
                ),
            }
        }
    }
    Ok(h)
}

/// The top-level `config.json` keys of the families read here that either
/// change nothing in the forward pass or are read above. Any other key is
/// reported in one warning at load, so that a new key is noticed.
const KNOWN_HF_KEYS: &[&str] = &[
    "architectures",
    "model_type",
    "transformers_version",
    "dtype",
    "torch_dtype",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "partial_rotary_factor",
    "max_position_embeddings",
    "tie_word_embeddings",
    "attention_bias",
    "mlp_bias",
    "hidden_act",
    "hidden_activation",
    "sliding_window",
    "use_sliding_window",
    "max_window_layers",
    "layer_types",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "use_cache",
    "initializer_range",
    "attention_dropout",
    "pretraining_tp",
    "quantization_config",
    "_name_or_path",
    "output_attentions",
    "output_hidden_states",
    "return_dict",
    "is_encoder_decoder",
    "id2label",
    "label2id",
    "problem_type",
    "tokenizer_class",
    "chunk_size_feed_forward",
    "add_cross_attention",
    "is_decoder",
    "cross_attention_hidden_size",
    "tf_legacy_loss",
    "use_bfloat16",
    "torchscript",
    "pruned_heads",
    "finetuning_task",
    "task_specific_params",
    "prefix",
    "sep_token_id",
    "decoder_start_token_id",
    "num_local_experts",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "norm_topk_prob",
    "decoder_sparse_step",
    "mlp_only_layers",
    "qkv_bias",
    "kv_lora_rank",
    "q_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "qk_head_dim",
    "v_head_dim",
    "n_routed_experts",
    "n_shared_experts",
    "first_k_dense_replace",
    "moe_layer_freq",
    "routed_scaling_factor",
    "topk_method",
    "n_group",
    "topk_group",
    "scoring_func",
    "rope_interleave",
    // DeepSeek-V3's multi-token-prediction layers, for speculative
    // decoding; the model's own layers do not use them.
    "num_nextn_predict_layers",
    "ep_size",
    // Training only: the load-balancing loss and router noise.
    "aux_loss_alpha",
    "seq_aux",
    "router_aux_loss_coef",
    "output_router_logits",
    "router_jitter_noise",
    "linear_conv_kernel_dim",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "full_attention_interval",
    "attn_output_gate",
    // Multi-token-prediction layers, used only for speculative decoding
    // (not loaded here): they change nothing in the main model's forward.
    "mtp_num_hidden_layers",
    "mtp_use_dedicated_embeddings",
    // Gemma 3 (read above; refused on other families when set).
    "query_pre_attn_scalar",
    "rope_local_base_freq",
    "final_logit_softcapping",
    "attn_logit_softcapping",
    "use_bidirectional_attention",
    "sliding_window_pattern",
    "_sliding_window_pattern",
    // The generation-time cache class; no change to the math.
    "cache_implementation",
    "swiglu_limit",
    "swiglu_alpha",
    // gpt-oss (OpenAI's configs): the top-k again (checked against
    // `num_experts_per_tok`) and the pre-YaRN context, which
    // `original_max_position_embeddings` carries for the math.
    "experts_per_token",
    "initial_context_length",
    // ModernBERT (see `models::modernbert::hf_config`); the dropouts and
    // initializer keys are training only, the others below belong to heads
    // not served (masked LM) or to kernel choices (flash attention,
    // torch.compile).
    "norm_eps",
    "norm_bias",
    "local_attention",
    "global_attn_every_n_layers",
    "global_rope_theta",
    "local_rope_theta",
    "hidden_activation",
    "classifier_pooling",
    "classifier_bias",
    "classifier_activation",
    "embedding_dropout",
    "mlp_dropout",
    "initializer_cutoff_factor",
    "decoder_bias",
    "sparse_prediction",
    "sparse_pred_ignore_index",
    "deterministic_flash_attn",
    "reference_compile",
    "cls_token_id",
    "sep_token_id",
    // BERT (see `models::bert::hf_config`); the dropouts are training only.
    "layer_norm_eps",
    "type_vocab_size",
    "position_embedding_type",
    "hidden_dropout_prob",
    "attention_probs_dropout_prob",
    "classifier_dropout",
    "num_labels",
    "gradient_checkpointing",
];

/// Keys of an HF `config.json` that nothing here reads (see
/// [`KNOWN_HF_KEYS`]), sorted, for the start-up warning.
pub fn unknown_hf_keys(v: &Value) -> Vec<String> {
    let mut unknown: Vec<String> = v
        .as_object()
        .map(|o| {
            o.keys()
                .filter(|k| !KNOWN_HF_KEYS.contains(&k.as_str()))
                .cloned()
                .collect()
        })
        .unwrap_or_default();
    unknown.sort();
    unknown
}

#[cfg(test)]
mod bert_tests {
    use super::*;
    use serde_json::json;

    fn bert(extra: Value) -> Value {
        let mut v = json!({
            "architectures": ["BertModel"],
            "model_type": "bert",
            "hidden_size": 64,
            "num_attention_heads": 4,
            "num_hidden_layers": 2,
            "intermediate_size": 96,
            "vocab_size": 96,
            "max_position_embeddings": 128,
            "layer_norm_eps": 1e-7,
            "type_vocab_size": 3,
            "hidden_act": "gelu",
        });
        for (k, x) in extra.as_object().expect("object") {
            v[k] = x.clone();
        }
        v
    }

    #[test]
    fn bert_config_reads_the_encoder_keys() {
        let c = ModelConfig::from_hf_json(&bert(json!({}))).expect("BertModel");
        assert_eq!(c.arch, Arch::Bert);
        assert_eq!(c.head_dim, 16);
        let e = c.encoder.expect("encoder");
        assert_eq!(e.layer_norm_eps, 1e-7);
        assert_eq!(e.type_vocab_size, 3);
        assert_eq!(e.num_labels, None);
        let c = ModelConfig::from_hf_json(&bert(json!({
            "architectures": ["BertForSequenceClassification"],
            "id2label": {"0": "LABEL_0"},
        })))
        .expect("cross-encoder");
        assert_eq!(c.encoder.and_then(|e| e.num_labels), Some(1));
    }

    #[test]
    fn bert_config_refuses_what_it_does_not_compute_by_name() {
        for (extra, word) in [
            (json!({"hidden_act": "gelu_new"}), "hidden_act"),
            (
                json!({"position_embedding_type": "relative_key"}),
                "position_embedding_type",
            ),
            (json!({"is_decoder": true}), "is_decoder"),
            (json!({"add_cross_attention": true}), "add_cross_attention"),
            (
                json!({"architectures": ["BertForSequenceClassification"], "id2label": {"0": "a", "1": "b"}, "problem_type": "multi_label_classification"}),
                "problem_type",
            ),
        ] {
            let e = ModelConfig::from_hf_json(&bert(extra.clone())).expect_err("refused");
            assert!(format!("{e:#}").contains(word), "{extra}: {e:#}");
        }
    }
}

#[cfg(test)]
mod xlmr_tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn xlm_roberta_positions_start_after_padding() {
        let v = json!({
            "architectures": ["XLMRobertaModel"],
            "model_type": "xlm-roberta",
            "hidden_size": 64,
            "num_attention_heads": 4,
            "num_hidden_layers": 2,
            "intermediate_size": 96,
            "vocab_size": 64,
            "max_position_embeddings": 514,
            "pad_token_id": 1,
            "type_vocab_size": 1,
        });
        let c = ModelConfig::from_hf_json(&v).expect("XLMRobertaModel");
        let e = c.encoder.as_ref().expect("encoder");
        assert_eq!((e.position_offset, e.position_rows), (2, 514));
        // The context: the table less the offset, as XLM-R's 512.
        assert_eq!(c.max_position_embeddings, 512);
    }
}
