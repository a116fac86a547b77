//! `cleave-router`: the OpenAI-compatible front of a cleave deployment.

use clap::Parser;

#[derive(Debug, Parser)]
#[command(version, about = "cleave router")]
struct Cli {
    #[command(flatten)]
    config: cleave_router::config::RouterConfig,
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("CLEAVE_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    match cleave_router::serve::serve_until_signal(cli.config) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
