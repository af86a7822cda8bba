//! The `pagoda` binary.

use clap::Parser;

fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let cli = pagoda::cli::Cli::parse();
    match pagoda::cli::run(cli) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            // One line with the whole context chain: "outer: inner: cause".
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
