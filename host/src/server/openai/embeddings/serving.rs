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

use super::protocol::{
    base64_f32, cohere_request, pack_bits, parse_input, EmbeddingRequest, Input, PoolingRoute,
};
use crate::server::errors::{json_response, ApiError};
use crate::server::openai::pooling::{
    check_input_lengths, meter_pooling, pooling_options, run, truncation,
};
use crate::server::openai::{admit, check_prompt_size, now_secs, off_runtime, random_id};
use crate::server::{AppState, Body};
use hyper::Response;
use serde_json::{json, Value};
use std::sync::Arc;

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
    let truncate = truncation(req.truncate_prompt_tokens, max_len)?;
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
            check_prompt_size(&tok, t.len(), max_len, "input")?;
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
