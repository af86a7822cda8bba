//! Exact metering: one usage record per finished request, from the
//! engine's own counts, for billing.
//!
//! A record ([`UsageRecord`]) carries the tenant, a hash of the key, the
//! model or adapter, the prompt, cached-prompt, completion and accepted
//! speculative tokens, the finish reasons, the times and the status. The
//! server makes it when a request's outputs are complete and, with
//! `--usage-log`, has it on disk before the response's last bytes go out
//! ([`UsageLog::commit`]): a record is never lost once its response has
//! been sent. A request that ends otherwise (the client went away, an
//! error) is recorded too, without waiting.
//!
//! `--usage-log` takes a local file (JSON lines, appended and synced) or an
//! object store URL (`s3://…`, `gs://…`, `az://…`, `file:///…`): records are
//! then spooled in `--usage-log-spool` and [shipped](ship) in batches, at
//! least once; each record's `id` is the key to deduplicate on.
//!
//! Whatever the log, every record is counted in
//! `pagoda_tenant_tokens_total{tenant, kind}` (`kind`: prompt, cached,
//! completion, spec_accepted), so the counters and the log agree.

pub mod ship;
pub mod spool;

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// Metric names.
pub mod metrics {
    /// Tokens per tenant and kind, from the usage records.
    pub const TENANT_TOKENS: &str = "pagoda_tenant_tokens_total";
}

/// How a metered request ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RecordStatus {
    /// Its response was complete (every choice finished).
    Ok,
    /// It stopped before that: the client went away, or it failed.
    Aborted,
}

/// One finished request, as billed.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct UsageRecord {
    /// Unique per record, kept when a record is shipped again: the key to
    /// deduplicate on.
    pub id: String,
    /// The id its response carries (`chatcmpl-…`, `cmpl-…`, `resp_…`, `msg_…`).
    pub request_id: String,
    /// The tenant it was served for (none without tenants).
    pub tenant: Option<String>,
    /// The first 16 hex digits of the salted hash of the API key it came
    /// with (never the key), so a tenant's keys can be told apart.
    pub key_id: Option<String>,
    /// The route it came in on (`/v1/chat/completions`, ...).
    pub endpoint: String,
    /// The model name the request asked for.
    pub model: String,
    /// The LoRA adapter it ran with, if any.
    pub adapter: Option<String>,
    /// Prompt tokens over all choices, as the response's usage counts them.
    pub prompt_tokens: u64,
    /// Of those, tokens found in the prefix cache.
    pub cached_tokens: u64,
    /// Generated tokens over all choices.
    pub completion_tokens: u64,
    /// Of those, drafts that the target model accepted.
    pub spec_accepted_tokens: u64,
    /// Each choice's finish reason (`null` for one that did not finish).
    pub finish_reasons: Vec<Option<String>>,
    pub status: RecordStatus,
    /// Arrival and end, in milliseconds since the Unix epoch.
    pub created_ms: u64,
    pub finished_ms: u64,
}

/// A fresh record id.
pub fn record_id() -> String {
    format!("urec-{:032x}", rand::random::<u128>())
}

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Counts `r` in `pagoda_tenant_tokens_total`.
pub fn count(r: &UsageRecord) {
    let tenant = crate::tenants::metric_label::of(r.tenant.as_deref().unwrap_or("default"));
    for (kind, n) in [
        ("prompt", r.prompt_tokens),
        ("cached", r.cached_tokens),
        ("completion", r.completion_tokens),
        ("spec_accepted", r.spec_accepted_tokens),
    ] {
        ::metrics::counter!(metrics::TENANT_TOKENS, "tenant" => tenant.clone(), "kind" => kind)
            .increment(n);
    }
}

/// `--usage-log` and the flags beside it.
#[derive(Clone, Debug)]
pub struct UsageLogConfig {
    /// A local file, or an object store URL.
    pub target: String,
    /// `--usage-log-spool`: where records wait for an object store.
    pub spool: Option<PathBuf>,
    /// `--usage-log-flush-seconds`: how often spooled records are shipped.
    pub flush: Duration,
}

/// Where usage records go.
pub struct UsageLog {
    spool: spool::Spool,
    /// Tells the shipper to ship once more and stop.
    stop: Option<tokio::sync::watch::Sender<bool>>,
    shipper: std::sync::Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl UsageLog {
    /// Opens the log `config` names (and, for an object store, starts
    /// shipping on the current Tokio runtime).
    pub fn open(config: &UsageLogConfig) -> Result<Arc<UsageLog>> {
        let is_url = config.target.contains("://");
        if !is_url {
            let spool = spool::Spool::open(spool::Layout::File(PathBuf::from(&config.target)))
                .with_context(|| format!("--usage-log {}", config.target))?;
            return Ok(Arc::new(UsageLog {
                spool,
                stop: None,
                shipper: std::sync::Mutex::new(None),
            }));
        }
        let Some(dir) = &config.spool else {
            anyhow::bail!(
                "--usage-log {}: records for an object store wait in a local spool; give --usage-log-spool DIR (or --state-dir, whose usage-spool it then uses)",
                config.target
            );
        };
        let store = crate::object_url::open("--usage-log", &config.target)?;
        let spool = spool::Spool::open(spool::Layout::Segments(dir.clone()))
            .with_context(|| format!("--usage-log-spool {}", dir.display()))?;
        let shipper = ship::Shipper::new(dir.clone(), store.store, &store.prefix, spool.durable())?;
        let (stop, stopped) = tokio::sync::watch::channel(false);
        let task = tokio::spawn(shipper.run(config.flush, stopped));
        Ok(Arc::new(UsageLog {
            spool,
            stop: Some(stop),
            shipper: std::sync::Mutex::new(Some(task)),
        }))
    }

    /// Writes `r` and waits until it is on disk.
    pub async fn commit(&self, r: &UsageRecord) -> Result<(), String> {
        let line = serde_json::to_vec(r).map_err(|e| e.to_string())?;
        self.spool.commit(line).await
    }

    /// Writes `r` without waiting.
    pub fn submit(&self, r: &UsageRecord) {
        if let Ok(line) = serde_json::to_vec(r) {
            self.spool.submit(line);
        }
    }

    /// Ships what is spooled once more and stops shipping (at shutdown).
    pub async fn close(&self) {
        if let Some(stop) = &self.stop {
            let _ = stop.send(true);
        }
        let task = self
            .shipper
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        if let Some(t) = task {
            let _ = tokio::time::timeout(Duration::from_secs(10), t).await;
        }
    }
}
