//! The f64 reference forward pass of the tiny models, and a driver that runs
//! the engine's `LlamaModel` over scripted batches, shared by the tests that
//! compare the engine's logits with the reference (`hf_models`,
//! `quantized_hf`).

use super::tiny_model::TinyModel;
use pagoda::engine::args::{cpu_backend, load_model};
use pagoda::engine::loader::DType;
use pagoda::engine::models::Workspace;
use pagoda::engine::EngineArgs;
use pagoda_accel::ops::KvDtype;
use pagoda_accel::{Backend, CpuBackend, KvSpec, StepBatch};
use std::path::Path;

/// Positions the model's RoPE table covers in these tests.
pub const MAX_POSITIONS: usize = 64;

// ---------------------------------------------------------------------------
// The f64 reference: Hugging Face's LlamaForCausalLM / Qwen2ForCausalLM,
// written out plainly.
// ---------------------------------------------------------------------------

/// Deliberate mistakes the reference can make, to prove that the comparison
/// would notice the engine making them.
#[derive(Clone, Copy, Debug, Default)]
pub struct Mistakes {
    /// Rotate adjacent pairs `(2i, 2i+1)` instead of HF's `(i, i + d/2)`.
    pub interleaved_rope: bool,
    /// Map query head `h` to KV head `h % kv_heads` instead of `h / group`.
    pub gqa_modulo: bool,
    /// Leave out the q/k/v biases.
    pub drop_bias: bool,
}

pub fn matvec(w: &[f64], rows: usize, cols: usize, x: &[f64]) -> Vec<f64> {
    assert_eq!(w.len(), rows * cols);
    assert_eq!(x.len(), cols);
    (0..rows)
        .map(|r| {
            w[r * cols..(r + 1) * cols]
                .iter()
                .zip(x)
                .map(|(a, b)| a * b)
                .sum()
        })
        .collect()
}

pub fn rms_norm(x: &[f64], g: &[f64], eps: f64) -> Vec<f64> {
    let ms = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
    let inv = 1.0 / (ms + eps).sqrt();
    x.iter().zip(g).map(|(v, g)| v * inv * g).collect()
}

/// Rotates every head of `x` (`[heads * head_dim]`) to position `pos`.
pub fn rope(x: &mut [f64], head_dim: usize, pos: usize, theta: f64, interleaved: bool) {
    let half = head_dim / 2;
    for head in x.chunks_exact_mut(head_dim) {
        for i in 0..half {
            let angle = pos as f64 * theta.powf(-2.0 * i as f64 / head_dim as f64);
            let (s, c) = angle.sin_cos();
            let (a, b) = if interleaved {
                (2 * i, 2 * i + 1)
            } else {
                (i, i + half)
            };
            let (x0, x1) = (head[a], head[b]);
            head[a] = x0 * c - x1 * s;
            head[b] = x0 * s + x1 * c;
        }
    }
}

pub fn silu(x: f64) -> f64 {
    x / (1.0 + (-x).exp())
}

/// The next-token logits at every position of `tokens`, in f64.
pub fn reference_logits(m: &TinyModel, tokens: &[u32], mistakes: Mistakes) -> Vec<Vec<f64>> {
    reference_logits_with(m, tokens, mistakes, &no_input_rounding)
}

/// Leaves every input as it is (see [`reference_logits_with`]).
pub fn no_input_rounding(_: &str, _: &mut [f64]) {}

