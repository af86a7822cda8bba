//! A tenant's KV-cache reservation, through the real binary: a calm
//! tenant's cached prompt survives another tenant's flood of unique
//! prompts when its config reserves part of the pool, and is evicted when
//! it does not. The admin API shows and checks the setting.

mod plugins_common;

use pagoda_e2e::TempDir;
use plugins_common::*;
use serde_json::{json, Value};

/// A prompt of about `words` words, different for every `seed`.
fn prompt(seed: u32, words: usize) -> String {
    let vocab = [
        "river", "stone", "lamp", "orchard", "copper", "meadow", "harbor", "violet", "signal",
        "marble", "winter", "candle", "forest", "silver", "thunder", "garden",
    ];
    (0..words)
        .map(|i| vocab[((seed as usize) * 7 + i * 5 + i * i * (seed as usize + 1)) % vocab.len()])
        .collect::<Vec<_>>()
        .join(" ")
}

fn complete(p: &PServer, key: &str, text: &str) -> Value {
    let body = json!({"model": "smol", "prompt": text, "max_tokens": 2, "temperature": 0});
    let (st, v) = p.post_as(key, "/v1/completions", &body);
    assert_eq!(st, 200, "{v}");
    v
}

fn cached(v: &Value) -> u64 {
    v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or(0)
}

/// The calm tenant's prompt, a flood of 16 unique prompts from another
/// tenant (several times the pool), then the calm prompt again: the tokens
/// it finds cached, and its prompt's length.
fn calm_after_flood(calm_kv: Value) -> (u64, u64) {
    let calm_kv_has_share = calm_kv.clone();
    let dir = TempDir::new("tenants-kv");
    // 48 blocks of 16 tokens (the demo model keeps 23 KiB per token in
    // f16): each flood prompt takes about a quarter of the pool.
    let p = start(
        &dir,
        &[
            "--kv-cache-memory",
            "17MiB",
            "--max-model-len",
            "384",
            "--block-size",
            "16",
        ],
    );
    p.put_tenant(
        "calm",
        json!({"api_keys": ["key-calm-1234"], "kv_cache": calm_kv_has_share}),
    );
    p.put_tenant("flood", json!({"api_keys": ["key-flood-1234"]}));
    let calm = prompt(1000, 120);
    let first = complete(&p, "key-calm-1234", &calm);
    assert_eq!(cached(&first), 0, "{first}");
    for seed in 0..16 {
        complete(&p, "key-flood-1234", &prompt(seed, 160));
    }
    let again = complete(&p, "key-calm-1234", &calm);
    // With a share, the pool's count of the calm tenant is published.
    let (_, view) = p.admin("GET", "/admin/v1/tenants/calm", None);
    let label = format!(
        "tenant=\"{}\"",
        view["metrics_label"].as_str().unwrap_or("?")
    );
    let (_, metrics) = p.s.get("/metrics");
    let sample = |name: &str| {
        metrics
            .lines()
            .find(|l| l.starts_with(name) && l.contains(&label))
            .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
    };
    if calm_kv.get("reserved_fraction").is_some() {
        let blocks = sample("pagoda_tenant_kv_cache_blocks{").expect("calm's blocks gauge");
        assert!(blocks >= 7.0, "calm keeps its prompt's blocks: {blocks}");
        let evicted = sample("pagoda_tenant_kv_cache_blocks_evicted_by_others_total")
            .expect("calm's eviction counter");
        assert_eq!(evicted, 0.0);
    }
    (
        cached(&again),
        again["usage"]["prompt_tokens"].as_u64().unwrap_or(0),
    )
}

#[test]
fn a_reservation_keeps_the_calm_tenants_prefix_through_a_flood() {
    let (kept, len) = calm_after_flood(json!({"reserved_fraction": 0.3}));
    assert!(
        kept + 16 >= len && kept > 0,
        "with a reservation, {kept} of {len} prompt tokens were cached"
    );
    let (lost, len) = calm_after_flood(json!({}));
    assert_eq!(
        lost, 0,
        "without a reservation the flood evicts all {len} tokens"
    );
}

