//! Two transports in one process (and one in a child process), run against both backends:
//! patterned block runs land at the right offsets, reads come back, bounds and unknown regions
//! are errors, cancellation works, a vanished peer fails fast and a restarted one is reachable.

#![allow(clippy::disallowed_methods)] // tests and benchmarks may read the environment and poll with sleeps

use anyhow::{ensure, Context, Result};
use cleave_kv_transfer::{
    default_transport, ucx_or_skip, Backend, BackendChoice, Error, RegionDescriptor, RegionHandle,
    TransferStats, Transport, TransportConfig, WorkerAddress, WriteOp,
};
use std::io::{BufRead, BufReader, Write};
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

const BLOCK: usize = 4096 + 64; // odd-sized so offsets are not page aligned

fn config(choice: BackendChoice) -> TransportConfig {
    TransportConfig {
        backend: choice,
        timeout: Duration::from_secs(10),
        ..Default::default()
    }
}

/// A transport of `choice`, or `None` (with a message) when UCX is not in this build.
fn transport(choice: BackendChoice) -> Option<Arc<dyn Transport>> {
    if choice == BackendChoice::Ucx && !ucx_or_skip("kv-transfer over UCX") {
        return None;
    }
    let t = default_transport(&config(choice)).expect("transport");
    let want = if choice == BackendChoice::Ucx {
        Backend::Ucx
    } else {
        Backend::Tcp
    };
    assert_eq!(t.backend(), want);
    Some(t)
}

/// Deterministic bytes for block `b` of a run tagged `seed`.
fn pattern(seed: u8, b: usize) -> Vec<u8> {
    (0..BLOCK)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed ^ b as u8))
        .collect()
}

fn fill(region: &RegionHandle, seed: u8, blocks: usize) {
    for b in 0..blocks {
        region.copy_in(b * BLOCK, &pattern(seed, b));
    }
}

fn block_at(region: &RegionHandle, offset: usize) -> Vec<u8> {
    let mut out = vec![0u8; BLOCK];
    region.copy_out(offset, &mut out);
    out
}

fn op(local_block: usize, remote_block: usize, blocks: usize) -> WriteOp {
    WriteOp {
        local_offset: local_block * BLOCK,
        remote_offset: remote_block * BLOCK,
        len: blocks * BLOCK,
    }
}

/// `from` copies `ops` of `src` into the peer's region `to`, with a token nobody cancels.
async fn write(
    from: &Arc<dyn Transport>,
    peer: &WorkerAddress,
    to: &RegionDescriptor,
    ops: &[WriteOp],
    src: &RegionHandle,
) -> Result<TransferStats, Error> {
    from.write(peer, to, ops, src, CancellationToken::new())
        .await
}

/// Weighted byte sum, so that the child process can report what landed in one number.
fn checksum(bytes: &[u8]) -> u64 {
    bytes
        .iter()
        .enumerate()
        .map(|(i, &b)| (i as u64 + 1) * b as u64)
        .sum()
}

/// The rest of the first line from `child` that holds `tag` (libtest prints its own text
/// before the child's first line); `waiting_for` names it when the child exits first.
fn tagged_line(child: &mut impl BufRead, tag: &str, waiting_for: &str) -> Result<String> {
    let mut line = String::new();
    loop {
        line.clear();
        ensure!(
            child.read_line(&mut line)? > 0,
            "child exited before {waiting_for}"
        );
        if let Some((_, rest)) = line.split_once(tag) {
            return Ok(rest.trim_end().to_owned());
        }
    }
}

