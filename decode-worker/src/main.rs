//! `cleave-decode`: the decode worker.

fn main() -> std::process::ExitCode {
    cleave_worker::main_for(cleave_decode_worker::SERVICE)
}