#[test]
fn the_admin_api_shows_and_checks_kv_cache_shares() {
    let dir = TempDir::new("tenants-kv-admin");
    let p = start(&dir, &[]);
    p.put_tenant(
        "a",
        json!({"api_keys": ["key-a-123456"], "kv_cache": {"reserved_fraction": 0.5, "max_fraction": 0.8}}),
    );
    let (st, v) = p.admin("GET", "/admin/v1/tenants/a", None);
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["kv_cache"]["reserved_fraction"], 0.5, "{v}");
    assert_eq!(v["kv_cache"]["max_fraction"], 0.8, "{v}");
    // A PUT without kv_cache keeps it.
    p.put_tenant("a", json!({"models": []}));
    let (_, v) = p.admin("GET", "/admin/v1/tenants/a", None);
    assert_eq!(v["kv_cache"]["reserved_fraction"], 0.5, "{v}");
    for (bad, says) in [
        (json!({"reserved_fraction": 1.5}), "between 0 and 1"),
        (
            json!({"reserved_fraction": 0.5, "max_fraction": 0.2}),
            "above kv_cache.max_fraction",
        ),
        (json!({"reserved_fraction": 0.1, "spare": 1}), "spare"),
    ] {
        let (st, v) = p.admin(
            "PUT",
            "/admin/v1/tenants/b",
            Some(&json!({"api_keys": ["key-b-123456"], "kv_cache": bad})),
        );
        assert_eq!(st, 400, "{bad}: {v}");
        assert!(v.to_string().contains(says), "{bad}: {v}");
    }
    // Reservations may not add up past 0.9 of the pool.
    let (st, v) = p.admin(
        "PUT",
        "/admin/v1/tenants/b",
        Some(&json!({"api_keys": ["key-b-123456"], "kv_cache": {"reserved_fraction": 0.45}})),
    );
    assert_eq!(st, 400, "{v}");
    assert!(v.to_string().contains("add up"), "{v}");
    p.put_tenant(
        "b",
        json!({"api_keys": ["key-b-123456"], "kv_cache": {"reserved_fraction": 0.4}}),
    );
}

#[test]
fn a_cache_group_shares_a_prefix_between_its_tenants_and_no_one_else() {
    let dir = TempDir::new("tenants-kv-group");
    let p = start(&dir, &[]);
    p.put_tenant(
        "a",
        json!({"api_keys": ["key-a-123456"], "cache_group": "acme"}),
    );
    p.put_tenant(
        "b",
        json!({"api_keys": ["key-b-123456"], "cache_group": "acme"}),
    );
    p.put_tenant("c", json!({"api_keys": ["key-c-123456"]}));
    let system = prompt(7, 100);
    let first = complete(&p, "key-a-123456", &system);
    assert_eq!(cached(&first), 0, "{first}");
    // B, in A's group, finds A's blocks.
    let b = complete(&p, "key-b-123456", &system);
    assert!(cached(&b) >= 64, "b should reuse a's prefix: {b}");
    // C, outside it, finds nothing; and a group named like a tenant is
    // not that tenant.
    let c = complete(&p, "key-c-123456", &system);
    assert_eq!(cached(&c), 0, "{c}");
    p.put_tenant(
        "d",
        json!({"api_keys": ["key-d-123456"], "cache_group": "c"}),
    );
    let d = complete(&p, "key-d-123456", &system);
    assert_eq!(cached(&d), 0, "{d}");
    // Leaving the group drops the old salt's blocks from B's view.
    p.put_tenant("b", json!({"api_keys": ["key-b-123456"]}));
    let b = complete(&p, "key-b-123456", &system);
    assert_eq!(cached(&b), 0, "{b}");
    let (_, v) = p.admin("GET", "/admin/v1/tenants/a", None);
    assert_eq!(v["cache_group"], "acme", "{v}");
    let (st, v) = p.admin(
        "PUT",
        "/admin/v1/tenants/e",
        Some(&json!({"api_keys": ["key-e-123456"], "cache_group": "no spaces"})),
    );
    assert_eq!(st, 400, "{v}");
    assert!(v.to_string().contains("cache_group"), "{v}");
}
