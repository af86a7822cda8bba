//! What speculative decoding keeps per sequence: the drafts awaiting
//! verification and how earlier drafts fared.

/// One sequence's speculative-decoding state.
#[derive(Clone, Debug, Default)]
pub struct SpecState {
    /// Tokens drafted after the last one, for the next step to verify.
    pub drafts: Vec<u32>,
    /// With drafts sampled from a draft model (`draft_sample_method`
    /// `probabilistic`): the distribution each was drawn from, one
    /// vocabulary-wide row per draft. Empty when the drafts were chosen
    /// outright (n-gram, argmax), which verification treats as certain.
    pub draft_probs: Vec<f32>,
    /// Verifications in a row that accepted nothing.
    pub misses: u32,
    /// Steps to go before drafting again: a sequence whose drafts keep
    /// being rejected stops paying for their verification, and tries
    /// again after a back-off that doubles with each miss.
    pub pause: u32,
    /// Drafts accepted per verification, a moving average (`None` before
    /// the first): the next draft is about one longer than what recent
    /// drafts got accepted, so a sequence that is only partly predictable
    /// verifies short drafts.
    pub accepted_avg: Option<f32>,
    /// With a draft model: how many leading tokens have the draft model's
    /// K/V in the sequence's blocks (the draft pool shares the target's
    /// block tables).
    pub draft_computed: usize,
}

impl SpecState {
    /// How many of `k` drafts to propose next.
    pub fn draft_len(&self, k: usize) -> usize {
        match self.accepted_avg {
            None => k,
            Some(a) => ((a + 1.0).ceil() as usize).clamp(1, k),
        }
    }

    /// Forgets the drafts and the draft model's K/V of a preempted
    /// sequence, whose blocks are gone; its record of how drafts fared
    /// stays.
    pub fn preempted(&mut self) {
        self.drafts.clear();
        self.draft_probs.clear();
        self.draft_computed = 0;
    }

    /// Records a verification of the drafts, `accepted` of which held.
    pub fn verified(&mut self, accepted: usize) {
        let a = accepted as f32;
        self.accepted_avg = Some(self.accepted_avg.map_or(a, |avg| 0.6 * avg + 0.4 * a));
        if accepted == 0 {
            self.misses += 1;
            if self.misses >= 2 {
                self.pause = 1 << (self.misses - 2).min(6);
            }
        } else {
            self.misses = 0;
        }
    }
}
