//! Weighted fair share between tenants, for the scheduler's `fair` policy.
//!
//! Each tenant has a weight and a priority class (from its configuration,
//! carried by each of its requests as a [`TenantShare`]). Two quantities
//! decide who goes next:
//!
//! - **Sequence slots.** Decode work is one token per running sequence per
//!   step, so a tenant's share of the running sequences is its share of
//!   decode throughput. When the engine is full (the sequence cap or the KV
//!   pool), a tenant with waiting work may take a slot from a tenant that
//!   holds more running sequences per unit of weight than it would after
//!   the move ([`FairShare::may_take_from`]). That rule only ever moves a
//!   slot towards the weighted split, so slots settle instead of flapping,
//!   and the preempted sequence is the over-share tenant's newest.
//! - **Virtual time over tokens.** Every scheduled token (prefill chunk or
//!   decode) advances its tenant's virtual time by `1 / weight`. Prefill
//!   chunks and admissions go to the tenant with the least virtual time
//!   first, so a tenant with a short prompt is not queued behind another
//!   tenant's long ones. A tenant that had no work re-enters at the least
//!   virtual time among the active tenants: idling banks no credit, and a
//!   tenant that was busy before carries no debt.
//!
//! Priority classes are strict: a lower class is always served first, and
//! may take slots from any higher class.
//!
//! Tenants with no running or waiting request are forgotten, so the table
//! holds only active tenants.

use std::cmp::Ordering;
use std::collections::HashMap;
use std::sync::Arc;

/// Which tenant a request belongs to, and that tenant's share.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TenantShare {
    /// The tenant's id; requests of servers without tenants share one
    /// unnamed tenant (`""`).
    pub name: Arc<str>,
    /// Relative share of the engine under contention (at least 1).
    pub weight: u32,
    /// Lower classes are served first; 0 is the default.
    pub priority_class: i64,
    /// Its part of the KV cache, if its config sets one.
    pub kv: Option<KvShare>,
}

/// A tenant's part of the KV-cache block pool, in thousandths of it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KvShare {
    /// Cached blocks other tenants cannot evict while the tenant holds no
    /// more than this.
    pub reserved_permille: u16,
    /// The most the tenant may hold, running plus cached (1000: no cap).
    pub max_permille: u16,
}

impl KvShare {
    /// The limits in blocks of a pool of `num_blocks`.
    pub fn limits(&self, num_blocks: usize) -> crate::engine::kv_cache::OwnerLimits {
        let of = |permille: u16| num_blocks * permille.min(1000) as usize / 1000;
        crate::engine::kv_cache::OwnerLimits {
            reserved: of(self.reserved_permille),
            cap: (self.max_permille < 1000).then(|| of(self.max_permille).max(1)),
        }
    }
}

impl Default for TenantShare {
    fn default() -> Self {
        TenantShare {
            name: Arc::from(""),
            weight: 1,
            priority_class: 0,
            kv: None,
        }
    }
}

/// What the engine holds of one tenant now, for metrics.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TenantLoad {
    pub name: Arc<str>,
    pub running: usize,
    pub waiting: usize,
}

#[derive(Clone, Debug)]
struct TenantState {
    weight: f64,
    class: i64,
    vtime: f64,
    running: usize,
    waiting: usize,
}

impl TenantState {
    /// Running sequences per unit of weight.
    fn slots_per_weight(&self) -> f64 {
        self.running as f64 / self.weight
    }
}

/// The active tenants' accounts.
#[derive(Debug, Default)]
pub struct FairShare {
    tenants: HashMap<Arc<str>, TenantState>,
}

/// The order in which tenants are served: class, then fewest slots per
/// weight, then least virtual time. Smaller is served first; the largest
/// is the furthest over its share, whose sequences are preempted first.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ServeKey {
    class: i64,
    slots_per_weight: f64,
    vtime: f64,
}

impl ServeKey {
    /// Total order (the floats are finite: counts over positive weights).
    pub fn compare(&self, other: &ServeKey) -> Ordering {
        self.class
            .cmp(&other.class)
            .then(self.slots_per_weight.total_cmp(&other.slots_per_weight))
            .then(self.vtime.total_cmp(&other.vtime))
    }
}

