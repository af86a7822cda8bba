//! What the pooling endpoints (embeddings, score and rerank, classify)
//! share: submitting inputs as pooling requests and collecting their
//! vectors, their options, length checks and usage records; and the
//! refusal of generation requests to a model served for pooling.

use crate::engine::async_engine::SubmitError;
use crate::engine::core::RequestOptions;
use crate::engine::request::SamplingParams;
use crate::server::errors::ApiError;
use crate::server::openai::engine_io::InFlight;
use crate::server::openai::tenant::TenantCtx;
use crate::server::AppState;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use tokio::sync::mpsc;

/// Refuses a generation request (`endpoint`) to a model served for
/// pooling, as vLLM does: a 400 that names the endpoint to use instead.
pub(crate) fn refuse_generation(
    engine: &crate::engine::async_engine::AsyncEngine,
    endpoint: &str,
) -> Result<(), ApiError> {
    if let Some(p) = engine.pooler().filter(|_| !engine.generates()) {
        let instead = match p.task {
            crate::engine::pooling::PoolingTask::Embed => "Use /v1/embeddings.",
            crate::engine::pooling::PoolingTask::Score => {
                "It is a cross-encoder: use /score, /v1/score, /rerank, /v1/rerank or /v2/rerank."
            }
            crate::engine::pooling::PoolingTask::Classify => "It is a classifier: use /classify.",
        };
        return Err(ApiError::invalid(
            Some("model".into()),
            format!("The model does not support {endpoint}: it is served for pooling (--runner pooling). {instead}"),
        ));
    }
    Ok(())
}

/// Meters a pooling request as generation is: counted, and on disk with
/// --usage-log before the response goes out.
pub(crate) async fn meter_pooling(
    state: &Arc<AppState>,
    ctx_tenant: Option<String>,
    id: &str,
    endpoint: &str,
    model: &str,
    prompt_tokens: usize,
    created_ms: u64,
) -> Result<(), ApiError> {
    let (tenant, key_id, adapter) = crate::server::access_log::current()
        .map(|l| l.who())
        .unwrap_or_default();
    let record = crate::metering::UsageRecord {
        id: crate::metering::record_id(),
        request_id: id.to_string(),
        tenant: tenant.or(ctx_tenant),
        key_id,
        endpoint: endpoint.to_string(),
        model: model.to_string(),
        adapter,
        prompt_tokens: prompt_tokens as u64,
        cached_tokens: 0,
        completion_tokens: 0,
        spec_accepted_tokens: 0,
        finish_reasons: Vec::new(),
        status: crate::metering::RecordStatus::Ok,
        created_ms,
        finished_ms: crate::metering::now_ms(),
    };
    crate::server::openai::engine_io::meter(state, &record).await
}

/// `truncate_prompt_tokens` as vLLM reads it on every pooling endpoint:
/// absent keeps the whole input, -1 truncates to the context's length, `k`
/// (1 to `max_len`) to `k` tokens; anything else is a 400.
pub(crate) fn truncation(asked: Option<i64>, max_len: usize) -> Result<Option<usize>, ApiError> {
    let bad = |m: String| ApiError::invalid(Some("truncate_prompt_tokens".into()), m);
    match asked {
        None => Ok(None),
        Some(-1) => Ok(Some(max_len)),
        Some(k) if k >= 1 && k as usize <= max_len => Ok(Some(k as usize)),
        Some(k) if k < 1 => Err(bad(format!("truncate_prompt_tokens {k}: give -1 (the context's length) or a positive number of tokens to keep"))),
        Some(k) => Err(bad(format!("truncate_prompt_tokens value ({k}) is greater than max_model_len ({max_len}). Please request a smaller truncation size."))),
    }
}

