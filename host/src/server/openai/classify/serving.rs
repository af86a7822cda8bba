//! vLLM's `POST /classify` for sequence classifiers
//! (`*ForSequenceClassification`): `{"model", "input": str | [str]}` →
//! `{"id", "object": "list", "created", "model", "data": [{"index",
//! "label", "probs", "num_classes"}], "usage"}`.
//!
//! Each input is one pooling request, its `[CLS]` row through the model's
//! pooler and classifier; the logits become probabilities by a softmax
//! (a lone label's by a sigmoid), as vLLM's default activation, and the
//! label is the most probable one's `id2label` name. `use_activation:
//! false` returns the raw logits in `probs`, as vLLM does.

use super::protocol::{inputs, ClassifyRequest};
use crate::engine::pooling::{class_probs, PoolingTask};
use crate::server::errors::{json_response, ApiError};
use crate::server::openai::pooling::{
    check_input_lengths, meter_pooling, pooling_options, run, truncation,
};
use crate::server::openai::{admit, check_prompt_size, now_secs, off_runtime, random_id};
use crate::server::{AppState, Body};
use hyper::Response;
use serde_json::{json, Value};
use std::sync::Arc;

/// The index of the largest value (the first of equals).
fn argmax(v: &[f32]) -> usize {
    let mut best = 0;
    for (i, x) in v.iter().enumerate() {
        if *x > v[best] {
            best = i;
        }
    }
    best
}

/// `POST /classify`.
pub async fn classify(
    state: Arc<AppState>,
    path: &str,
    body: Value,
    tenant: Option<Arc<crate::tenants::Tenant>>,
) -> Result<Response<Body>, ApiError> {
    let created_ms = crate::metering::now_ms();
    let id = random_id("classify");
    let (body, ctx) = admit(&state, tenant, &id, path, body).await?;
    let req: ClassifyRequest = serde_json::from_value(body).map_err(|e| {
        ApiError::invalid(
            None,
            format!("invalid {path} request: {e} (it takes vLLM's classify fields: model, input)"),
        )
    })?;
    let texts = inputs(&req.input)?;
    let model = match req.model {
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
            format!("The model {model:?} does not support the Classification API: it is served for generation. Use /v1/completions or /v1/chat/completions, or serve a *ForSequenceClassification checkpoint."),
        ));
    };
    if pooler.task == PoolingTask::Embed || pooler.labels.is_empty() {
        return Err(ApiError::invalid(
            Some("model".into()),
            format!("The model {model:?} does not support the Classification API: it is an embedding model. Use /v1/embeddings."),
        ));
    }
    if state.config_skip_tokenizer_init() {
        return Err(ApiError::invalid(
            Some("input".into()),
            "this server was started with --skip-tokenizer-init: classification needs the tokenizer",
        ));
    }
    let max_len = engine.max_model_len();
    let truncate = truncation(req.truncate_prompt_tokens, max_len)?;
    let activation = req.use_activation.or(req.activation).unwrap_or(true);
    let tok = engine.tokenizer().clone();
    if truncate.is_none() {
        for t in &texts {
            check_prompt_size(&tok, t.len(), max_len, "input")?;
        }
    }
    // Tokenizing is CPU work: off the HTTP threads.
    let prompts: Vec<Vec<u32>> = off_runtime(move || {
        texts
            .iter()
            .map(|t| {
                let mut ids = tok
                    .encode_for_pooling(t)
                    .map_err(|e| ApiError::invalid(Some("input".into()), format!("{e:#}")))?;
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
    for ids in &prompts {
        if ids.is_empty() {
            return Err(ApiError::invalid(Some("input".into()), "an input is empty"));
        }
    }
    check_input_lengths(&prompts, max_len, "classification")?;
    let opts = pooling_options(req.priority, ctx.as_ref());
    let raw = run(&state, &engine, &id, &prompts, opts).await?;
    let n = pooler.labels.len();
    let mut data = Vec::with_capacity(raw.len());
    for (index, logits) in raw.into_iter().enumerate() {
        let logits = pooler
            .head_logits(logits)
            .map_err(|e| ApiError::internal(format!("{e:#}")))?;
        if logits.len() != n {
            return Err(ApiError::internal(format!(
                "the classifier gave {} logits for its {n} labels",
                logits.len()
            )));
        }
        let probs = if activation {
            class_probs(&logits)
        } else {
            logits.clone()
        };
        // vLLM names the label of the largest probability (for one label,
        // that label).
        let label = &pooler.labels[argmax(&probs)];
        data.push(json!({"index": index, "label": label, "probs": probs, "num_classes": n}));
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn input_takes_a_string_or_strings() {
        assert_eq!(inputs(&json!("a")).ok(), Some(vec!["a".to_string()]));
        assert_eq!(inputs(&json!(["a", "b"])).ok().map(|v| v.len()), Some(2));
        assert!(inputs(&json!([])).is_err());
        assert!(inputs(&json!([1])).is_err());
    }

    #[test]
    fn argmax_takes_the_first_of_equals() {
        assert_eq!(argmax(&[0.2, 0.5, 0.3]), 1);
        assert_eq!(argmax(&[0.5, 0.5]), 0);
    }
}
