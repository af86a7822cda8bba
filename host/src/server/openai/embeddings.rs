//! `POST /v1/embeddings`, with OpenAI's request and response shapes and
//! vLLM's extra fields and errors: `input` as a string, a list of strings,
//! a list of token ids or a list of token-id lists; `encoding_format`
//! `float` or `base64`; `dimensions` (Matryoshka truncation);
//! `truncate_prompt_tokens`, `add_special_tokens`, `normalize` and
//! `priority` as vLLM takes them.
//!
//! Each input is one pooling request in the engine's ordinary batches
//! (see [`crate::engine::pooling`]); tenants are admitted, routed through
//! their plugins' `route` hook, scheduled by fair share and charged the
//! inputs' tokens as generation requests are.

use super::{admit, now_secs, off_runtime, random_id, InFlight};
use crate::engine::async_engine::SubmitError;
use crate::engine::core::RequestOptions;
use crate::engine::request::SamplingParams;
use crate::server::errors::{json_response, ApiError};
use crate::server::{AppState, Body};
use hyper::Response;
use serde::Deserialize;
use serde_json::{json, Value};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use tokio::sync::mpsc;

/// The request body, as OpenAI and vLLM define it. Fields vLLM accepts
/// and that change nothing here (`user`) are read and dropped; unknown
/// fields are ignored, as vLLM ignores them.
#[derive(Deserialize)]
struct EmbeddingRequest {
    model: Option<String>,
    input: Value,
    #[serde(default)]
    encoding_format: Option<String>,
    #[serde(default)]
    dimensions: Option<i64>,
    #[serde(default)]
    #[allow(dead_code)]
    user: Option<String>,
    /// vLLM's: keep only the last k tokens of each input (-1: the
    /// context's length).
    #[serde(default)]
    truncate_prompt_tokens: Option<i64>,
    /// vLLM's: whether the tokenizer adds its special tokens (default true).
    #[serde(default)]
    add_special_tokens: Option<bool>,
    /// vLLM's: whether to L2-normalize (default: the model's pooler).
    #[serde(default)]
    normalize: Option<bool>,
    #[serde(default)]
    priority: Option<i64>,
}

/// One input, before or after tokenizing.
enum Input {
    Text(String),
    Tokens(Vec<u32>),
}

const INPUT_SHAPES: &str = "'input' must be a string, an array of strings, an array of token ids, or an array of token-id arrays";

/// Reads `input` in any of its four shapes.
fn parse_input(v: &Value) -> Result<Vec<Input>, ApiError> {
    let bad = || ApiError::invalid(Some("input".into()), INPUT_SHAPES);
    let token = |x: &Value| -> Result<u32, ApiError> {
        x.as_u64()
            .and_then(|t| u32::try_from(t).ok())
            .ok_or_else(|| {
                ApiError::invalid(
                    Some("input".into()),
                    "token ids must be non-negative integers",
                )
            })
    };
    let inputs = match v {
        Value::String(s) => vec![Input::Text(s.clone())],
        Value::Array(items) if items.is_empty() => {
            return Err(ApiError::invalid(
                Some("input".into()),
                "'input' must not be empty",
            ))
        }
        Value::Array(items) => match &items[0] {
            Value::String(_) => items
                .iter()
                .map(|x| {
                    x.as_str()
                        .map(|s| Input::Text(s.to_owned()))
                        .ok_or_else(bad)
                })
                .collect::<Result<_, _>>()?,
            Value::Number(_) => vec![Input::Tokens(
                items.iter().map(token).collect::<Result<_, _>>()?,
            )],
            Value::Array(_) => items
                .iter()
                .map(|x| match x {
                    Value::Array(ids) => Ok(Input::Tokens(
                        ids.iter().map(token).collect::<Result<_, _>>()?,
                    )),
                    _ => Err(bad()),
                })
                .collect::<Result<_, _>>()?,
            _ => return Err(bad()),
        },
        _ => return Err(bad()),
    };
    Ok(inputs)
}

