//! What the recurrent layers' ops share (the causal conv1d and the gated
//! delta rule): a step's sequences with their state slots, the check that
//! their tasks can write without synchronization, and the pointer those
//! tasks share.

/// One sequence of a step, for the recurrent layers' ops.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RecurrentSeq {
    /// Its first row among the step's tokens.
    pub q_start: usize,
    /// Its tokens in this step.
    pub q_len: usize,
    /// The position of its first token in this step. At 0 the sequence
    /// starts from a zero state, whatever its slot holds.
    pub start_pos: usize,
    /// Its state slot.
    pub slot: usize,
}

/// Panics unless every sequence's slot lies within `state_len` values of
/// `slot_len`-value slots and no two sequences share a slot or a row: the
/// ops' tasks write those without synchronization.
pub(super) fn check_slots(op: &str, seqs: &[RecurrentSeq], state_len: usize, slot_len: usize) {
    for (i, s) in seqs.iter().enumerate() {
        assert!(
            (s.slot + 1) * slot_len <= state_len,
            "{op}: slot {} outside a state of {} slots",
            s.slot,
            state_len / slot_len.max(1)
        );
        for (j, o) in seqs[..i].iter().enumerate() {
            assert!(
                o.slot != s.slot,
                "{op}: sequences {j} and {i} share slot {}",
                s.slot
            );
            assert!(
                o.q_len == 0
                    || s.q_len == 0
                    || o.q_start + o.q_len <= s.q_start
                    || s.q_start + s.q_len <= o.q_start,
                "{op}: sequences {j} and {i} overlap in rows"
            );
        }
    }
}

/// A raw pointer the pool's tasks share; see the SAFETY notes at its uses.
pub(super) struct SendPtr(pub(super) *mut f32);
// SAFETY: the tasks that share one write disjoint elements (see uses).
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}
