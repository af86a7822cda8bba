//! vLLM's scoring endpoints for cross-encoders (`*ForSequenceClassification`
//! with one label): `POST /score` and `/v1/score` (`text_1`, `text_2`:
//! one to one, one to many or many to many; `data: [{index, object:
//! "score", score}]`), and `POST /rerank`, `/v1/rerank` and `/v2/rerank`
//! (Jina's and Cohere's shape: `query`, `documents`, `top_n`,
//! `return_documents`; `results: [{index, document: {text},
//! relevance_score}]` by relevance).
//!
//! Each pair is one pooling request, `[CLS] text_1 [SEP] text_2 [SEP]` with
//! token types 0 then 1 (see [`crate::tokenizer::Tokenizer::encode_pair_for_scoring`]);
//! its logit goes through a sigmoid, vLLM's default activation for one
//! label (`use_activation: false` returns the raw logit).

use super::protocol::{texts, RerankRequest, ScoreRequest, ScoreRoute};
use crate::engine::pooling::PoolingTask;
use crate::server::errors::{json_response, ApiError};
use crate::server::openai::pooling::{
    check_input_lengths, meter_pooling, pooling_options, run, truncation,
};
use crate::server::openai::{admit, check_prompt_size, now_secs, off_runtime, random_id};
use crate::server::{AppState, Body};
use hyper::Response;
use serde_json::{json, Value};
use std::sync::Arc;