impl FairShare {
    /// A request of `share` arrived (or came back from preemption, which
    /// [`FairShare::preempted`] handles instead). A tenant that was idle
    /// re-enters at the least virtual time of the active tenants.
    pub fn arrived(&mut self, share: &TenantShare) {
        let floor = self
            .tenants
            .values()
            .map(|t| t.vtime)
            .min_by(f64::total_cmp)
            .unwrap_or(0.0);
        let t = self
            .tenants
            .entry(share.name.clone())
            .or_insert_with(|| TenantState {
                weight: 1.0,
                class: 0,
                vtime: floor,
                running: 0,
                waiting: 0,
            });
        // The latest request carries the tenant's current configuration.
        t.weight = f64::from(share.weight.max(1));
        t.class = share.priority_class;
        t.waiting += 1;
    }

    /// A waiting request of `tenant` started running.
    pub fn admitted(&mut self, tenant: &str) {
        if let Some(t) = self.tenants.get_mut(tenant) {
            t.waiting = t.waiting.saturating_sub(1);
            t.running += 1;
        }
    }

    /// A running request of `tenant` went back to waiting.
    pub fn preempted(&mut self, tenant: &str) {
        if let Some(t) = self.tenants.get_mut(tenant) {
            t.running = t.running.saturating_sub(1);
            t.waiting += 1;
        }
    }

    /// A request of `tenant` left the engine (finished or aborted), from
    /// the running queue or the waiting one.
    pub fn left(&mut self, tenant: &str, was_running: bool) {
        let idle = match self.tenants.get_mut(tenant) {
            Some(t) => {
                if was_running {
                    t.running = t.running.saturating_sub(1);
                } else {
                    t.waiting = t.waiting.saturating_sub(1);
                }
                t.running == 0 && t.waiting == 0
            }
            None => false,
        };
        if idle {
            self.tenants.remove(tenant);
        }
    }

    /// `tokens` of `tenant` were scheduled: its virtual time advances by
    /// `tokens / weight`.
    pub fn charge(&mut self, tenant: &str, tokens: usize) {
        if let Some(t) = self.tenants.get_mut(tenant) {
            t.vtime += tokens as f64 / t.weight;
        }
    }

    /// Where `tenant` stands in the serving order.
    pub fn key(&self, tenant: &str) -> ServeKey {
        match self.tenants.get(tenant) {
            Some(t) => ServeKey {
                class: t.class,
                slots_per_weight: t.slots_per_weight(),
                vtime: t.vtime,
            },
            None => ServeKey {
                class: 0,
                slots_per_weight: 0.0,
                vtime: 0.0,
            },
        }
    }

    /// The tenant's weight over the smallest weight among the active
    /// tenants (1.0 for an unknown tenant): how many units of a per-tenant
    /// step bound it gets, so that bounding a step keeps the weighted split.
    pub fn weight_units(&self, tenant: &str) -> f64 {
        let least = self
            .tenants
            .values()
            .map(|t| t.weight)
            .min_by(f64::total_cmp)
            .unwrap_or(1.0);
        self.tenants
            .get(tenant)
            .map_or(1.0, |t| t.weight / least.max(1.0))
    }

    /// The tenant's priority class and virtual time: the order in which
    /// running sequences get the step's token budget (smaller first).
    pub fn budget_order(&self, tenant: &str) -> (i64, f64) {
        self.tenants
            .get(tenant)
            .map_or((0, 0.0), |t| (t.class, t.vtime))
    }

    /// Whether `taker`, which has waiting work and cannot be admitted, may
    /// preempt one running sequence of `holder`: `holder` is in a worse
    /// priority class, or in the same class and still holds at least as many
    /// slots per weight as `taker` would after the move. The second test
    /// fails for the reverse move once it has succeeded, so slots never
    /// flap between two tenants.
    pub fn may_take_from(&self, taker: &str, holder: &str) -> bool {
        if taker == holder {
            return false;
        }
        let (Some(t), Some(h)) = (self.tenants.get(taker), self.tenants.get(holder)) else {
            return false;
        };
        if h.running == 0 || t.class > h.class {
            return false;
        }
        if t.class < h.class {
            return true;
        }
        (t.running + 1) as f64 / t.weight <= (h.running - 1) as f64 / h.weight
    }

