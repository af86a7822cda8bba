//! Mixture-of-experts routing on the CPU: each token's top-k experts and
//! their weights from the router's logits, and the grouping of the
//! (token, choice) pairs by expert that lets each expert's weights be read
//! once per step for every token routed to it.
//!
//! The router's math is f32 throughout, as transformers and vLLM do it.

/// How router logits become scores.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RouterScoring {
    /// Softmax over all experts (Mixtral, Qwen-MoE, DeepSeek-V2).
    Softmax,
    /// An independent sigmoid per expert (DeepSeek-V3).
    Sigmoid,
    /// The top-k of the raw logits, weighted by a softmax over those k
    /// logits only (GPT-OSS's router).
    TopKSoftmax,
}

/// How a group of experts is scored when the top-k is limited to the best
/// groups (DeepSeek's `n_group` / `topk_group`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GroupScore {
    /// The group's best expert (DeepSeek-V2's `group_limited_greedy`).
    Max,
    /// The sum of the group's two best experts (DeepSeek-V3's `noaux_tc`).
    SumTop2,
}

/// Group-limited routing: experts are split into `n_group` equal groups,
/// and only the experts of the `topk_group` best groups may be chosen.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GroupLimit {
    pub n_group: usize,
    pub topk_group: usize,
    pub score: GroupScore,
}

/// A router's rule: which experts a token goes to, and with what weight.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RouterSpec {
    pub n_experts: usize,
    /// Experts per token.
    pub top_k: usize,
    pub scoring: RouterScoring,
    /// Divide the chosen experts' weights by their sum (`norm_topk_prob`;
    /// Mixtral always does).
    pub normalize: bool,
    /// Multiplies every weight after normalization
    /// (`routed_scaling_factor`; 1 elsewhere).
    pub scale: f32,
    /// Group-limited choice, where the model has it.
    pub groups: Option<GroupLimit>,
}

impl RouterSpec {
    /// Checks the rule's shape; the message names the config key at fault.
    pub fn check(&self) -> Result<(), String> {
        if self.n_experts == 0 {
            return Err("the number of experts must be positive".into());
        }
        if self.top_k == 0 || self.top_k > self.n_experts {
            return Err(format!(
                "num_experts_per_tok = {} must be between 1 and the number of experts ({})",
                self.top_k, self.n_experts
            ));
        }
        if let Some(g) = self.groups {
            if g.n_group == 0 || !self.n_experts.is_multiple_of(g.n_group) {
                return Err(format!(
                    "n_group = {} does not divide the {} experts",
                    g.n_group, self.n_experts
                ));
            }
            if g.topk_group == 0 || g.topk_group > g.n_group {
                return Err(format!(
                    "topk_group = {} must be between 1 and n_group ({})",
                    g.topk_group, g.n_group
                ));
            }
            let allowed = g.topk_group * (self.n_experts / g.n_group);
            if allowed < self.top_k {
                return Err(format!(
                    "topk_group = {} groups of {} experts leave fewer than num_experts_per_tok = {} to choose from",
                    g.topk_group,
                    self.n_experts / g.n_group,
                    self.top_k
                ));
            }
            if g.score == GroupScore::SumTop2 && self.n_experts / g.n_group < 2 {
                return Err("groups of one expert cannot be scored by their two best".into());
            }
        }
        if !self.scale.is_finite() {
            return Err(format!(
                "routed_scaling_factor {} is not finite",
                self.scale
            ));
        }
        Ok(())
    }
}

/// The routing of one step's tokens: for token `t`'s `j`-th choice, its
/// expert and weight; and the (token, choice) pairs grouped by expert.
#[derive(Clone, Debug, Default)]
pub struct Routing {
    /// Experts per token.
    pub k: usize,
    /// `experts[t·k + j]`: token `t`'s `j`-th expert, best first.
    pub experts: Vec<u32>,
    /// `weights[t·k + j]`: its weight.
    pub weights: Vec<f32>,
    /// Expert `e`'s pairs are grouped rows `offsets[e]..offsets[e + 1]`.
    pub offsets: Vec<usize>,
    /// `order[s]`: the pair (`t·k + j`) at grouped row `s`; within an
    /// expert, in token order.
    pub order: Vec<u32>,
    /// `slot[t·k + j]`: the grouped row of that pair (`order`'s inverse).
    pub slot: Vec<u32>,
    /// Scratch, kept so that a warm step allocates nothing: one token's
    /// scores, its biased scores, the chosen experts, the group scores,
    /// the kept groups and each expert's next grouped row.
    scores: Vec<f32>,
    choice: Vec<f32>,
    picked: Vec<u32>,
    group_scores: Vec<f32>,
    kept: Vec<u32>,
    next: Vec<usize>,
}

impl Routing {
    /// The number of (token, choice) pairs.
    pub fn pairs(&self) -> usize {
        self.experts.len()
    }

    /// The token of grouped row `s`.
    pub fn token_of(&self, s: usize) -> usize {
        self.order[s] as usize / self.k
    }
}

