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
        for probe in [
            "path: /health\n",
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
