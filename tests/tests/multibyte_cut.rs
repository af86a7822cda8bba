//! `max_tokens` that ends generation inside a multi-byte character: as
//! vLLM's, the text ends with U+FFFD where the half character would be, and
//! without it every shorter completion is a prefix of the longer ones.

use pagoda_e2e::Server;
use serde_json::json;

#[test]
fn a_character_cut_by_max_tokens_ends_in_a_replacement_char_as_vllms_does() {
    let s = Server::start(&[]);
    let text = |max_tokens: usize| -> String {
        let (st, v) = s.post(
            "/v1/chat/completions",
            &json!({"model": "smol", "max_tokens": max_tokens, "temperature": 0,
                "messages": [{"role": "user", "content": "用中文介绍一下深度学习。"}]}),
        );
        assert_eq!(st, 200, "{v}");
        v["choices"][0]["message"]["content"]
            .as_str()
            .expect("content")
            .to_string()
    };
    let full = text(24);
    let full = full.trim_end_matches('\u{FFFD}');
    let mut cut_inside_a_character = 0;
    for k in 1..24 {
        let t = text(k);
        let whole = t.trim_end_matches('\u{FFFD}');
        assert!(
            full.starts_with(whole),
            "max_tokens {k}: {t:?} is not a prefix of {full:?}"
        );
        // U+FFFD only at the very end, once, where the cut fell.
        assert!(!whole.contains('\u{FFFD}'), "max_tokens {k}: {t:?}");
        if t.ends_with('\u{FFFD}') {
            assert_eq!(t.len() - whole.len(), '\u{FFFD}'.len_utf8(), "{t:?}");
            cut_inside_a_character += 1;
        }
    }
    assert!(
        cut_inside_a_character > 0,
        "no max_tokens cut a character here, so this checked nothing: {full:?}"
    );
}
