//! `max_tokens` that ends generation inside a multi-byte character: the
//! text stops before the half character instead of ending in U+FFFD, so
//! every shorter completion is a prefix of the longer ones.

use pagoda_e2e::Server;
use serde_json::json;

#[test]
fn a_character_cut_by_max_tokens_is_dropped_not_sent_as_a_replacement_char() {
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
    assert!(!full.contains('\u{FFFD}'), "{full:?}");
    let mut cut_inside_a_character = 0;
    let mut previous = String::new();
    for k in 1..24 {
        let t = text(k);
        assert!(!t.contains('\u{FFFD}'), "max_tokens {k}: {t:?}");
        assert!(
            full.starts_with(&t),
            "max_tokens {k}: {t:?} is not a prefix of {full:?}"
        );
        // A token that added no text ended inside a character.
        if t == previous {
            cut_inside_a_character += 1;
        }
        previous = t;
    }
    assert!(
        cut_inside_a_character > 0,
        "no max_tokens cut a character here, so this checked nothing: {full:?}"
    );
}