async fn writes_land(choice: BackendChoice) -> Result<()> {
    let (Some(a), Some(b)) = (transport(choice), transport(choice)) else {
        return Ok(());
    };
    let src = a.allocate_region(16 * BLOCK)?.handle();
    let dst_region = b.allocate_region(32 * BLOCK)?;
    let dst = dst_region.handle();
    fill(&src, 7, 16);
    // A contiguous run of 4 blocks (coalesced per block op), and scattered single blocks.
    let mut ops: Vec<WriteOp> = (0..4).map(|i| op(i, 10 + i, 1)).collect();
    ops.extend([op(4, 0, 1), op(9, 31, 1), op(5, 20, 2)]);
    let stats = write(&a, &b.local_address(), &dst.descriptor(), &ops, &src).await?;
    ensure!(
        stats.bytes == 8 * BLOCK as u64 && stats.requested_ops == 7 && stats.issued_ops == 4,
        "{stats:?}"
    );
    ensure!(stats.backend == a.backend());
    for (local, remote) in [
        (0, 10),
        (1, 11),
        (2, 12),
        (3, 13),
        (4, 0),
        (9, 31),
        (5, 20),
        (6, 21),
    ] {
        ensure!(
            block_at(&dst, remote * BLOCK) == pattern(7, local),
            "block {local} -> {remote} differs"
        );
    }
    ensure!(
        block_at(&dst, BLOCK) == vec![0u8; BLOCK],
        "untouched block was written"
    );
    // The engine's view is the same memory.
    ensure!(dst_region.as_slice()[10 * BLOCK..11 * BLOCK] == pattern(7, 0)[..]);

    // Read two remote blocks back into a fresh local region.
    let back = a.allocate_region(2 * BLOCK)?.handle();
    let ops = [op(0, 31, 1), op(1, 0, 1)];
    a.read(
        &b.local_address(),
        &dst.descriptor(),
        &ops,
        &back,
        CancellationToken::new(),
    )
    .await?;
    ensure!(block_at(&back, 0) == pattern(7, 9) && block_at(&back, BLOCK) == pattern(7, 4));
    Ok(())
}

async fn out_of_bounds_is_an_error(choice: BackendChoice) -> Result<()> {
    let (Some(a), Some(b)) = (transport(choice), transport(choice)) else {
        return Ok(());
    };
    let src = a.allocate_region(4 * BLOCK)?.handle();
    let dst = b.allocate_region(2 * BLOCK)?.handle();
    let peer = b.local_address();
    // Past the end of the remote region, then past the end of the local one.
    for bad in [op(0, 1, 2), op(3, 0, 2)] {
        let err = write(&a, &peer, &dst.descriptor(), &[bad], &src)
            .await
            .unwrap_err();
        ensure!(matches!(err, Error::OutOfBounds { .. }), "{err}");
    }
    // A descriptor that lies about its length is caught by the owner (TCP) or the rkey (UCX);
    // either way no crash and a typed error for TCP.
    if choice == BackendChoice::Tcp {
        let mut lying = dst.descriptor();
        lying.len = 4 * BLOCK as u64;
        let err = write(&a, &peer, &lying, &[op(0, 2, 2)], &src)
            .await
            .unwrap_err();
        ensure!(matches!(err, Error::OutOfBounds { .. }), "{err}");
    }
    // An unknown region id.
    let mut unknown = dst.descriptor();
    unknown.id.0 ^= 0x5555;
    let err = write(&a, &peer, &unknown, &[op(0, 0, 1)], &src)
        .await
        .unwrap_err();
    ensure!(matches!(err, Error::UnknownRegion { .. }), "{err}");
    // The transport still works afterwards.
    fill(&src, 3, 1);
    write(&a, &peer, &dst.descriptor(), &[op(0, 1, 1)], &src).await?;
    ensure!(block_at(&dst, BLOCK) == pattern(3, 0));
    Ok(())
}

async fn cancellation(choice: BackendChoice) -> Result<()> {
    let (Some(a), Some(b)) = (transport(choice), transport(choice)) else {
        return Ok(());
    };
    let src = a.allocate_region(4 * BLOCK)?.handle();
    let dst = b.allocate_region(4 * BLOCK)?.handle();
    let cancel = CancellationToken::new();
    cancel.cancel();
    let err = a
        .write(
            &b.local_address(),
            &dst.descriptor(),
            &[op(0, 0, 4)],
            &src,
            cancel,
        )
        .await
        .unwrap_err();
    ensure!(matches!(err, Error::Cancelled), "{err}");
    write(
        &a,
        &b.local_address(),
        &dst.descriptor(),
        &[op(0, 0, 4)],
        &src,
    )
    .await?;
    Ok(())
}