/// [`reference_logits`], with `round` applied to every linear layer's
/// input before its product: called with the layer's name
/// (`model.layers.0.self_attn.q_proj`) and its input, for checkpoints that
/// round inputs onto a static int8 grid.
pub fn reference_logits_with(
    m: &TinyModel,
    tokens: &[u32],
    mistakes: Mistakes,
    round: &dyn Fn(&str, &mut [f64]),
) -> Vec<Vec<f64>> {
    let s = &m.spec;
    let (d, nh, nkv, hd, f, vocab) = (
        s.hidden_size,
        s.num_heads,
        s.num_kv_heads,
        s.head_dim,
        s.intermediate_size,
        s.vocab_size(),
    );
    let (qd, kvd) = (nh * hd, nkv * hd);
    let eps = s.rms_norm_eps;
    let w = |name: &str| -> Vec<f64> { m.get(name).data.iter().map(|&x| x as f64).collect() };
    let bias = |name: &str, len: usize| -> Vec<f64> {
        match m.find(name) {
            Some(_) if !mistakes.drop_bias => w(name),
            _ => vec![0.0; len],
        }
    };
    let embed = w("model.embed_tokens.weight");
    let mut xs: Vec<Vec<f64>> = tokens
        .iter()
        .map(|&t| embed[t as usize * d..(t as usize + 1) * d].to_vec())
        .collect();
    for l in 0..s.num_layers {
        let p = |name: &str| format!("model.layers.{l}.{name}");
        let (attn_norm, ffn_norm) = (
            w(&p("input_layernorm.weight")),
            w(&p("post_attention_layernorm.weight")),
        );
        let (wq, wk, wv) = (
            w(&p("self_attn.q_proj.weight")),
            w(&p("self_attn.k_proj.weight")),
            w(&p("self_attn.v_proj.weight")),
        );
        let (bq, bk, bv) = (
            bias(&p("self_attn.q_proj.bias"), qd),
            bias(&p("self_attn.k_proj.bias"), kvd),
            bias(&p("self_attn.v_proj.bias"), kvd),
        );
        let wo = w(&p("self_attn.o_proj.weight"));
        let (wg, wu, wd) = (
            w(&p("mlp.gate_proj.weight")),
            w(&p("mlp.up_proj.weight")),
            w(&p("mlp.down_proj.weight")),
        );

        let (mut qs, mut ks, mut vs) = (Vec::new(), Vec::new(), Vec::new());
        for (pos, x) in xs.iter().enumerate() {
            let h = rms_norm(x, &attn_norm, eps);
            let add = |mut y: Vec<f64>, b: &[f64]| {
                y.iter_mut().zip(b).for_each(|(y, b)| *y += b);
                y
            };
            let input = |name: &str| {
                let mut h = h.clone();
                round(&p(name), &mut h);
                h
            };
            let mut q = add(matvec(&wq, qd, d, &input("self_attn.q_proj")), &bq);
            let mut k = add(matvec(&wk, kvd, d, &input("self_attn.k_proj")), &bk);
            let v = add(matvec(&wv, kvd, d, &input("self_attn.v_proj")), &bv);
            rope(&mut q, hd, pos, s.rope_theta, mistakes.interleaved_rope);
            rope(&mut k, hd, pos, s.rope_theta, mistakes.interleaved_rope);
            qs.push(q);
            ks.push(k);
            vs.push(v);
        }
        for (t, x) in xs.iter_mut().enumerate() {
            let mut attn = vec![0f64; qd];
            for head in 0..nh {
                let kvh = if mistakes.gqa_modulo {
                    head % nkv
                } else {
                    head / (nh / nkv)
                };
                let q = &qs[t][head * hd..(head + 1) * hd];
                let scores: Vec<f64> = (0..=t)
                    .map(|j| {
                        let k = &ks[j][kvh * hd..(kvh + 1) * hd];
                        q.iter().zip(k).map(|(a, b)| a * b).sum::<f64>() / (hd as f64).sqrt()
                    })
                    .collect();
                let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                let sum: f64 = e.iter().sum();
                for (j, ej) in e.iter().enumerate() {
                    let v = &vs[j][kvh * hd..(kvh + 1) * hd];
                    for (o, vv) in attn[head * hd..(head + 1) * hd].iter_mut().zip(v) {
                        *o += ej / sum * vv;
                    }
                }
            }
            let rounded = |name: &str, v: &[f64]| {
                let mut v = v.to_vec();
                round(&p(name), &mut v);
                v
            };
            let o = matvec(&wo, d, qd, &rounded("self_attn.o_proj", &attn));
            x.iter_mut().zip(&o).for_each(|(x, o)| *x += o);
            let h = rms_norm(x, &ffn_norm, eps);
            let g = matvec(&wg, f, d, &rounded("mlp.gate_proj", &h));
            let u = matvec(&wu, f, d, &rounded("mlp.up_proj", &h));
            let act: Vec<f64> = g.iter().zip(&u).map(|(g, u)| silu(*g) * u).collect();
            let down = matvec(&wd, d, f, &rounded("mlp.down_proj", &act));
            x.iter_mut().zip(&down).for_each(|(x, o)| *x += o);
        }
    }
    let norm = w("model.norm.weight");
    let head = match m.find("lm_head.weight") {
        Some(_) => w("lm_head.weight"),
        None => embed,
    };
    xs.iter()
        .map(|x| matvec(&head, vocab, d, &rms_norm(x, &norm, eps)))
        .collect()
}

