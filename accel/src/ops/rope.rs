//! Rotary position embeddings (RoPE) from a precomputed cos/sin table.
//!
//! The table is computed once per model in f64 and stored in f32: computing
//! `pos * freq` in f32 loses several bits at positions in the thousands, and
//! the table costs `max_positions * head_dim * 4` bytes, which is small next
//! to the KV cache it indexes.

/// Which dimensions of a head form the rotated pairs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum RopeStyle {
    /// Pairs `(2i, 2i+1)`: GGUF llama-architecture weights, whose q/k rows
    /// the converter permuted into this order.
    Interleaved,
    /// Pairs `(i, i + head_dim/2)`: Hugging Face Llama/Qwen2/Mistral, and
    /// GGUF qwen2.
    Neox,
}

/// Context-extension scaling applied to the rotary frequencies.
#[derive(Clone, Debug, PartialEq)]
pub enum RopeScaling {
    /// Plain RoPE.
    None,
    /// Position interpolation: every frequency divided by `factor`.
    Linear {
        /// How many times longer the target context is.
        factor: f32,
    },
    /// Llama 3.1's scaling: low frequencies (long wavelengths) divided by
    /// `factor`, high frequencies kept, a smooth blend in between.
    Llama3 {
        /// Divisor of the low frequencies.
        factor: f32,
        /// Wavelengths above `original_max_position / low_freq_factor` are
        /// fully scaled.
        low_freq_factor: f32,
        /// Wavelengths below `original_max_position / high_freq_factor` are
        /// kept.
        high_freq_factor: f32,
        /// The context length the model was pre-trained with.
        original_max_position: usize,
    },
    /// YaRN (arXiv 2309.00071), as transformers and DeepSeek compute it:
    /// each frequency a blend of itself and itself divided by `factor`,
    /// ramping from kept (above `beta_fast` rotations over the original
    /// context) to fully scaled (below `beta_slow`), and cos/sin multiplied
    /// by `attention_factor`.
    Yarn {
        factor: f32,
        original_max_position: usize,
        beta_fast: f32,
        beta_slow: f32,
        /// Multiplies cos and sin (transformers' `attention_factor`).
        attention_factor: f32,
        /// Round the ramp's ends to whole dimensions (transformers'
        /// `truncate`, true unless the config says otherwise).
        truncate: bool,
    },
    /// A divisor per rotary pair (`head_dim / 2` of them): llama.cpp's
    /// `rope_freqs.weight`, which its converter computes from a Llama 3.1
    /// `rope_scaling` so that GGUF files carry the scaling as data.
    Factors(Vec<f32>),
}

impl RopeScaling {
    /// Whether the scaling changes nothing.
    pub fn is_none(&self) -> bool {
        matches!(self, RopeScaling::None)
    }

    /// What cos and sin are multiplied by.
    pub fn attention_factor(&self) -> f32 {
        match *self {
            RopeScaling::Yarn {
                attention_factor, ..
            } => attention_factor,
            _ => 1.0,
        }
    }
}

/// The dimension (of `head_dim`) whose wavelength makes `rotations` turns
/// over `max_position` positions, YaRN's inverse dimension formula.
fn yarn_correction_dim(rotations: f64, head_dim: usize, theta: f64, max_position: usize) -> f64 {
    head_dim as f64 * (max_position as f64 / (rotations * 2.0 * std::f64::consts::PI)).ln()
        / (2.0 * theta.ln())
}

/// Precomputed cos/sin for positions `0..max_positions` and the
/// `head_dim / 2` rotary frequencies, plus the pairing style.
#[derive(Clone, Debug)]
pub struct RopeTable {
    head_dim: usize,
    max_positions: usize,
    style: RopeStyle,
    /// `[max_positions, head_dim / 2]`.
    cos: Vec<f32>,
    /// `[max_positions, head_dim / 2]`.
    sin: Vec<f32>,
}

/// The rotary frequency of pair `i` (radians per position), scaling applied.
fn frequency(i: usize, head_dim: usize, theta: f64, scaling: &RopeScaling) -> f64 {
    let freq = theta.powf(-2.0 * i as f64 / head_dim as f64);
    match *scaling {
        RopeScaling::None => freq,
        RopeScaling::Linear { factor } => freq / factor as f64,
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position,
        } => {
            let (factor, low, high) = (
                factor as f64,
                low_freq_factor as f64,
                high_freq_factor as f64,
            );
            let orig = original_max_position as f64;
            let wavelen = 2.0 * std::f64::consts::PI / freq;
            if wavelen < orig / high {
                freq
            } else if wavelen > orig / low {
                freq / factor
            } else {
                let smooth = (orig / wavelen - low) / (high - low);
                (1.0 - smooth) * freq / factor + smooth * freq
            }
        }
        RopeScaling::Factors(ref f) => freq / f[i] as f64,
        RopeScaling::Yarn {
            factor,
            original_max_position,
            beta_fast,
            beta_slow,
            truncate,
            ..
        } => {
            let mut low =
                yarn_correction_dim(beta_fast as f64, head_dim, theta, original_max_position);
            let mut high =
                yarn_correction_dim(beta_slow as f64, head_dim, theta, original_max_position);
            if truncate {
                low = low.floor();
                high = high.ceil();
            }
            let low = low.max(0.0);
            let mut high = high.min(head_dim as f64 - 1.0);
            if low == high {
                high += 0.001;
            }
            // 1 where the frequency is kept (extrapolated), 0 where scaled.
            let keep = 1.0 - ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
            freq / factor as f64 * (1.0 - keep) + freq * keep
        }
    }
}

