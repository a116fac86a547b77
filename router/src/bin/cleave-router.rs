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
    let _telemetry = cleave_telemetry::init("cleave-router");
    match cleave_router::serve::serve_until_signal(cli.config) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", cleave_telemetry::error_chain(&e));
            std::process::ExitCode::FAILURE
        }
    }
}