/// Waits until nothing accepts connections at `addr` any more (a dropped transport's listener
/// task has stopped and its port is free), for at most 10 s.
async fn listener_closed(addr: std::net::SocketAddr) -> Result<()> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while tokio::net::TcpStream::connect(addr).await.is_ok() {
        ensure!(
            tokio::time::Instant::now() < deadline,
            "the listener at {addr} still accepts 10 s after its transport was dropped"
        );
        tokio::task::yield_now().await;
    }
    Ok(())
}

async fn vanished_peer_fails_fast(choice: BackendChoice) -> Result<()> {
    let (Some(a), Some(b)) = (transport(choice), transport(choice)) else {
        return Ok(());
    };
    let src = a.allocate_region(4 * BLOCK)?.handle();
    let dst = b.allocate_region(4 * BLOCK)?;
    let (peer, desc) = (b.local_address(), dst.descriptor());
    write(&a, &peer, &desc, &[op(0, 0, 1)], &src).await?;
    drop(dst);
    drop(b);
    listener_closed(peer.tcp).await?;
    let result = tokio::time::timeout(
        Duration::from_secs(20),
        write(&a, &peer, &desc, &[op(0, 0, 1)], &src),
    )
    .await
    .context("write to a vanished peer hung")?;
    let err = result.err().context("write to a vanished peer succeeded")?;
    ensure!(
        matches!(
            err,
            Error::PeerUnreachable { .. } | Error::Connection { .. } | Error::UnknownRegion { .. }
        ),
        "{err}"
    );
    Ok(())
}

async fn restarted_peer_is_reachable(choice: BackendChoice) -> Result<()> {
    let (Some(a), Some(b)) = (transport(choice), transport(choice)) else {
        return Ok(());
    };
    let src = a.allocate_region(4 * BLOCK)?.handle();
    fill(&src, 9, 4);
    let dst = b.allocate_region(4 * BLOCK)?;
    write(
        &a,
        &b.local_address(),
        &dst.descriptor(),
        &[op(0, 0, 1)],
        &src,
    )
    .await?;
    let listen = b.local_address().tcp;
    drop(dst);
    drop(b);
    // Not `listener_closed`: once the listener refuses, `a`'s connection to the old transport
    // can still be served by a connection task that has not ended (one run in 64 then wrote to
    // it and found the new region unknown); nothing outside the transport shows when the last
    // task ended.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let b2 = default_transport(&TransportConfig {
        listen,
        ..config(choice)
    })?;
    let dst2 = b2.allocate_region(4 * BLOCK)?.handle();
    let stats = write(
        &a,
        &b2.local_address(),
        &dst2.descriptor(),
        &[op(1, 2, 2)],
        &src,
    )
    .await?;
    ensure!(stats.bytes == 2 * BLOCK as u64);
    ensure!(
        block_at(&dst2, 2 * BLOCK) == pattern(9, 1) && block_at(&dst2, 3 * BLOCK) == pattern(9, 2)
    );
    Ok(())
}

const CHILD_ENV: &str = "CLEAVE_KV_TRANSFER_TEST_CHILD";

/// Owner side in a child process: allocate, publish the address and descriptor, and when told,
/// report a checksum of what landed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn child_owner_entry() -> Result<()> {
    let Ok(choice) = std::env::var(CHILD_ENV) else {
        return Ok(());
    };
    let choice = if choice == "ucx" {
        BackendChoice::Ucx
    } else {
        BackendChoice::Tcp
    };
    let t = default_transport(&config(choice))?;
    let region = t.allocate_region(8 * BLOCK)?;
    let line = serde_json::to_string(&(t.local_address(), region.descriptor()))?;
    println!("OWNER {line}");
    std::io::stdout().flush()?;
    let mut cmd = String::new();
    tokio::task::spawn_blocking(move || std::io::stdin().read_line(&mut cmd)).await??;
    println!("SUM {}", checksum(region.as_slice()));
    std::io::stdout().flush()?;
    Ok(())
}

