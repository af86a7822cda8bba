//! Stop strings, which the output processor applies in the front end: the
//! output ends at the first stop string its text completes (with the string
//! when `include_stop_str_in_output`), its tokens end at the token that
//! completed it, and the engine core drops the request at once, whether
//! tokens come one per step or several (verified drafts).

mod common;

use pagoda::engine::core::StopReason;
use pagoda::engine::request::FinishReason;
use pagoda::engine::spec_decode::SpeculativeConfig;
use pagoda::engine::{EngineArgs, Prompt, SamplingParams, LLM};

fn args(spec: bool) -> EngineArgs {
    let mut a = EngineArgs::new(common::demo_gguf());
    a.threads = 2;
    a.max_model_len = Some(256);
    a.kv_cache_memory = Some(32 << 20);
    if spec {
        a.speculative = Some(
            SpeculativeConfig::from_json(
                r#"{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}"#,
            )
            .expect("config"),
        );
    }
    a
}

const PROMPT: &str = "Copy this text exactly.\nText: The river bends twice before it reaches the old mill, where the water slows.\nCopy: The";

fn greedy(max_tokens: usize) -> SamplingParams {
    let mut p = SamplingParams::greedy(max_tokens);
    p.ignore_eos = true;
    p
}

#[test]
fn a_stop_string_ends_text_and_tokens_where_it_completes() {
    for spec in [false, true] {
        let mut llm = LLM::new(args(spec)).expect("engine");
        let prompt = [Prompt::Text(PROMPT.into())];
        let full = llm.generate(&prompt, &greedy(24)).expect("generate");
        let full = &full[0].outputs[0];
        // A stop string from the middle of the output.
        let chars: Vec<(usize, char)> = full.text.char_indices().collect();
        assert!(chars.len() > 20, "too short an output: {:?}", full.text);
        let (at, _) = chars[chars.len() / 2];
        let (end, _) = chars[chars.len() / 2 + 3];
        let stop = full.text[at..end].to_string();
        let first = full
            .text
            .find(&stop)
            .expect("the stop string is in the text");
        for include in [false, true] {
            let mut p = greedy(24);
            p.stop = vec![stop.clone(), "never appears \u{1F30A}".into()];
            p.include_stop_str_in_output = include;
            let out = llm.generate(&prompt, &p).expect("generate");
            let c = &out[0].outputs[0];
            let want = if include {
                &full.text[..first + stop.len()]
            } else {
                &full.text[..first]
            };
            assert_eq!(c.text, want, "spec {spec}, include {include}");
            assert_eq!(c.finish_reason, Some(FinishReason::Stop));
            assert_eq!(c.stop_reason, Some(StopReason::Text(stop.clone())));
            // The tokens are the unstopped output's, up to the one whose
            // text completed the stop string.
            assert!(
                full.token_ids.starts_with(&c.token_ids)
                    && c.token_ids.len() < full.token_ids.len(),
                "spec {spec}: {:?} is not a prefix of {:?}",
                c.token_ids,
                full.token_ids
            );
            let text_of = |ids: &[u32]| llm.tokenizer().decode(ids, true).expect("decode");
            let through = text_of(&c.token_ids);
            let before = text_of(&c.token_ids[..c.token_ids.len() - 1]);
            assert!(
                !before.contains(&stop) && through.contains(&stop),
                "spec {spec}: the last token must complete the stop string"
            );
            // The engine dropped the request and every block came back.
            assert!(!llm.engine().has_unfinished(), "spec {spec}");
            llm.engine().check_kv_accounting().expect("kv accounting");
            assert_eq!(llm.engine().kv_cache().pool().usage(), 0.0);
        }
    }
}