/// vLLM's 400 for an input longer than the model's context, naming what
/// the input was for ("embedding generation", "score", "classification").
pub(crate) fn check_input_lengths(
    prompts: &[Vec<u32>],
    max_len: usize,
    purpose: &str,
) -> Result<(), ApiError> {
    match prompts.iter().find(|ids| ids.len() > max_len) {
        Some(ids) => Err(ApiError::context_length(
            "input",
            format!(
                "This model's maximum context length is {max_len} tokens. However, you requested {} tokens in the input for {purpose}. Please reduce the length of the input.",
                ids.len()
            ),
        )),
        None => Ok(()),
    }
}

/// A pooling request's options: its priority and, under a tenant, as for
/// generation, the tenant's cache salt (blocks shared only within its
/// cache group) and its fair share.
pub(crate) fn pooling_options(priority: Option<i64>, ctx: Option<&TenantCtx>) -> RequestOptions {
    let mut opts = RequestOptions {
        pooling: true,
        priority: priority.unwrap_or(0),
        ..Default::default()
    };
    if let Some(t) = ctx {
        opts.cache_salt =
            crate::server::openai::protocol::salt_of(&format!("{}:0", t.cache_scope()));
        opts.tenant = t.share();
    }
    opts
}

/// Submits every prompt as a pooling request and waits for their raw
/// pooled vectors, in prompt order. Dropping the future (the client went
/// away) aborts what is still running.
pub(crate) async fn run(
    state: &Arc<AppState>,
    engine: &crate::engine::async_engine::AsyncEngine,
    id: &str,
    prompts: &[Vec<u32>],
    opts: RequestOptions,
) -> Result<Vec<Vec<f32>>, ApiError> {
    let in_flight = state.in_flight.fetch_add(1, Ordering::AcqRel) + 1;
    let _slot = InFlight(Arc::clone(state));
    if in_flight > state.max_pending {
        return Err(ApiError::overloaded(format!(
            "The server has {} requests in flight, its limit (--max-pending-requests). Retry later.",
            state.max_pending
        )));
    }
    let (tx, mut rx) = mpsc::unbounded_channel();
    let mut guard = engine.abort_guard();
    let mut index_of = std::collections::HashMap::new();
    for (i, ids) in prompts.iter().enumerate() {
        let eid = engine
            .submit(
                format!("{id}-{i}"),
                ids.clone(),
                SamplingParams::default(),
                opts.clone(),
                tx.clone(),
            )
            .await
            .map_err(|e| match e {
                SubmitError::Invalid(e) => {
                    // The engine names the prompt; this API calls it input.
                    let param = if e.param == "prompt" {
                        "input"
                    } else {
                        e.param
                    };
                    ApiError::invalid(Some(param.to_string()), e.message)
                }
                SubmitError::EngineDead => ApiError::unavailable("the engine has stopped"),
            })?;
        guard.push(eid);
        index_of.insert(eid, i);
    }
    // Only the engine holds senders now: if it dies, the channel closes.
    drop(tx);
    if let Some(l) = crate::server::access_log::current() {
        l.set_request_id(id);
        l.set_tokens(prompts.iter().map(Vec::len).sum(), 0);
    }
    let mut out: Vec<Option<Vec<f32>>> = vec![None; prompts.len()];
    let mut remaining = prompts.len();
    while remaining > 0 {
        let Some(o) = rx.recv().await else {
            return Err(ApiError::unavailable(match engine.death() {
                Some(why) => format!("the engine stopped: {why}"),
                None => "the engine stopped".into(),
            }));
        };
        let Some(&i) = index_of.get(&o.id) else {
            continue;
        };
        if o.finish_reason.is_none() {
            continue;
        }
        match o.pooled {
            Some(v) if out[i].is_none() => {
                out[i] = Some(v);
                remaining -= 1;
            }
            Some(_) => {}
            None => {
                return Err(ApiError::internal(format!(
                    "input {i}: the engine finished it without a pooled vector"
                )))
            }
        }
    }
    guard.disarm();
    Ok(out.into_iter().flatten().collect())
}