async fn child_process(choice: BackendChoice) -> Result<()> {
    let Some(a) = transport(choice) else {
        return Ok(());
    };
    let mut child = std::process::Command::new(std::env::current_exe()?)
        .args([
            "--exact",
            // The test's path in the crate's one integration binary.
            "transfer::child_owner_entry",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(
            CHILD_ENV,
            if choice == BackendChoice::Ucx {
                "ucx"
            } else {
                "tcp"
            },
        )
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()?;
    let mut stdout = BufReader::new(child.stdout.take().context("child stdout")?);
    let owner = tagged_line(&mut stdout, "OWNER ", "publishing")?;
    let (peer, desc): (WorkerAddress, RegionDescriptor) = serde_json::from_str(&owner)?;
    let src = a.allocate_region(8 * BLOCK)?.handle();
    fill(&src, 42, 8);
    let ops = [op(0, 4, 4), op(4, 0, 2)];
    write(&a, &peer, &desc, &ops, &src).await?;
    let back = a.allocate_region(8 * BLOCK)?.handle();
    a.read(
        &peer,
        &desc,
        &[op(0, 0, 8)],
        &back,
        CancellationToken::new(),
    )
    .await?;
    let mut expected = vec![0u8; 8 * BLOCK];
    for (local, remote) in [(0, 4), (1, 5), (2, 6), (3, 7), (4, 0), (5, 1)] {
        expected[remote * BLOCK..(remote + 1) * BLOCK].copy_from_slice(&pattern(42, local));
    }
    let mut got = vec![0u8; 8 * BLOCK];
    back.copy_out(0, &mut got);
    ensure!(got == expected, "read-back differs from what was written");
    child
        .stdin
        .take()
        .context("child stdin")?
        .write_all(b"sum\n")?;
    let want = checksum(&expected);
    let sum: u64 = tagged_line(&mut stdout, "SUM ", "the checksum")?.parse()?;
    ensure!(sum == want, "child saw checksum {sum}, expected {want}");
    ensure!(child.wait()?.success(), "child failed");
    Ok(())
}

/// A transport listening on every interface names the advertised IP in its address and
/// region descriptors (what peers on other hosts dial); without one it refuses to start.
async fn wildcard_listen_advertises(choice: BackendChoice) -> Result<()> {
    if choice == BackendChoice::Ucx && !ucx_or_skip("wildcard_listen_advertises over UCX") {
        return Ok(());
    }
    let mut cfg = config(choice);
    cfg.listen = "0.0.0.0:0".parse()?;
    let e = anyhow::Error::from(default_transport(&cfg).err().context("no advertise")?);
    ensure!(format!("{e:#}").contains("--kv-advertise"), "{e:#}");
    cfg.advertise = Some("127.0.0.1".parse()?);
    let b = default_transport(&cfg)?;
    ensure!(b.local_address().tcp.ip().to_string() == "127.0.0.1");
    let a = transport(choice).context("transport")?;
    let src = a.allocate_region(2 * BLOCK)?.handle();
    let dst = b.allocate_region(2 * BLOCK)?.handle();
    fill(&src, 3, 2);
    write(
        &a,
        &b.local_address(),
        &dst.descriptor(),
        &[op(0, 1, 1)],
        &src,
    )
    .await?;
    ensure!(block_at(&dst, BLOCK) == pattern(3, 0));
    Ok(())
}

/// Module `$module` runs every scenario above on `$choice`, one `#[tokio::test]` each.
macro_rules! for_backend {
    ($module:ident, $choice:expr) => {
        for_backend!(
            $module,
            $choice,
            writes_land,
            out_of_bounds_is_an_error,
            cancellation,
            vanished_peer_fails_fast,
            restarted_peer_is_reachable,
            child_process,
            wildcard_listen_advertises
        );
    };
    ($module:ident, $choice:expr, $($scenario:ident),+) => {
        mod $module {
            use super::*;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $scenario() -> Result<()> {
                    super::$scenario($choice).await
                }
            )+
        }
    };
}

for_backend!(tcp, BackendChoice::Tcp);
for_backend!(ucx, BackendChoice::Ucx);
