//! The KV transport's TCP path over mutual TLS (`TransportConfig::tls`, the workers'
//! `--internal-tls-*`): the TCP backend's data and the UCX backend's control channel. Bytes land
//! between peers holding certificates from one CA; a peer speaking plain TCP, or holding a
//! certificate from another CA, is refused either way round.

use anyhow::{ensure, Context, Result};
use cleave_kv_transfer::{
    default_transport, ucx_or_skip, BackendChoice, Transport, TransportConfig, WriteOp,
};
use cleave_tls::testing::TestCa;
use cleave_tls::Mutual;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

const BLOCK: usize = 4096;

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("cleave-kv-tls-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// An identity issued by `ca`, written under a fresh directory called `name`.
fn identity(ca: &TestCa, name: &str) -> Mutual {
    Mutual::load(&ca.write_secret(&scratch(name))).expect("loading the identity")
}

fn transport(choice: BackendChoice, tls: Option<Mutual>) -> Arc<dyn Transport> {
    default_transport(&TransportConfig {
        backend: choice,
        timeout: Duration::from_secs(10),
        tls,
        ..Default::default()
    })
    .expect("transport")
}

/// Writes one patterned block from `a` into a region of `b` and reads it back.
async fn round_trip(a: &Arc<dyn Transport>, b: &Arc<dyn Transport>) -> Result<()> {
    let src = a.allocate_region(2 * BLOCK)?.handle();
    let dst = b.allocate_region(2 * BLOCK)?.handle();
    let block: Vec<u8> = (0..BLOCK).map(|i| (i * 7 % 251) as u8).collect();
    src.copy_in(0, &block);
    let op = WriteOp {
        local_offset: 0,
        remote_offset: BLOCK,
        len: BLOCK,
    };
    let peer = b.local_address();
    tokio::time::timeout(
        Duration::from_secs(20),
        a.write(
            &peer,
            &dst.descriptor(),
            &[op],
            &src,
            CancellationToken::new(),
        ),
    )
    .await
    .context("the write hung")??;
    let mut landed = vec![0u8; BLOCK];
    dst.copy_out(BLOCK, &mut landed);
    ensure!(landed == block, "the written block differs");
    let back = a.allocate_region(BLOCK)?.handle();
    let read = WriteOp {
        local_offset: 0,
        remote_offset: BLOCK,
        len: BLOCK,
    };
    a.read(
        &peer,
        &dst.descriptor(),
        &[read],
        &back,
        CancellationToken::new(),
    )
    .await?;
    let mut got = vec![0u8; BLOCK];
    back.copy_out(0, &mut got);
    ensure!(got == block, "the block read back differs");
    Ok(())
}

async fn transfers_between_holders_of_one_ca(choice: BackendChoice) -> Result<()> {
    let ca = TestCa::new("cleave internal CA");
    let a = transport(choice, Some(identity(&ca, &format!("{choice:?}-a"))));
    let b = transport(choice, Some(identity(&ca, &format!("{choice:?}-b"))));
    round_trip(&a, &b).await?;
    // Again, on the pooled connection.
    round_trip(&a, &b).await
}

async fn strangers_are_refused(choice: BackendChoice) -> Result<()> {
    let ca = TestCa::new("cleave internal CA");
    let member = || Some(identity(&ca, &format!("{choice:?}-member")));
    let stranger = Some(identity(
        &TestCa::new("another CA"),
        &format!("{choice:?}-stranger"),
    ));
    let cases = [
        ("plain writer, TLS owner", None, member()),
        ("TLS writer, plain owner", member(), None),
        ("writer from another CA", stranger.clone(), member()),
        ("owner from another CA", member(), stranger),
    ];
    for (case, writer, owner) in cases {
        let (a, b) = (transport(choice, writer), transport(choice, owner));
        let err = round_trip(&a, &b).await;
        ensure!(err.is_err(), "{choice:?}: {case}: the transfer succeeded");
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_transfers_over_mutual_tls() -> Result<()> {
    transfers_between_holders_of_one_ca(BackendChoice::Tcp).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_refuses_peers_without_the_cas_certificate() -> Result<()> {
    strangers_are_refused(BackendChoice::Tcp).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ucx_control_channel_over_mutual_tls() -> Result<()> {
    if !ucx_or_skip("kv-transfer TLS over UCX") {
        return Ok(());
    }
    transfers_between_holders_of_one_ca(BackendChoice::Ucx).await?;
    // The one-sided put needs no TCP, but its confirmation does: a peer that cannot complete
    // the handshake fails the transfer.
    strangers_are_refused(BackendChoice::Ucx).await
}
