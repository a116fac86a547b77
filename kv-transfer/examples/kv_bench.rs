//! `cargo run -p cleave-kv-transfer --example kv_bench [-- --json out.json --mib N
//! --block-bytes N --no-perftest]`: prints the
//! KV-transfer benchmark table and writes its JSON (to stdout, or to `--json PATH`).

use cleave_kv_transfer::bench::{bench, BenchConfig};

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let mut config = BenchConfig::default();
    let mut json_path = None;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--json" => json_path = args.next(),
            "--mib" => {
                config.bytes_per_shape = args.next().unwrap_or_default().parse::<u64>()? << 20
            }
            "--block-bytes" => config.block_bytes = args.next().unwrap_or_default().parse()?,
            "--no-perftest" => config.ucx_perftest = false,
            other => anyhow::bail!("unknown argument {other}"),
        }
    }
    let report = bench(&config).await?;
    print!("{}", report.table());
    let json = serde_json::to_string_pretty(&report)?;
    match json_path {
        Some(path) => std::fs::write(path, json)?,
        None => println!("{json}"),
    }
    Ok(())
}