    /// Whether `tenant` is strictly first in the serving order (see
    /// [`ServeKey`]): ahead of every other active tenant, ties excluded.
    pub fn is_first(&self, tenant: &str) -> bool {
        let Some(mine) = self.tenants.get(tenant).map(|_| self.key(tenant)) else {
            return false;
        };
        self.tenants
            .keys()
            .filter(|t| &***t != tenant)
            .all(|t| mine.compare(&self.key(t)) == Ordering::Less)
    }

    /// How many tenants have requests in the engine.
    pub fn num_tenants(&self) -> usize {
        self.tenants.len()
    }

    /// Every active tenant's running and waiting requests.
    pub fn loads(&self) -> Vec<TenantLoad> {
        let mut v: Vec<TenantLoad> = self
            .tenants
            .iter()
            .map(|(name, t)| TenantLoad {
                name: name.clone(),
                running: t.running,
                waiting: t.waiting,
            })
            .collect();
        v.sort_by(|a, b| a.name.cmp(&b.name));
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn share(name: &str, weight: u32, class: i64) -> TenantShare {
        TenantShare {
            name: Arc::from(name),
            weight,
            priority_class: class,
            kv: None,
        }
    }

    /// Runs `n` admissions of each tenant, then moves slots by
    /// `may_take_from` until no move is allowed; returns the running counts.
    fn settle(f: &mut FairShare, a: usize, b: usize) -> (usize, usize) {
        for _ in 0..a {
            f.admitted("a");
        }
        for _ in 0..b {
            f.admitted("b");
        }
        for _ in 0..100 {
            if f.may_take_from("a", "b") {
                f.preempted("b");
                f.admitted("a");
            } else if f.may_take_from("b", "a") {
                f.preempted("a");
                f.admitted("b");
            } else {
                break;
            }
        }
        (f.tenants["a"].running, f.tenants["b"].running)
    }

    #[test]
    fn slots_settle_at_the_weighted_split_from_either_side() {
        for (start_a, start_b) in [(8, 0), (0, 8), (4, 4), (7, 1)] {
            let mut f = FairShare::default();
            for _ in 0..20 {
                f.arrived(&share("a", 3, 0));
                f.arrived(&share("b", 1, 0));
            }
            assert_eq!(
                settle(&mut f, start_a, start_b),
                (6, 2),
                "from {start_a}:{start_b}"
            );
        }
    }

    #[test]
    fn equal_weights_split_evenly_and_never_flap() {
        let mut f = FairShare::default();
        for _ in 0..10 {
            f.arrived(&share("a", 1, 0));
            f.arrived(&share("b", 1, 0));
        }
        assert_eq!(settle(&mut f, 7, 0), (4, 3));
        assert!(!f.may_take_from("a", "b") && !f.may_take_from("b", "a"));
    }

    #[test]
    fn a_better_class_takes_any_slot_and_a_worse_one_none() {
        let mut f = FairShare::default();
        f.arrived(&share("gold", 1, 0));
        f.arrived(&share("free", 1, 5));
        f.admitted("free");
        assert!(f.may_take_from("gold", "free"));
        f.admitted("gold");
        f.arrived(&share("free", 1, 5));
        assert!(!f.may_take_from("free", "gold"));
    }

    #[test]
    fn a_tenant_enters_at_the_least_active_virtual_time() {
        let mut f = FairShare::default();
        f.arrived(&share("a", 1, 0));
        f.admitted("a");
        f.charge("a", 1000);
        // b is new: it starts level with a, with no credit for its absence.
        f.arrived(&share("b", 2, 0));
        assert_eq!(f.key("b").vtime, 1000.0);
        f.admitted("b");
        f.charge("b", 400);
        assert_eq!(f.key("b").vtime, 1200.0);
        // a goes idle and is forgotten; back, it starts at b's virtual
        // time, not at its own 1000.
        f.left("a", true);
        assert!(f.loads().iter().all(|l| &*l.name != "a"));
        f.arrived(&share("a", 1, 0));
        assert_eq!(f.key("a").vtime, 1200.0);
    }

    #[test]
    fn tokens_advance_virtual_time_by_the_inverse_weight() {
        let mut f = FairShare::default();
        f.arrived(&share("heavy", 4, 0));
        f.charge("heavy", 100);
        assert_eq!(f.key("heavy").vtime, 25.0);
    }
}
