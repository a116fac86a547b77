//! The KV tiers a worker's flags ask for (`--kv-host-memory`, `--kv-disk-*`), checked before the
//! engine starts: a disk directory that cannot be created or written is an error naming it.

use std::io::Read;
use std::path::Path;

use cleave_config::worker::WorkerConfig;
use cleave_engine::kv::tiers::{DiskConfig, TierConfig};
use xxhash_rust::xxh3::Xxh3;

use crate::error::WorkerError;

/// Bytes of the model file's start and end that its identity hashes.
const HEAD: u64 = 16 << 20;
const TAIL: u64 = 1 << 20;

/// The tiers for `config` (all off when no flag asks for one).
pub fn tier_config(config: &WorkerConfig, group_size: usize) -> Result<TierConfig, WorkerError> {
    let host_bytes = usize::try_from(config.kv_host_memory.as_u64())
        .map_err(|_| WorkerError::Tiers("--kv-host-memory does not fit in memory".into()))?;
    if host_bytes == 0 && config.kv_disk_dir.is_none() {
        return Ok(TierConfig::default());
    }
    if group_size > 1 {
        return Err(WorkerError::Tiers(
            "--kv-host-memory and --kv-disk-dir are not supported in worker groups yet".into(),
        ));
    }
    let disk = match &config.kv_disk_dir {
        Some(dir) => {
            writable(dir)?;
            Some(DiskConfig {
                dir: dir.clone(),
                max_bytes: config.kv_disk_size.as_u64(),
                min_uses: config.kv_disk_min_uses,
            })
        }
        None => None,
    };
    Ok(TierConfig {
        host_bytes,
        disk,
        model_id: model_identity(&config.model)?,
    })
}

/// Creates `dir` if needed and checks that a file can be written in it.
fn writable(dir: &Path) -> Result<(), WorkerError> {
    let bad =
        |e: std::io::Error| WorkerError::Tiers(format!("--kv-disk-dir {}: {e}", dir.display()));
    std::fs::create_dir_all(dir).map_err(bad)?;
    let probe = dir.join(format!(".probe-{}.tmp", std::process::id()));
    std::fs::write(&probe, b"cleave").map_err(bad)?;
    std::fs::remove_file(&probe).map_err(bad)
}

/// What identifies the model's weights for the disk tier's fingerprint: XXH3-128 of the file's
/// length, its first 16 MiB (the GGUF header with every tensor's name, shape, type and offset,
/// and the first weights) and its last MiB. A directory model (safetensors) hashes the same of
/// each file, in name order. Reading all of an 8B file at every start would cost seconds; two
/// files that agree on all of this but differ elsewhere would share disk entries.
pub fn model_identity(path: &Path) -> Result<u128, WorkerError> {
    let bad = |e: std::io::Error| {
        WorkerError::Tiers(format!("reading {} for its identity: {e}", path.display()))
    };
    let mut files = Vec::new();
    if path.is_dir() {
        for e in std::fs::read_dir(path).map_err(bad)? {
            let p = e.map_err(bad)?.path();
            if p.is_file() {
                files.push(p);
            }
        }
        files.sort();
    } else {
        files.push(path.to_path_buf());
    }
    let mut h = Xxh3::new();
    for f in files {
        let mut file = std::fs::File::open(&f).map_err(bad)?;
        let len = file.metadata().map_err(bad)?.len();
        h.update(&len.to_le_bytes());
        let mut buf = Vec::new();
        (&mut file).take(HEAD).read_to_end(&mut buf).map_err(bad)?;
        if len > HEAD + TAIL {
            use std::io::Seek;
            file.seek(std::io::SeekFrom::Start(len - TAIL))
                .map_err(bad)?;
            file.take(TAIL).read_to_end(&mut buf).map_err(bad)?;
        }
        h.update(&buf);
    }
    Ok(h.digest128())
}
