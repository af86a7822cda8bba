//! `pagoda serve MODEL`: the model as the first argument, as `vllm serve`
//! takes it; `--model` still works, and giving both is refused.

use pagoda_e2e::{demo_gguf, pagoda_bin, Server};

#[test]
fn serve_takes_the_model_as_its_first_argument() {
    let s = Server::start_positional(&[]);
    let (st, body) = s.get("/v1/models");
    assert_eq!(st, 200, "{body}");
    assert!(body.contains("\"smol\""), "{body}");
}

#[test]
fn the_model_given_both_ways_is_refused() {
    let model = demo_gguf();
    let out = std::process::Command::new(pagoda_bin())
        .arg("serve")
        .arg(&model)
        .arg("--model")
        .arg(&model)
        .output()
        .expect("running pagoda serve");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("given twice"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    let out = std::process::Command::new(pagoda_bin())
        .arg("serve")
        .output()
        .expect("running pagoda serve");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("no model given"), "{stderr}");
}
