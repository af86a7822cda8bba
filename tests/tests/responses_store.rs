//! Stored responses belong to their tenant: `GET /v1/responses/{id}` and
//! `DELETE` find only the caller's own, and answer a 404 in OpenAI's shape
//! for anything else, another tenant's response included.

mod plugins_common;

use pagoda_e2e::TempDir;
use plugins_common::*;
use serde_json::json;

const A: &str = "key-store-a-123456";
const B: &str = "key-store-b-123456";

#[test]
fn a_tenant_retrieves_and_deletes_only_its_own_responses() {
    let dir = TempDir::new("responses-store");
    let p = start(&dir, &[]);
    p.put_tenant("a", json!({"api_keys": [A]}));
    p.put_tenant("b", json!({"api_keys": [B]}));
    let (st, created) = p.post_as(
        A,
        "/v1/responses",
        &json!({"model": "smol", "input": "Say hi.", "max_output_tokens": 4, "temperature": 0}),
    );
    assert_eq!(st, 200, "{created}");
    let id = created["id"].as_str().expect("id").to_string();
    let path = format!("/v1/responses/{id}");
    let url = p.s.url(&path);

    let (st, got) = call_url(&url, "GET", A, None);
    assert_eq!(st, 200, "{got}");
    assert_eq!(got["id"], created["id"]);
    assert_eq!(got["output"], created["output"]);

    // Tenant B cannot see it, nor delete it.
    for method in ["GET", "DELETE"] {
        let (st, v) = call_url(&url, method, B, None);
        assert_eq!(st, 404, "{method} as B: {v}");
        assert_eq!(openai_error(&v)["type"], "invalid_request_error", "{v}");
        assert_eq!(openai_error(&v)["param"], "response_id", "{v}");
    }

    let (st, v) = call_url(&url, "DELETE", A, None);
    assert_eq!(st, 200, "{v}");
    assert_eq!(v, json!({"id": id, "object": "response", "deleted": true}));
    let (st, v) = call_url(&url, "GET", A, None);
    assert_eq!(st, 404, "{v}");
    let (st, v) = call_url(&url, "DELETE", A, None);
    assert_eq!(st, 404, "{v}");
}