impl RopeTable {
    /// Builds the table for heads of `head_dim` (even) with base `theta`.
    ///
    /// # Panics
    /// If `head_dim` is zero or odd.
    pub fn new(
        head_dim: usize,
        theta: f32,
        max_positions: usize,
        scaling: &RopeScaling,
        style: RopeStyle,
    ) -> RopeTable {
        assert!(
            head_dim > 0 && head_dim.is_multiple_of(2),
            "RoPE head_dim must be even, got {head_dim}"
        );
        let half = head_dim / 2;
        if let RopeScaling::Factors(f) = scaling {
            assert_eq!(f.len(), half, "RoPE frequency factors: one per rotary pair");
        }
        let freqs: Vec<f64> = (0..half)
            .map(|i| frequency(i, head_dim, theta as f64, scaling))
            .collect();
        let mut cos = Vec::with_capacity(max_positions * half);
        let mut sin = Vec::with_capacity(max_positions * half);
        let a = scaling.attention_factor() as f64;
        for p in 0..max_positions {
            for &f in &freqs {
                let (s, c) = (p as f64 * f).sin_cos();
                cos.push((c * a) as f32);
                sin.push((s * a) as f32);
            }
        }
        RopeTable {
            head_dim,
            max_positions,
            style,
            cos,
            sin,
        }
    }

    /// Positions the table covers (`0..max_positions`).
    pub fn max_positions(&self) -> usize {
        self.max_positions
    }

    /// The head size the table was built for.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// The pairing style the table rotates with.
    pub fn style(&self) -> RopeStyle {
        self.style
    }

    /// The cosines, `[max_positions, head_dim / 2]` row-major: entry
    /// `pos * head_dim / 2 + i` is `cos(pos · freq_i)` (what a device
    /// backend uploads).
    pub fn cos_table(&self) -> &[f32] {
        &self.cos
    }

    /// The sines, laid out as [`RopeTable::cos_table`].
    pub fn sin_table(&self) -> &[f32] {
        &self.sin
    }
}

