//! `--config FILE` and repeated flags: the file's values are defaults that
//! flags on the command line override (as documented, and as
//! `scripts/demo.sh --port 9000` relies on), instead of clap refusing the
//! repeated flag.

use pagoda_e2e::{Server, TempDir};

#[test]
fn command_line_flags_override_the_config_file_and_earlier_flags() {
    let dir = TempDir::new("cli-config");
    let file = dir.0.join("serve.yaml");
    // Server::start passes --port itself, after these; the file also sets
    // a value nothing overrides. (--served-model-name is the exception:
    // its names add up, which the tenant tests rely on.)
    std::fs::write(&file, "port: 1\nmax_num_seqs: 3\n").expect("write");
    let path = file.to_string_lossy().to_string();
    let s = Server::start(&["--config", &path, "--threads", "3", "--threads", "2"]);
    let (st, body) = s.get("/v1/models");
    assert_eq!(st, 200, "{body}");
    assert!(body.contains("\"smol\""), "{body}");
    // The file's max_num_seqs took effect (the start-up log reports it).
    assert!(
        s.log_text().contains("(max-num-seqs 3)"),
        "{}",
        s.log_text()
    );
}