/// The indices of the `k` largest of `v` (ties to the lower index), best
/// first, into `out`.
fn top_k_into(v: &[f32], k: usize, out: &mut Vec<u32>) {
    out.clear();
    for _ in 0..k {
        let mut best: Option<usize> = None;
        for (i, &x) in v.iter().enumerate() {
            if out.contains(&(i as u32)) {
                continue;
            }
            // NaN never wins; -inf only when nothing else is left.
            match best {
                Some(b) if !(x > v[b]) => {}
                _ if x.is_nan() => {}
                _ => best = Some(i),
            }
        }
        let Some(b) = best.or_else(|| (0..v.len()).find(|i| !out.contains(&(*i as u32)))) else {
            return;
        };
        out.push(b as u32);
    }
}

/// Routes `m` tokens whose router logits are the rows of `logits` (`[m,
/// n_experts]`), with `bias` added to the scores for the choice only
/// (DeepSeek-V3's `e_score_correction_bias`), into `out`.
///
/// # Panics
/// If the shapes disagree with `spec`.
pub fn route(logits: &[f32], m: usize, spec: &RouterSpec, bias: Option<&[f32]>, out: &mut Routing) {
    let e = spec.n_experts;
    let k = spec.top_k;
    assert!(logits.len() >= m * e, "route: {m} rows of {e} logits");
    if let Some(b) = bias {
        assert_eq!(b.len(), e, "route: one bias per expert");
    }
    out.k = k;
    out.experts.clear();
    out.weights.clear();
    for row in logits[..m * e].chunks_exact(e) {
        out.scores.clear();
        out.scores.extend_from_slice(row);
        match spec.scoring {
            RouterScoring::Softmax => super::softmax_inplace(&mut out.scores),
            RouterScoring::Sigmoid => {
                for s in out.scores.iter_mut() {
                    *s = 1.0 / (1.0 + (-*s).exp());
                }
            }
            // The logits choose; the softmax comes after the choice.
            RouterScoring::TopKSoftmax => {}
        }
        out.choice.clear();
        out.choice.extend_from_slice(&out.scores);
        if let Some(b) = bias {
            for (c, b) in out.choice.iter_mut().zip(b) {
                *c += b;
            }
        }
        if let Some(g) = spec.groups {
            let per = e / g.n_group;
            out.group_scores.clear();
            for grp in out.choice.chunks_exact(per) {
                out.group_scores.push(match g.score {
                    GroupScore::Max => grp.iter().copied().fold(f32::NEG_INFINITY, f32::max),
                    GroupScore::SumTop2 => {
                        top_k_into(grp, 2, &mut out.kept);
                        out.kept.iter().map(|&i| grp[i as usize]).sum()
                    }
                });
            }
            top_k_into(&out.group_scores, g.topk_group, &mut out.kept);
            for (gi, grp) in out.choice.chunks_exact_mut(per).enumerate() {
                if !out.kept.contains(&(gi as u32)) {
                    grp.fill(f32::NEG_INFINITY);
                }
            }
        }
        let mut picked = std::mem::take(&mut out.picked);
        top_k_into(&out.choice, k, &mut picked);
        let first = out.weights.len();
        for &i in &picked {
            out.experts.push(i);
            out.weights.push(out.scores[i as usize]);
        }
        out.picked = picked;
        let w = &mut out.weights[first..];
        if spec.scoring == RouterScoring::TopKSoftmax {
            super::softmax_inplace(w);
        }
        if spec.normalize {
            let sum: f32 = w.iter().sum();
            if sum > 0.0 {
                for x in w.iter_mut() {
                    *x /= sum;
                }
            }
        }
        if spec.scale != 1.0 {
            for x in w.iter_mut() {
                *x *= spec.scale;
            }
        }
    }
    // Group the pairs by expert (a counting sort, stable in token order).
    out.offsets.clear();
    out.offsets.resize(e + 1, 0);
    for &x in &out.experts {
        out.offsets[x as usize + 1] += 1;
    }
    for i in 0..e {
        out.offsets[i + 1] += out.offsets[i];
    }
    let pairs = out.experts.len();
    out.order.clear();
    out.order.resize(pairs, 0);
    out.slot.clear();
    out.slot.resize(pairs, 0);
    out.next.clear();
    out.next.extend_from_slice(&out.offsets[..e]);
    for (p, &x) in out.experts.iter().enumerate() {
        let s = out.next[x as usize];
        out.next[x as usize] += 1;
        out.order[s] = p as u32;
        out.slot[p] = s as u32;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(n: usize, k: usize) -> RouterSpec {
        RouterSpec {
            n_experts: n,
            top_k: k,
            scoring: RouterScoring::Softmax,
            normalize: false,
            scale: 1.0,
            groups: None,
        }
    }

    /// Softmax in f64 over a row, as the naive reference.
    fn softmax64(row: &[f32]) -> Vec<f64> {
        let m = row.iter().fold(f64::NEG_INFINITY, |a, &b| a.max(b as f64));
        let e: Vec<f64> = row.iter().map(|&x| (x as f64 - m).exp()).collect();
        let s: f64 = e.iter().sum();
        e.into_iter().map(|x| x / s).collect()
    }

    #[test]
    fn top_k_softmax_weighs_the_chosen_logits_by_their_own_softmax() {
        let logits = [
            0.1f32, 2.0, -1.0, 1.5, /* token 2 */ 3.0, 0.0, 0.5, 2.9,
        ];
        let mut s = spec(4, 2);
        s.scoring = RouterScoring::TopKSoftmax;
        let mut r = Routing::default();
        route(&logits, 2, &s, None, &mut r);
        assert_eq!(r.experts, [1, 3, 0, 3]);
        let want = [
            softmax64(&[2.0, 1.5])[0],
            softmax64(&[2.0, 1.5])[1],
            softmax64(&[3.0, 2.9])[0],
            softmax64(&[3.0, 2.9])[1],
        ];
        for (g, w) in r.weights.iter().zip(want) {
            assert!((*g as f64 - w).abs() < 1e-6, "{g} vs {w}");
        }
    }

    #[test]
    fn softmax_top2_picks_the_two_largest_logits_with_their_probabilities() {
        let logits = [
            0.1f32, 2.0, -1.0, 1.5, /* token 2 */ 3.0, 0.0, 0.5, 2.9,
        ];
        let mut r = Routing::default();
        route(&logits, 2, &spec(4, 2), None, &mut r);
        assert_eq!(r.experts, [1, 3, 0, 3]);
        let p0 = softmax64(&logits[..4]);
        let p1 = softmax64(&logits[4..]);
        let want = [p0[1], p0[3], p1[0], p1[3]];
        for (g, w) in r.weights.iter().zip(want) {
            assert!((*g as f64 - w).abs() < 1e-6, "{g} vs {w}");
        }
        // Grouped by expert: expert 0 has token 1's first choice, expert 1
        // token 0's first, expert 3 both tokens' second, in token order.
        assert_eq!(r.offsets, [0, 1, 2, 2, 4]);
        assert_eq!(r.order, [2, 0, 1, 3]);
        for (p, &s) in r.slot.iter().enumerate() {
            assert_eq!(r.order[s as usize] as usize, p);
        }
    }

    #[test]
    fn normalized_weights_sum_to_the_scale() {
        let logits = [0.3f32, -0.2, 1.1, 0.7, 0.0, -2.0];
        let mut s = spec(6, 3);
        s.normalize = true;
        s.scale = 2.5;
        let mut r = Routing::default();
        route(&logits, 1, &s, None, &mut r);
        let sum: f32 = r.weights.iter().sum();
        assert!((sum - 2.5).abs() < 1e-5, "{sum}");
        assert_eq!(r.experts, [2, 3, 0]);
    }

    #[test]
    fn the_bias_steers_the_choice_but_not_the_weights() {
        // Sigmoid scores; the bias makes expert 0 win the choice although
        // its score is lowest, and its weight stays its unbiased score.
        let logits = [-1.0f32, 0.5, 1.0];
        let mut s = spec(3, 1);
        s.scoring = RouterScoring::Sigmoid;
        let mut r = Routing::default();
        route(&logits, 1, &s, Some(&[5.0, 0.0, 0.0]), &mut r);
        assert_eq!(r.experts, [0]);
        let sig = 1.0 / (1.0 + (1.0f64).exp());
        assert!((r.weights[0] as f64 - sig).abs() < 1e-6);
    }

    #[test]
    fn group_limits_keep_the_choice_inside_the_best_groups() {
        // Two groups of three. Group 1 holds the single best expert (5), but
        // group 0's two best sum higher, so with SumTop2 only group 0 may be
        // chosen, and with Max only group 1.
        let logits = [0.8f32, 0.7, -3.0, -3.0, -3.0, 0.9];
        let mut s = spec(6, 2);
        s.scoring = RouterScoring::Sigmoid;
        let mut r = Routing::default();
        s.groups = Some(GroupLimit {
            n_group: 2,
            topk_group: 1,
            score: GroupScore::SumTop2,
        });
        route(&logits, 1, &s, None, &mut r);
        assert_eq!(r.experts, [0, 1]);
        s.groups = Some(GroupLimit {
            n_group: 2,
            topk_group: 1,
            score: GroupScore::Max,
        });
        route(&logits, 1, &s, None, &mut r);
        assert_eq!(r.experts, [5, 3]);
    }

    #[test]
    fn bad_rules_are_refused_with_the_key_named() {
        let mut s = spec(4, 5);
        assert!(s.check().unwrap_err().contains("num_experts_per_tok"));
        s.top_k = 2;
        s.groups = Some(GroupLimit {
            n_group: 3,
            topk_group: 1,
            score: GroupScore::Max,
        });
        assert!(s.check().unwrap_err().contains("n_group"));
    }
}
