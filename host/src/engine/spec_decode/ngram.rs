//! The n-gram proposer (prompt lookup): the history's last `n` tokens, for
//! the largest `n` in `min..=max` that occurred earlier in the history
//! (prompt and output alike), are taken to continue as they did there.
//! Rewriting, quoting and code editing repeat long spans of the prompt, so
//! there most drafts are right; elsewhere matches are rare and nothing is
//! proposed.

/// Drafts by prompt lookup.
#[derive(Clone, Copy, Debug)]
pub struct NgramProposer {
    min: usize,
    max: usize,
}

impl NgramProposer {
    /// A proposer matching suffixes of `min..=max` tokens (`1 <= min <= max`).
    pub fn new(min: usize, max: usize) -> NgramProposer {
        NgramProposer {
            min: min.max(1),
            max: max.max(min.max(1)),
        }
    }

    /// Writes to `drafts` (emptied first) up to `k` tokens that followed
    /// the longest earlier occurrence of a suffix of `history`, of at least
    /// `min` and at most `max` tokens. Among equally long matches the most
    /// recent wins. Nothing when no suffix of `min` tokens recurs.
    pub fn propose(&self, history: &[u32], k: usize, drafts: &mut Vec<u32>) {
        drafts.clear();
        let len = history.len();
        if k == 0 || len < self.min + 1 {
            return;
        }
        let last = len - 1;
        let (mut best_len, mut best_end) = (0, 0);
        // `end` is where an earlier occurrence ends; the suffix itself ends
        // at `last`, so `end < last`.
        for end in (0..last).rev() {
            let mut m = 0;
            while m < self.max && m <= end && history[end - m] == history[last - m] {
                m += 1;
            }
            if m >= self.min && m > best_len {
                best_len = m;
                best_end = end;
                if m == self.max {
                    break;
                }
            }
        }
        if best_len == 0 {
            return;
        }
        let from = best_end + 1;
        drafts.extend_from_slice(&history[from..(from + k).min(len)]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn propose(min: usize, max: usize, history: &[u32], k: usize) -> Vec<u32> {
        let mut d = Vec::new();
        NgramProposer::new(min, max).propose(history, k, &mut d);
        d
    }

    #[test]
    fn the_tokens_after_an_earlier_occurrence_are_proposed() {
        // "1 2 3 4 5 ... 1 2 3" → "4 5 9".
        let h = [1, 2, 3, 4, 5, 9, 7, 1, 2, 3];
        assert_eq!(propose(2, 3, &h, 3), vec![4, 5, 9]);
        // k bounds the draft; the history's end bounds it too.
        assert_eq!(propose(2, 3, &h, 1), vec![4]);
        assert_eq!(propose(1, 1, &[5, 6, 5], 4), vec![6, 5]);
    }

    #[test]
    fn the_longest_match_wins_and_then_the_most_recent() {
        // Suffix "8 2 3": "2 3" occurs at 1..3 (then 4) and "8 2 3" at
        // 5..8 (then 6): the longer match proposes 6.
        let h = [0, 2, 3, 4, 8, 2, 3, 6, 1, 8, 2, 3];
        assert_eq!(propose(2, 3, &h, 1), vec![6]);
        // With max 2 both are 2 long: the most recent (then 6) wins too.
        assert_eq!(propose(2, 2, &h, 1), vec![6]);
        // Suffix "2 3" twice, equal length: the later one.
        let h = [2, 3, 4, 2, 3, 5, 2, 3];
        assert_eq!(propose(2, 2, &h, 1), vec![5]);
    }

    #[test]
    fn nothing_is_proposed_below_the_minimum_match() {
        let h = [1, 2, 3, 4, 9, 3, 4];
        assert_eq!(propose(3, 4, &h, 3), Vec::<u32>::new());
        assert_eq!(propose(2, 4, &h, 3), vec![9, 3, 4]);
        assert_eq!(propose(1, 1, &[7], 3), Vec::<u32>::new());
        assert_eq!(propose(1, 1, &[], 3), Vec::<u32>::new());
    }
}