/// The largest difference between `got` and `want`, divided by the largest
/// `|want|` (the logit scale), and where it occurs.
pub fn relative_error(got: &[Vec<f32>], want: &[Vec<f64>]) -> (f64, usize, usize) {
    assert_eq!(got.len(), want.len(), "number of positions");
    let scale = want.iter().flatten().fold(0f64, |m, v| m.max(v.abs()));
    assert!(scale > 1.0, "degenerate reference: logit scale {scale}");
    let mut worst = (0f64, 0, 0);
    for (pos, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(g.len(), w.len(), "vocabulary size at position {pos}");
        for (i, (a, b)) in g.iter().zip(w).enumerate() {
            let e = (*a as f64 - b).abs() / scale;
            assert!(
                e.is_finite(),
                "non-finite logit {a} at position {pos}, token {i}"
            );
            if e > worst.0 {
                worst = (e, pos, i);
            }
        }
    }
    worst
}

pub fn assert_close(what: &str, got: &[Vec<f32>], want: &[Vec<f64>], tol: f64) {
    let (e, pos, tok) = relative_error(got, want);
    assert!(
        e <= tol,
        "{what}: logits differ by {e:.3e} of the logit scale (tolerance {tol:e}) at position {pos}, token {tok}: got {}, want {}",
        got[pos][tok],
        want[pos][tok]
    );
}

pub fn to_f64(rows: &[Vec<f32>]) -> Vec<Vec<f64>> {
    rows.iter()
        .map(|r| r.iter().map(|&x| x as f64).collect())
        .collect()
}

pub fn argmax(row: &[f64]) -> (u32, f64) {
    let mut idx: Vec<usize> = (0..row.len()).collect();
    idx.sort_by(|&a, &b| row[b].total_cmp(&row[a]));
    (idx[0] as u32, row[idx[0]] - row[idx[1]])
}

// ---------------------------------------------------------------------------
// Driving the engine's model directly.
// ---------------------------------------------------------------------------

/// The model on the CPU backend.
pub type Model = pagoda::engine::models::Model<CpuBackend>;

/// A CPU backend like the engine's for `args`, on 2 threads.
pub fn backend(args: &EngineArgs) -> CpuBackend {
    let mut args = args.clone();
    args.threads = 2;
    cpu_backend(&args).expect("a CPU backend")
}

/// Tokens per KV block: small, so that sequences span several blocks.
pub const BLOCK: usize = 4;

/// Loads `path` (HF folder or GGUF) with `dtype`.
pub fn load(path: &Path, dtype: DType) -> (Model, pagoda::engine::args::LoadedModel) {
    let mut args = EngineArgs::new(path);
    args.dtype = dtype;
    load_model(&backend(&args), &args, |_| MAX_POSITIONS)
        .unwrap_or_else(|e| panic!("loading {}: {e:#}", path.display()))
}