/// Rotates `x: [n_tokens, n_heads, head_dim]` in place; token `t` is at
/// position `positions[t]`.
///
/// # Panics
/// If `x.len() != positions.len() * n_heads * head_dim`, or a position is
/// `>= table.max_positions()` (the engine validates lengths before, so this
/// is a bug, not an input error).
pub fn rope_inplace(table: &RopeTable, x: &mut [f32], n_heads: usize, positions: &[u32]) {
    let d = table.head_dim;
    let half = d / 2;
    assert_eq!(
        x.len(),
        positions.len() * n_heads * d,
        "rope_inplace: x has the wrong length"
    );
    if n_heads == 0 {
        return;
    }
    for (tok, &pos) in x.chunks_exact_mut(n_heads * d).zip(positions) {
        let pos = pos as usize;
        assert!(
            pos < table.max_positions,
            "rope_inplace: position {pos} beyond the table's {}",
            table.max_positions
        );
        let cos = &table.cos[pos * half..(pos + 1) * half];
        let sin = &table.sin[pos * half..(pos + 1) * half];
        for head in tok.chunks_exact_mut(d) {
            match table.style {
                RopeStyle::Neox => {
                    let (a, b) = head.split_at_mut(half);
                    for i in 0..half {
                        let (x0, x1) = (a[i], b[i]);
                        a[i] = x0 * cos[i] - x1 * sin[i];
                        b[i] = x0 * sin[i] + x1 * cos[i];
                    }
                }
                RopeStyle::Interleaved => {
                    for (i, pair) in head.chunks_exact_mut(2).enumerate() {
                        let (x0, x1) = (pair[0], pair[1]);
                        pair[0] = x0 * cos[i] - x1 * sin[i];
                        pair[1] = x0 * sin[i] + x1 * cos[i];
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// Straight from the definition, in f64: pair `(a, b)` of frequency
    /// `freq` rotated by `pos * freq`.
    fn reference(x: &[f32], d: usize, pos: u32, freqs: &[f64], style: RopeStyle) -> Vec<f64> {
        let mut out: Vec<f64> = x.iter().map(|&v| v as f64).collect();
        for (i, &f) in freqs.iter().enumerate() {
            let (ia, ib) = match style {
                RopeStyle::Interleaved => (2 * i, 2 * i + 1),
                RopeStyle::Neox => (i, i + d / 2),
            };
            let ang = pos as f64 * f;
            let (a, b) = (x[ia] as f64, x[ib] as f64);
            out[ia] = a * ang.cos() - b * ang.sin();
            out[ib] = a * ang.sin() + b * ang.cos();
        }
        out
    }

    fn check(d: usize, theta: f32, scaling: &RopeScaling, freqs: &[f64]) {
        let mut rng = rand::rngs::StdRng::seed_from_u64(d as u64);
        let n_heads = 3;
        let max_pos = 9000;
        for style in [RopeStyle::Interleaved, RopeStyle::Neox] {
            let table = RopeTable::new(d, theta, max_pos, scaling, style);
            assert_eq!(table.max_positions(), max_pos);
            let positions = [0u32, 1, 17, 4095, 8191, 8999];
            let x: Vec<f32> = (0..positions.len() * n_heads * d)
                .map(|_| rng.random_range(-2.0..2.0))
                .collect();
            let mut y = x.clone();
            rope_inplace(&table, &mut y, n_heads, &positions);
            for (t, &pos) in positions.iter().enumerate() {
                for h in 0..n_heads {
                    let off = (t * n_heads + h) * d;
                    let want = reference(&x[off..off + d], d, pos, freqs, style);
                    for i in 0..d {
                        assert!(
                            (y[off + i] as f64 - want[i]).abs() < 2e-6,
                            "{style:?} {scaling:?} d={d} pos={pos} h={h} [{i}]: {} vs {}",
                            y[off + i],
                            want[i]
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn plain_rope_matches_formula() {
        for d in [2usize, 64, 128] {
            let freqs: Vec<f64> = (0..d / 2)
                .map(|i| 10000f64.powf(-((2 * i) as f64) / d as f64))
                .collect();
            check(d, 10000.0, &RopeScaling::None, &freqs);
        }
    }

    #[test]
    fn linear_scaling_divides_frequencies() {
        let d = 64;
        let freqs: Vec<f64> = (0..d / 2)
            .map(|i| 500000f64.powf(-((2 * i) as f64) / d as f64) / 4.0)
            .collect();
        check(d, 500000.0, &RopeScaling::Linear { factor: 4.0 }, &freqs);
    }

    #[test]
    fn llama3_scaling_matches_formula() {
        let d = 128;
        let (factor, low, high, orig) = (8.0f64, 1.0f64, 4.0f64, 8192.0f64);
        let freqs: Vec<f64> = (0..d / 2)
            .map(|i| {
                let f = 500000f64.powf(-((2 * i) as f64) / d as f64);
                let wl = 2.0 * std::f64::consts::PI / f;
                if wl < orig / high {
                    f
                } else if wl > orig / low {
                    f / factor
                } else {
                    let s = (orig / wl - low) / (high - low);
                    (1.0 - s) * f / factor + s * f
                }
            })
            .collect();
        // All three regimes must be exercised for the test to mean anything.
        let base = |i: usize| 500000f64.powf(-((2 * i) as f64) / d as f64);
        assert!(freqs.iter().enumerate().any(|(i, &f)| f == base(i)));
        assert!(freqs
            .iter()
            .enumerate()
            .any(|(i, &f)| f == base(i) / factor));
        assert!(freqs
            .iter()
            .enumerate()
            .any(|(i, &f)| f != base(i) && f != base(i) / factor));
        let scaling = RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position: 8192,
        };
        check(d, 500000.0, &scaling, &freqs);
    }

    #[test]
    fn styles_pair_different_dimensions() {
        // A vector with only dimension 1 set: interleaved rotates it with
        // dimension 0, neox with dimension 1 + d/2.
        let d = 8;
        let mut a = vec![0.0f32; d];
        a[1] = 1.0;
        let mut b = a.clone();
        let ti = RopeTable::new(d, 10000.0, 4, &RopeScaling::None, RopeStyle::Interleaved);
        let tn = RopeTable::new(d, 10000.0, 4, &RopeScaling::None, RopeStyle::Neox);
        rope_inplace(&ti, &mut a, 1, &[1]);
        rope_inplace(&tn, &mut b, 1, &[1]);
        assert!(a[0] != 0.0 && a[1 + d / 2] == 0.0);
        assert!(b[0] == 0.0 && b[1 + d / 2] != 0.0);
    }

    #[test]
    #[should_panic(expected = "beyond the table")]
    fn position_past_the_table_panics() {
        let t = RopeTable::new(4, 10000.0, 8, &RopeScaling::None, RopeStyle::Neox);
        let mut x = vec![0.0f32; 4];
        rope_inplace(&t, &mut x, 1, &[8]);
    }
}