/// `POST /score`, `/v1/score`, `/rerank`, `/v1/rerank`, `/v2/rerank`.
pub async fn score(
    state: Arc<AppState>,
    path: &str,
    body: Value,
    tenant: Option<Arc<crate::tenants::Tenant>>,
    route: ScoreRoute,
) -> Result<Response<Body>, ApiError> {
    let created_ms = crate::metering::now_ms();
    let id = random_id(match route {
        ScoreRoute::Score => "score",
        ScoreRoute::Rerank => "rerank",
    });
    let (body, ctx) = admit(&state, tenant, &id, path, body).await?;
    // The pairs, and what the response needs of the request.
    let (model, first, second, common, rerank) = match route {
        ScoreRoute::Score => {
            let r: ScoreRequest = serde_json::from_value(body).map_err(|e| {
                ApiError::invalid(None, format!("invalid {path} request: {e} (it takes vLLM's score fields: text_1, text_2)"))
            })?;
            let (a, b) = (texts(&r.text_1, "text_1")?, texts(&r.text_2, "text_2")?);
            (r.model, a, b, r.common, None)
        }
        ScoreRoute::Rerank => {
            let r: RerankRequest = serde_json::from_value(body).map_err(|e| {
                ApiError::invalid(None, format!("invalid {path} request: {e} (it takes query, documents, top_n, return_documents)"))
            })?;
            let Value::String(q) = &r.query else {
                return Err(ApiError::invalid(
                    Some("query".into()),
                    "'query' must be a string",
                ));
            };
            let docs = match &r.documents {
                Value::Array(_) => texts(&r.documents, "documents")?,
                _ => {
                    return Err(ApiError::invalid(
                        Some("documents".into()),
                        "'documents' must be an array of strings",
                    ))
                }
            };
            let top_n = r.top_n.unwrap_or(0);
            (
                r.model,
                vec![q.clone()],
                docs,
                r.common,
                Some((top_n, r.return_documents.unwrap_or(true))),
            )
        }
    };
    // vLLM's `validate_score_input`: 1:1, 1:N or N:N.
    if second.is_empty() {
        return Err(ApiError::invalid(
            Some(
                if rerank.is_some() {
                    "documents"
                } else {
                    "text_2"
                }
                .into(),
            ),
            "At least one text element must be given",
        ));
    }
    if first.is_empty() || (first.len() > 1 && first.len() != second.len()) {
        return Err(ApiError::invalid(
            Some("text_1".into()),
            format!(
                "Input lengths must be either 1:1, 1:N or N:N (got {} and {})",
                first.len(),
                second.len()
            ),
        ));
    }
    let model = match model {
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
    // A decoder reranker (the Qwen3-Reranker form), or an encoder without
    // a token type table (ModernBERT), reads the pair's tokens as one
    // text: no token types travel in its ids.
    let untyped = engine.pooler().is_some_and(|p| !p.pair_types);
    let pooler = engine.pooler().cloned();
    match engine.pooler().map(|p| p.task) {
        Some(PoolingTask::Score) => {}
        Some(PoolingTask::Classify) => {
            return Err(ApiError::invalid(
                Some("model".into()),
                format!("The model {model:?} does not support the {} API: it is a classifier with several labels, not a cross-encoder. Use /classify.", if rerank.is_some() { "Rerank" } else { "Score" }),
            ))
        }
        Some(PoolingTask::Embed) => {
            return Err(ApiError::invalid(
                Some("model".into()),
                format!("The model {model:?} does not support the {} API: it is an embedding model, not a cross-encoder (a *ForSequenceClassification checkpoint). Use /v1/embeddings.", if rerank.is_some() { "Rerank" } else { "Score" }),
            ))
        }
        None => {
            return Err(ApiError::invalid(
                Some("model".into()),
                format!("The model {model:?} does not support the {} API: it is served for generation. Use /v1/completions or /v1/chat/completions, or serve a cross-encoder.", if rerank.is_some() { "Rerank" } else { "Score" }),
            ))
        }
    }
    if state.config_skip_tokenizer_init() {
        return Err(ApiError::invalid(
            None,
            "this server was started with --skip-tokenizer-init: scoring needs the tokenizer to pair its texts",
        ));
    }
    let max_len = engine.max_model_len();
    let truncate = truncation(common.truncate_prompt_tokens, max_len)?;
    let activation = common
        .use_activation
        .or(common.activation)
        .or(common.softmax)
        .unwrap_or(true);
    let tok = engine.tokenizer().clone();
    if truncate.is_none() {
        for t in first.iter().chain(&second) {
            check_prompt_size(&tok, t.len(), max_len, "input")?;
        }
    }
    let pairs: Vec<(String, String)> = second
        .iter()
        .enumerate()
        .map(|(i, d)| {
            (
                first[if first.len() == 1 { 0 } else { i }].clone(),
                d.clone(),
            )
        })
        .collect();
    // Tokenizing is CPU work: off the HTTP threads.
    let prompts: Vec<Vec<u32>> = off_runtime(move || {
        pairs
            .iter()
            .map(|(a, b)| {
                match truncate {
                    Some(k) => tok.encode_pair_truncated(a, b, k),
                    None => tok.encode_pair_for_scoring(a, b),
                }
                .map(|ids| {
                    if untyped {
                        ids.into_iter()
                            .map(|t| pagoda_accel::ops::encoder::unpack_token(t).0)
                            .collect()
                    } else {
                        ids
                    }
                })
                .map_err(|e| ApiError::invalid(None, format!("{e:#}")))
            })
            .collect()
    })
    .await?;
    check_input_lengths(&prompts, max_len, "score")?;
    let opts = pooling_options(common.priority, ctx.as_ref());
    let raw = run(&state, &engine, &id, &prompts, opts).await?;
    let scores: Vec<f32> = raw
        .into_iter()
        .map(|v| {
            let v = match &pooler {
                Some(p) => p
                    .head_logits(v)
                    .map_err(|e| ApiError::internal(format!("{e:#}")))?,
                None => v,
            };
            if activation {
                crate::engine::pooling::score_of(&v)
            } else {
                match v.as_slice() {
                    [logit] => Ok(*logit),
                    other => Err(anyhow::anyhow!(
                        "a cross-encoder gives one logit per pair; this model gave {}",
                        other.len()
                    )),
                }
            }
            .map_err(|e| ApiError::internal(format!("{e:#}")))
        })
        .collect::<Result<_, _>>()?;
    let prompt_tokens: usize = prompts.iter().map(Vec::len).sum();
    if let Some(c) = &ctx {
        c.admission.charge(prompt_tokens as u64, 0);
    }
    meter_pooling(
        &state,
        ctx.as_ref().map(|c| c.admission.tenant.id.clone()),
        &id,
        path,
        &model,
        prompt_tokens,
        created_ms,
    )
    .await?;
    let body = match rerank {
        None => json!({
            "id": id,
            "object": "list",
            "created": now_secs(),
            "model": model,
            "data": scores
                .iter()
                .enumerate()
                .map(|(index, s)| json!({"index": index, "object": "score", "score": s}))
                .collect::<Vec<_>>(),
            "usage": {
                "prompt_tokens": prompt_tokens,
                "total_tokens": prompt_tokens,
                "completion_tokens": 0,
                "prompt_tokens_details": null,
            },
        }),
        Some((top_n, with_docs)) => {
            let mut order: Vec<usize> = (0..scores.len()).collect();
            // By relevance, highest first; ties keep document order.
            order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]));
            if top_n > 0 && (top_n as usize) < order.len() {
                order.truncate(top_n as usize);
            }
            let results: Vec<Value> = order
                .into_iter()
                .map(|i| {
                    let mut r = json!({"index": i, "relevance_score": scores[i]});
                    if with_docs {
                        r["document"] = json!({"text": second[i]});
                    }
                    r
                })
                .collect();
            json!({
                "id": id,
                "model": model,
                "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
                "results": results,
            })
        }
    };
    Ok(json_response(&body))
}
