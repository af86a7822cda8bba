//! The Kubernetes manifests in examples/k8s validate offline against the
//! Kubernetes schemas (kubernetes-validate from PyPI, strict mode), and
//! their probes point at the health routes the server really has.

#[test]
fn manifests_validate_against_the_kubernetes_schemas() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../examples/k8s");
    let files: Vec<_> = std::fs::read_dir(dir)
        .expect("examples/k8s")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .collect();
    assert!(!files.is_empty());
    for f in &files {
        // Through python3 -m, so the check does not depend on where pip put
        // the console script.
        let out = std::process::Command::new("python3")
            .args(["-m", "kubernetes_validate", "--strict"])
            .arg(f)
            .output()
            .expect("kubernetes-validate (pip install kubernetes-validate)");
        assert!(
            out.status.success(),
            "{} does not validate:\n{}{}",
            f.display(),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let text = std::fs::read_to_string(f).expect("read");
        // Liveness must not be /health, which (as vLLM's) answers 503
        // while the model loads: the kubelet would restart a loading pod.
        assert!(
            !text.contains("path: /health\n"),
            "{}: /health is readiness, not liveness",
            f.display()
        );
        for probe in [
            "path: /health/live",
            "path: /health/ready",
            "path: /health/startup",
        ] {
            assert!(
                text.contains(probe),
                "{} lacks a probe on {probe}",
                f.display()
            );
        }
    }
}

/// The documents of a YAML file as JSON (PyYAML, which kubernetes-validate
/// brings).
fn yaml_documents(path: &str) -> Vec<serde_json::Value> {
    let out = std::process::Command::new("python3")
        .args([
            "-c",
            "import json, sys, yaml; print(json.dumps([d for d in yaml.safe_load_all(open(sys.argv[1])) if d]))",
            path,
        ])
        .output()
        .expect("python3 with PyYAML");
    assert!(
        out.status.success(),
        "{path}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("JSON")
}

fn find<'a>(docs: &'a [serde_json::Value], kind: &str) -> &'a serde_json::Value {
    docs.iter()
        .find(|d| d["kind"] == kind)
        .unwrap_or_else(|| panic!("no {kind}"))
}

/// The gateway objects are custom resources, which the Kubernetes schemas
/// do not cover: they are checked against the Inference Extension's v1
/// fields and against the replicas they must reach. The replicas share an
/// object store, carry the engine-type label the endpoint picker reads,
/// and send KV-cache events to the picker.
#[test]
fn the_inference_pool_routes_to_replicas_that_share_a_state_store() {
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../examples/k8s");
    let replicas = yaml_documents(&format!("{root}/replicas.yaml"));
    let gateway = yaml_documents(&format!("{root}/gateway/pagoda-pool.yaml"));
    let deploy = find(&replicas, "Deployment");
    let pod = &deploy["spec"]["template"];
    let labels = pod["metadata"]["labels"].as_object().expect("pod labels");
    assert_eq!(labels["inference.networking.k8s.io/engine-type"], "vllm");
    assert!(deploy["spec"]["replicas"].as_u64().unwrap() > 1);
    let container = &pod["spec"]["containers"][0];
    let args: Vec<&str> = container["args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    let arg = |flag: &str| {
        args.iter()
            .find_map(|a| a.strip_prefix(&format!("{flag}=")))
            .unwrap_or_else(|| panic!("no {flag} in {args:?}"))
    };
    assert!(arg("--state-store").starts_with("s3://"));
    let cache = arg("--state-dir");
    let mounts = container["volumeMounts"].as_array().unwrap();
    assert!(
        mounts.iter().any(|m| m["mountPath"] == cache),
        "{cache} is not mounted"
    );
    let events: serde_json::Value =
        serde_json::from_str(arg("--kv-events-config")).expect("--kv-events-config is JSON");
    assert_eq!(events["enable_kv_cache_events"], true);
    // Credentials from a Secret, not from the manifest's own text.
    let secret = find(&replicas, "Secret");
    assert_eq!(
        container["envFrom"][0]["secretRef"]["name"],
        secret["metadata"]["name"]
    );
    let port = container["ports"][0]["containerPort"].clone();

    let pool = find(&gateway, "InferencePool");
    assert_eq!(pool["apiVersion"], "inference.networking.k8s.io/v1");
    for (k, v) in pool["spec"]["selector"]["matchLabels"].as_object().unwrap() {
        assert_eq!(&labels[k], v, "the pool selects label {k}");
    }
    assert_eq!(pool["spec"]["targetPorts"][0]["number"], port);
    let epp = &pool["spec"]["endpointPickerRef"];
    assert!(epp["name"].is_string() && epp["port"]["number"].is_u64());
    assert!(
        events["endpoint"]
            .as_str()
            .unwrap()
            .contains(epp["name"].as_str().unwrap()),
        "KV-cache events go to the endpoint picker"
    );
    let route = find(&gateway, "HTTPRoute");
    assert_eq!(route["apiVersion"], "gateway.networking.k8s.io/v1");
    let backend = &route["spec"]["rules"][0]["backendRefs"][0];
    assert_eq!(backend["group"], "inference.networking.k8s.io");
    assert_eq!(backend["kind"], "InferencePool");
    assert_eq!(backend["name"], pool["metadata"]["name"]);
}