/// Little-endian float32 bytes in standard base64 (with padding), as
/// vLLM and OpenAI encode `encoding_format: "base64"` (the openai SDK
/// decodes it with `np.frombuffer(base64.b64decode(s), dtype="float32")`).
fn base64_f32(v: &[f32]) -> String {
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    base64(&bytes)
}

/// RFC 4648 base64 with padding.
fn base64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            chunk.get(1).copied().unwrap_or(0),
            chunk.get(2).copied().unwrap_or(0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(ALPHABET[((n >> (18 - 6 * i)) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

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

/// Refuses a classifier at an embeddings endpoint, as vLLM does: a 400
/// that names the endpoint to use instead.
pub(super) fn refuse_non_embedding(
    model: &str,
    pooler: &crate::engine::pooling::PoolerConfig,
) -> Result<(), ApiError> {
    let instead = match pooler.task {
        crate::engine::pooling::PoolingTask::Embed => return Ok(()),
        crate::engine::pooling::PoolingTask::Score => "it is a cross-encoder, which scores pairs. Use /score, /v1/score, /rerank, /v1/rerank or /v2/rerank.",
        crate::engine::pooling::PoolingTask::Classify => "it is a classifier. Use /classify.",
    };
    Err(ApiError::invalid(
        Some("model".into()),
        format!("The model {model:?} does not support the Embeddings API: {instead}"),
    ))
}

/// The routes that return pooled vectors: OpenAI's embeddings, vLLM's
/// `/pooling` (the same request; each vector as `data` of an object
/// `"pooling"`), and Cohere's `/v2/embed` as vLLM serves it.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum PoolingRoute {
    Embeddings,
    Pooling,
    CohereEmbed,
}

/// Cohere's `/v2/embed` body, as vLLM's `CohereEmbedRequest` takes it
/// (texts only: `images` and `inputs` are refused by name).
#[derive(Deserialize)]
struct CohereEmbedRequest {
    model: Option<String>,
    /// Cohere's `search_query`, `search_document`, ...: prompts a model
    /// may prepend per type; the encoders served here have none, so it
    /// changes nothing.
    #[serde(default)]
    #[allow(dead_code)]
    input_type: Option<String>,
    #[serde(default)]
    texts: Option<Vec<String>>,
    #[serde(default)]
    images: Option<Value>,
    #[serde(default)]
    inputs: Option<Value>,
    #[serde(default)]
    output_dimension: Option<i64>,
    #[serde(default)]
    embedding_types: Option<Vec<String>>,
    #[serde(default)]
    truncate: Option<String>,
    #[serde(default)]
    priority: Option<i64>,
}

/// Translates a `/v2/embed` body into the embeddings request it asks
/// for, with the embedding types the response carries.
fn cohere_request(body: Value) -> Result<(EmbeddingRequest, Vec<String>), ApiError> {
    let r: CohereEmbedRequest = serde_json::from_value(body).map_err(|e| {
        ApiError::invalid(
            None,
            format!("invalid /v2/embed request: {e} (it takes Cohere's embed fields: model, texts, input_type, embedding_types, output_dimension, truncate)"),
        )
    })?;
    for (name, v) in [("images", &r.images), ("inputs", &r.inputs)] {
        if v.as_ref().is_some_and(|v| !v.is_null()) {
            return Err(ApiError::invalid(
                Some(name.into()),
                format!("'{name}' (image inputs) is not supported: this model embeds text; give 'texts'"),
            ));
        }
    }
    let Some(texts) = r.texts else {
        return Err(ApiError::invalid(
            Some("texts".into()),
            "'texts' is required",
        ));
    };
    if texts.is_empty() {
        return Err(ApiError::invalid(
            Some("texts".into()),
            "'texts' must not be empty",
        ));
    }
    let types = r.embedding_types.unwrap_or_else(|| vec!["float".into()]);
    for t in &types {
        if !matches!(t.as_str(), "float" | "binary" | "ubinary" | "base64") {
            return Err(ApiError::invalid(
                Some("embedding_types".into()),
                format!("embedding type {t:?} is not supported: give \"float\", \"binary\", \"ubinary\" or \"base64\""),
            ));
        }
    }
    // START keeps the last tokens (vLLM's truncate_prompt_tokens -1); END
    // and NONE keep the input whole, so one over the context is refused.
    let truncate_prompt_tokens = match r.truncate.as_deref() {
        None | Some("END") | Some("NONE") => None,
        Some("START") => Some(-1),
        Some(other) => {
            return Err(ApiError::invalid(
                Some("truncate".into()),
                format!("truncate {other:?}: expected \"NONE\", \"START\" or \"END\""),
            ))
        }
    };
    Ok((
        EmbeddingRequest {
            model: r.model,
            input: json!(texts),
            encoding_format: None,
            dimensions: r.output_dimension,
            user: None,
            truncate_prompt_tokens,
            add_special_tokens: None,
            normalize: None,
            priority: r.priority,
        },
        types,
    ))
}

/// Cohere's bit-packed embedding: one bit per component (1 where it is
/// ≥ 0), eight to a byte from the high bit; `signed` shifts each byte
/// by 128 (Cohere's `binary`, else `ubinary`).
fn pack_bits(v: &[f32], signed: bool) -> Result<Vec<i32>, ApiError> {
    if !v.len().is_multiple_of(8) {
        return Err(ApiError::invalid(
            Some("embedding_types".into()),
            format!(
                "Embedding dimension must be a multiple of 8 for binary embedding types, but got {}.",
                v.len()
            ),
        ));
    }
    Ok(v.chunks(8)
        .map(|c| {
            let byte = c
                .iter()
                .enumerate()
                .fold(0i32, |acc, (i, &x)| acc | (i32::from(x >= 0.0) << (7 - i)));
            if signed {
                byte - 128
            } else {
                byte
            }
        })
        .collect())
}

impl PoolingRoute {
    fn path(self) -> &'static str {
        match self {
            PoolingRoute::Embeddings => "/v1/embeddings",
            PoolingRoute::Pooling => "/pooling",
            PoolingRoute::CohereEmbed => "/v2/embed",
        }
    }
}

/// `POST /v1/embeddings` and `POST /pooling`.
pub async fn embeddings(
    state: Arc<AppState>,
    body: Value,
    tenant: Option<Arc<crate::tenants::Tenant>>,
    route: PoolingRoute,
) -> Result<Response<Body>, ApiError> {
    let created_ms = crate::metering::now_ms();
    let id = random_id(match route {
        PoolingRoute::Embeddings => "embd",
        PoolingRoute::Pooling => "pool",
        PoolingRoute::CohereEmbed => "embd",
    });
    let (body, ctx) = admit(&state, tenant, &id, route.path(), body).await?;
    let (req, cohere_types) = if route == PoolingRoute::CohereEmbed {
        let (r, t) = cohere_request(body)?;
        (r, Some(t))
    } else {
        let r: EmbeddingRequest = serde_json::from_value(body).map_err(|e| {
            ApiError::invalid(
                None,
                format!("invalid {} request: {e} (it takes OpenAI's embeddings fields: see https://platform.openai.com/docs/api-reference/embeddings/create)", route.path()),
            )
        })?;
        (r, None)
    };
    let model = match req.model.clone() {
        Some(m) => m,
        None => state
            .default_model()
            .ok_or_else(|| ApiError::invalid(Some("model".into()), "'model' is required"))?
            .to_owned(),
    };
    if let Some(c) = &ctx {
        c.check_model(&model)?;
    }
    let engine = state.engine_as(&model, ctx.as_ref())?.clone();
    let Some(pooler) = engine.pooler().cloned() else {
        return Err(ApiError::invalid(
            Some("model".into()),
            format!("The model {model:?} does not support the Embeddings API: it is served for generation. Use /v1/completions or /v1/chat/completions, or serve an embedding model with --runner pooling."),
        ));
    };
    if route != PoolingRoute::Pooling {
        refuse_non_embedding(&model, &pooler)?;
    }
    let base64_out = match req.encoding_format.as_deref() {
        None | Some("float") => false,
        Some("base64") => true,
        Some(other) => {
            return Err(ApiError::invalid(
                Some("encoding_format".into()),
                format!("encoding_format {other:?}: expected \"float\" or \"base64\""),
            ))
        }
    };
    let hidden = engine.hidden_size();
    let dimensions = match req.dimensions {
        None => None,
        Some(d) if d >= 1 && d as usize <= hidden => Some(d as usize),
        Some(d) => {
            return Err(ApiError::invalid(
                Some("dimensions".into()),
                format!("dimensions {d}: the model's embeddings have {hidden} dimensions; ask for 1 to {hidden}"),
            ))
        }
    };
    let max_len = engine.max_model_len();
    let truncate = match req.truncate_prompt_tokens {
        None => None,
        Some(-1) => Some(max_len),
        Some(k) if k >= 1 && k as usize <= max_len => Some(k as usize),
        Some(k) if k < 1 => {
            return Err(ApiError::invalid(
                Some("truncate_prompt_tokens".into()),
                format!("truncate_prompt_tokens {k}: give -1 (the context's length) or a positive number of tokens to keep"),
            ))
        }
        Some(k) => {
            return Err(ApiError::invalid(
                Some("truncate_prompt_tokens".into()),
                format!("truncate_prompt_tokens value ({k}) is greater than max_model_len ({max_len}). Please request a smaller truncation size."),
            ))
        }
    };
    let pooler = crate::engine::pooling::PoolerConfig {
        normalize: req.normalize.unwrap_or(pooler.normalize),
        ..(*pooler).clone()
    };
    let inputs = parse_input(&req.input)?;
    if state.config_skip_tokenizer_init() && inputs.iter().any(|i| matches!(i, Input::Text(_))) {
        return Err(ApiError::invalid(
            Some("input".into()),
            "this server was started with --skip-tokenizer-init: 'input' must be token ids",
        ));
    }
    let tok = engine.tokenizer().clone();
    let add_special = req.add_special_tokens.unwrap_or(true);
    for i in &inputs {
        if let (Input::Text(t), None) = (i, truncate) {
            super::check_prompt_size(&tok, t.len(), max_len, "input")?;
        }
    }
    // Tokenizing is CPU work: off the HTTP threads.
    let prompts: Vec<Vec<u32>> = off_runtime(move || {
        inputs
            .into_iter()
            .map(|i| {
                let mut ids = match i {
                    Input::Text(t) => if add_special {
                        tok.encode_for_pooling(&t)
                    } else {
                        tok.encode(&t, false)
                    }
                    .map_err(|e| ApiError::invalid(Some("input".into()), format!("{e:#}")))?,
                    Input::Tokens(t) => t,
                };
                if let Some(k) = truncate {
                    // vLLM keeps the last k tokens.
                    let cut = ids.len().saturating_sub(k);
                    ids.drain(..cut);
                }
                Ok(ids)
            })
            .collect()
    })
    .await?;
    let vocab = engine.vocab_size();
    for ids in &prompts {
        if ids.is_empty() {
            return Err(ApiError::invalid(Some("input".into()), "an input is empty"));
        }
        // Checked here, not only in the engine: an encoder's engine reads
        // high bits as a token type, which a client's ids do not carry.
        if let Some(&bad) = ids.iter().find(|&&t| t as usize >= vocab) {
            return Err(ApiError::invalid(
                Some("input".into()),
                format!("token id {bad} is beyond the vocabulary of {vocab}"),
            ));
        }
    }
    check_input_lengths(&prompts, max_len, "embedding generation")?;
    let opts = pooling_options(req.priority, ctx.as_ref());
    let vectors = run(&state, &engine, &id, &prompts, opts).await?;
    let prompt_tokens: usize = prompts.iter().map(Vec::len).sum();
    if let Some(c) = &ctx {
        c.admission.charge(prompt_tokens as u64, 0);
    }
    meter_pooling(
        &state,
        ctx.as_ref().map(|c| c.admission.tenant.id.clone()),
        &id,
        route.path(),
        &model,
        prompt_tokens,
        created_ms,
    )
    .await?;
    if let Some(types) = cohere_types {
        // vLLM's `CohereEmbedResponse`: the vectors by type, the texts, and
        // the billed input tokens.
        let finished: Vec<Vec<f32>> = vectors
            .into_iter()
            .map(|raw| pooler.finish(raw, dimensions))
            .collect();
        let mut by_type = json!({"float": null, "binary": null, "ubinary": null, "base64": null});
        for t in &types {
            by_type[t.as_str()] = match t.as_str() {
                "float" => json!(finished),
                "base64" => json!(finished.iter().map(|v| base64_f32(v)).collect::<Vec<_>>()),
                kind => json!(finished
                    .iter()
                    .map(|v| pack_bits(v, kind == "binary"))
                    .collect::<Result<Vec<_>, _>>()?),
            };
        }
        return Ok(json_response(&json!({
            "id": id,
            "embeddings": by_type,
            "texts": req.input,
            "meta": {
                "api_version": {"version": "2"},
                "billed_units": {"input_tokens": prompt_tokens, "image_tokens": null},
            },
            "response_type": "embeddings_by_type",
        })));
    }
    let data: Vec<Value> = vectors
        .into_iter()
        .enumerate()
        .map(|(index, raw)| {
            let v = pooler.finish(raw, dimensions);
            let embedding = if base64_out {
                Value::String(base64_f32(&v))
            } else {
                json!(v)
            };
            match route {
                PoolingRoute::Embeddings => {
                    json!({"index": index, "object": "embedding", "embedding": embedding})
                }
                PoolingRoute::Pooling | PoolingRoute::CohereEmbed => {
                    json!({"index": index, "object": "pooling", "data": embedding})
                }
            }
        })
        .collect();
    Ok(json_response(&json!({
        "id": id,
        "object": "list",
        "created": now_secs(),
        "model": model,
        "data": data,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "total_tokens": prompt_tokens,
            "completion_tokens": 0,
            "prompt_tokens_details": null,
        },
    })))
}

/// Meters a pooling request as generation is: counted, and on disk with
/// --usage-log before the response goes out.
pub(super) async fn meter_pooling(
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
    super::meter(state, &record).await
}

/// vLLM's 400 for an input longer than the model's context, naming what
/// the input was for ("embedding generation", "score", "classification").
pub(super) fn check_input_lengths(
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
pub(super) fn pooling_options(
    priority: Option<i64>,
    ctx: Option<&super::TenantCtx>,
) -> RequestOptions {
    let mut opts = RequestOptions {
        pooling: true,
        priority: priority.unwrap_or(0),
        ..Default::default()
    };
    if let Some(t) = ctx {
        opts.cache_salt = super::protocol::salt_of(&format!("{}:0", t.cache_scope()));
        opts.tenant = t.share();
    }
    opts
}

/// Submits every prompt as a pooling request and waits for their raw
/// pooled vectors, in prompt order. Dropping the future (the client went
/// away) aborts what is still running.
pub(super) async fn run(
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_matches_rfc4648_vectors() {
        // RFC 4648 §10.
        for (plain, encoded) in [
            ("", ""),
            ("f", "Zg=="),
            ("fo", "Zm8="),
            ("foo", "Zm9v"),
            ("foob", "Zm9vYg=="),
            ("fooba", "Zm9vYmE="),
            ("foobar", "Zm9vYmFy"),
        ] {
            assert_eq!(base64(plain.as_bytes()), encoded, "{plain:?}");
        }
        // 1.0f32 is 00 00 80 3f.
        assert_eq!(base64_f32(&[1.0]), "AACAPw==");
    }

    #[test]
    fn input_shapes() {
        let n = |v: Value| parse_input(&v).map(|i| i.len());
        assert_eq!(n(json!("a")).ok(), Some(1));
        assert_eq!(n(json!(["a", "b"])).ok(), Some(2));
        assert_eq!(n(json!([1, 2, 3])).ok(), Some(1));
        assert_eq!(n(json!([[1], [2, 3]])).ok(), Some(2));
        assert!(n(json!([])).is_err());
        assert!(n(json!(["a", 1])).is_err());
        assert!(n(json!([-1])).is_err());
        assert!(n(json!({"a": 1})).is_err());
    }
}
