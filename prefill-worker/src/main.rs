//! `cleave-prefill`: the prefill worker.

fn main() -> std::process::ExitCode {
    cleave_worker::main_for(cleave_prefill_worker::SERVICE)
}
