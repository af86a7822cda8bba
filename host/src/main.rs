//! The `pagoda` binary.

fn main() -> std::process::ExitCode {
    let args = match pagoda::cli::config_file::expand(std::env::args_os().collect()) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("error: {e:#}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let cli = pagoda::cli::Cli::parse_overridable(args);
    // After parsing, so that `serve --log-format json` applies to every line.
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    // Colours only on a terminal: a log file or pipeline gets plain text.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let fmt = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(ansi)
        .with_env_filter(filter);
    if cli.log_json() {
        fmt.json().flatten_event(true).init();
    } else {
        fmt.init();
    }
    match pagoda::cli::run(cli) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            // One line with the whole context chain: "outer: inner: cause".
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
