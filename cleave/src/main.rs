//! `cleave`: the command line a user starts with.

#![forbid(unsafe_code)]

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let cli = cleave::Cli::parse();
    let _telemetry = cleave_telemetry::init_with_default("cleave", "warn");
    match cleave::run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