/// Runs `seqs` through `model` step by step as `schedule` says (each step a
/// list of `(sequence, new tokens)`, so a step can mix prefill chunks and
/// decodes of several sequences) with every sequence's KV in scattered,
/// descending blocks of an f32 cache, asking for the logits of every token.
/// Returns `logits[seq][position]`.
pub fn run_schedule(
    model: &Model,
    seqs: &[Vec<u32>],
    schedule: &[Vec<(usize, usize)>],
) -> Vec<Vec<Vec<f32>>> {
    let c = model.config();
    let vocab = c.vocab_size;
    let need: Vec<usize> = seqs.iter().map(|s| s.len().div_ceil(BLOCK)).collect();
    let num_blocks: usize = need.iter().sum::<usize>() + 1;
    // Deal blocks from the top down, round-robin, so no table is contiguous
    // or ascending and block 0 is never first.
    let mut tables: Vec<Vec<u32>> = vec![Vec::new(); seqs.len()];
    let mut next = num_blocks as u32;
    while tables.iter().zip(&need).any(|(t, n)| t.len() < *n) {
        for (t, n) in tables.iter_mut().zip(&need) {
            if t.len() < *n {
                next -= 1;
                t.push(next);
            }
        }
    }
    let mut b = backend(&EngineArgs::new("unused"));
    let spec = KvSpec {
        dtype: KvDtype::F32,
        num_blocks,
        block_size: BLOCK,
        layers: model.kv_layers(),
    };
    let mut kv = b.alloc_kv(&spec).expect("a KV pool");
    let mut ws = Workspace::<CpuBackend>::default();
    // A hybrid model's linear layers: sequence `s` in state slot `s`.
    let mut state = model
        .alloc_state(&mut b, seqs.len())
        .expect("the recurrent state");
    let mut dev_step = <CpuBackend as Backend>::Step::default();
    let mut done = vec![0usize; seqs.len()];
    let mut out: Vec<Vec<Vec<f32>>> = vec![Vec::new(); seqs.len()];
    for step in schedule {
        let mut batch = StepBatch::default();
        let mut spans = Vec::new();
        for &(s, n) in step {
            let start = done[s];
            assert!(
                start + n <= seqs[s].len(),
                "schedule runs past sequence {s}"
            );
            spans.push((s, batch.num_tokens(), n));
            // Every token here is a prompt token, and each wants its logits.
            batch.push_seq(
                &seqs[s][start..start + n],
                start,
                &tables[s],
                BLOCK,
                usize::MAX,
                n,
            );
            batch.state_slots.push(s as u32);
            done[s] += n;
        }
        let rows = batch.logit_rows.len();
        b.upload_step(&batch, &mut dev_step).expect("upload");
        state.slots.clone_from(&batch.state_slots);
        model
            .forward(
                &mut b,
                &dev_step,
                batch.num_tokens(),
                rows,
                &mut kv,
                &mut state,
                &mut ws,
            )
            .expect("forward");
        let logits = b.to_host(&mut ws.logits, rows * vocab).expect("logits");
        for &(s, q_start, q_len) in &spans {
            for r in q_start..q_start + q_len {
                out[s].push(logits[r * vocab..(r + 1) * vocab].to_vec());
            }
        }
    }
    for (s, seq) in seqs.iter().enumerate() {
        assert_eq!(
            done[s],
            seq.len(),
            "schedule leaves sequence {s} unfinished"
        );
    }
    out
}

/// Deterministic token ids spread over the vocabulary.
pub fn some_tokens(n: usize, salt: u32, vocab: usize) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i * 37 + salt * 11 + 5) % vocab as u32)
        .collect()
}

/// Two sequences in one batch: A (12-token prompt in one prefill, then 4
/// decodes) and B (9-token prompt in chunks of 5 and 4, then 3 decodes),
/// every step mixing both.
pub fn two_sequences(vocab: usize) -> (Vec<Vec<u32>>, Vec<Vec<(usize, usize)>>) {
    let seqs = vec![some_tokens(16, 1, vocab), some_tokens(12, 2, vocab)];
    let schedule = vec![
        vec![(0, 12), (1, 5)],
        vec![(0, 1), (1, 4)],
        vec![(1, 1), (0, 1)],
        vec![(0, 1), (1, 1)],
        vec![(0, 1), (1, 1)],
    ];
    (seqs, schedule)
}

/// One 40-token prompt (long enough for the prefill matmul's large-batch
/// path) and two decodes.
pub fn long_prompt(vocab: usize) -> (Vec<Vec<u32>>, Vec<Vec<(usize, usize)>>) {
    (
        vec![some_tokens(42, 3, vocab)],
        vec![vec![(0, 40)], vec![(0, 1)], vec![(0, 1)]],
    )
}

/// Runs both scenarios through `model` and compares every logit with the
/// reference computed from `weights`.
pub fn check_against_reference(what: &str, model: &Model, weights: &TinyModel, tol: f64) {
    check_against_reference_with(what, model, weights, tol, &no_input_rounding)
}

/// [`check_against_reference`], the reference rounding linear inputs with
/// `round`.
pub fn check_against_reference_with(
    what: &str,
    model: &Model,
    weights: &TinyModel,
    tol: f64,
    round: &dyn Fn(&str, &mut [f64]),
) {
    let vocab = weights.spec.vocab_size();
    for (name, (seqs, schedule)) in [
        ("two sequences", two_sequences(vocab)),
        ("long prompt", long_prompt(vocab)),
    ] {
        let got = run_schedule(model, &seqs, &schedule);
        for (s, seq) in seqs.iter().enumerate() {
            let want = reference_logits_with(weights, seq, Mistakes::default(), round);
            assert_close(
                &format!("{what}, {name}, sequence {s}"),
                &got[s],
                &want,
                tol,
            );
        }
    }
}

/// The engine's logits for the two-sequence scenario, all positions.
pub fn engine_logits(model: &Model) -> Vec<Vec<Vec<f32>>> {
    let (seqs, schedule) = two_sequences(model.config().vocab_size);
    run_schedule(model, &seqs, &schedule)
}
