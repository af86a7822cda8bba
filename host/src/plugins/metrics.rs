//! Per tenant and plugin metrics, exported through the server's
//! Prometheus recorder.

use super::{ErrorKind, HookKind};
use std::time::Duration;

pub const CALLS: &str = "pagoda_plugin_calls_total";
pub const ERRORS: &str = "pagoda_plugin_errors_total";
pub const LATENCY: &str = "pagoda_plugin_hook_duration_seconds";
pub const FUEL: &str = "pagoda_plugin_fuel_consumed_total";

/// Latency buckets: hooks take microseconds, deadlines are ~100 ms.
pub const BUCKETS: &[f64] = &[
    0.000_01, 0.000_025, 0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025,
    0.05, 0.1, 0.25, 1.0,
];

pub struct Labels {
    tenant: String,
    plugin: String,
    hook: &'static str,
}

impl Labels {
    pub fn new(tenant: &str, plugin: &str, hook: HookKind) -> Labels {
        Labels {
            tenant: tenant.to_string(),
            plugin: plugin.to_string(),
            hook: hook.as_str(),
        }
    }
}

pub fn describe() {
    metrics::describe_counter!(CALLS, "Plugin hook calls, by tenant, plugin and hook.");
    metrics::describe_counter!(
        ERRORS,
        "Plugin hook failures by kind (trap, timeout, oom, output_too_large, reject, ...)."
    );
    metrics::describe_histogram!(LATENCY, "Plugin hook call latency, seconds.");
    metrics::describe_counter!(
        FUEL,
        "Fuel consumed by plugin hook calls (with --plugin-fuel)."
    );
}

pub fn record(l: &Labels, took: Duration, error: Option<ErrorKind>, fuel: Option<u64>) {
    let base = [
        ("tenant", crate::tenants::metric_label::of(&l.tenant)),
        ("plugin", l.plugin.clone()),
        ("hook", l.hook.to_string()),
    ];
    metrics::counter!(CALLS, &base).increment(1);
    metrics::histogram!(LATENCY, &base).record(took.as_secs_f64());
    if let Some(k) = error {
        let mut labels = base.to_vec();
        labels.push(("kind", k.as_str().to_string()));
        metrics::counter!(ERRORS, &labels).increment(1);
    }
    if let Some(f) = fuel {
        metrics::counter!(FUEL, &base).increment(f);
    }
}

/// A `route` rejection counts as an error of kind `reject`.
pub fn reject(l: &Labels) {
    let labels = [
        ("tenant", crate::tenants::metric_label::of(&l.tenant)),
        ("plugin", l.plugin.clone()),
        ("hook", l.hook.to_string()),
        ("kind", "reject".to_string()),
    ];
    metrics::counter!(ERRORS, &labels).increment(1);
}
