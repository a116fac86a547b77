//! The sending side of the TCP backend: plans the ops, takes an idle connection to the owner
//! (or opens one), pipelines one frame per run and reads one status per run.
//!
//! A connection whose transfer failed or was cancelled is dropped, never reused. When a reused
//! idle connection fails (the owner restarted at the same address), the pool for that peer is
//! cleared and the transfer is retried once on a fresh connection; transfers are idempotent.

use super::wire::{Header, Op, Status, HEADER_LEN};
use super::{Conn, Shared, HANDSHAKE_TIMEOUT};
use crate::transport::{bounded, Backend, Direction};
use crate::{plan, Error, RegionDescriptor, RegionHandle, Run, Side, TransferStats, WriteOp};
use std::io;
use std::net::SocketAddr;
use std::time::Instant;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;

pub(super) async fn transfer(
    shared: &Shared,
    dir: Direction,
    remote: &RegionDescriptor,
    ops: &[WriteOp],
    local: &RegionHandle,
    cancel: &CancellationToken,
) -> Result<TransferStats, Error> {
    let start = Instant::now();
    let runs = plan(ops, local.len(), remote.len as usize)?;
    let stats = TransferStats::planned(Backend::Tcp, ops.len(), &runs);
    if runs.is_empty() {
        return Ok(TransferStats {
            elapsed: start.elapsed(),
            ..stats
        });
    }
    bounded(shared.config.timeout, cancel, async {
        with_connection(
            shared,
            remote,
            Request::Transfer {
                dir,
                runs: &runs,
                local,
            },
        )
        .await
    })
    .await?;
    Ok(TransferStats {
        elapsed: start.elapsed(),
        ..stats
    })
}

/// Checks that the owner is alive and has the region (the UCX backend's confirmation).
#[cfg(have_ucx)]
pub(super) async fn ping(shared: &Shared, remote: &RegionDescriptor) -> Result<(), Error> {
    let never = CancellationToken::new();
    bounded(shared.config.timeout, &never, async {
        with_connection(shared, remote, Request::Ping).await
    })
    .await
}

/// What to do on a connection.
#[derive(Clone, Copy)]
enum Request<'a> {
    /// Move the runs' bytes.
    Transfer {
        dir: Direction,
        runs: &'a [Run],
        local: &'a RegionHandle,
    },
    /// Check that the region exists (sent only by builds with UCX).
    #[cfg_attr(not(have_ucx), allow(dead_code))]
    Ping,
}

/// Runs `request` on a connection to the region's owner, retrying once on a fresh connection
/// when a reused one turns out to be dead.
async fn with_connection(
    shared: &Shared,
    remote: &RegionDescriptor,
    request: Request<'_>,
) -> Result<(), Error> {
    let peer = remote.owner;
    let mut retried = false;
    loop {
        let (mut stream, reused) = match take_idle(shared, peer) {
            Some(stream) if !retried => (stream, true),
            _ => (connect(shared, peer).await?, false),
        };
        let outcome = match request {
            Request::Transfer { dir, runs, local } => {
                exchange(&mut stream, dir, remote, runs, local).await
            }
            Request::Ping => ping_on(&mut stream, remote).await,
        };
        match outcome {
            Ok(result) => {
                put_idle(shared, peer, stream);
                return result;
            }
            Err(e) if reused => {
                tracing::debug!(%peer, error = %e, "stale kv-transfer connection, reconnecting");
                shared.idle.lock().expect("pool poisoned").remove(&peer);
                retried = true;
            }
            Err(source) => {
                return Err(Error::Connection {
                    peer: peer.to_string(),
                    source,
                })
            }
        }
    }
}

fn take_idle(shared: &Shared, peer: SocketAddr) -> Option<Conn> {
    shared
        .idle
        .lock()
        .expect("pool poisoned")
        .get_mut(&peer)?
        .pop()
}

fn put_idle(shared: &Shared, peer: SocketAddr, stream: Conn) {
    shared
        .idle
        .lock()
        .expect("pool poisoned")
        .entry(peer)
        .or_default()
        .push(stream);
}

async fn connect(shared: &Shared, peer: SocketAddr) -> Result<Conn, Error> {
    let unreachable = |source| Error::PeerUnreachable {
        peer: peer.to_string(),
        source,
    };
    let stream = tokio::time::timeout(shared.config.connect_timeout, TcpStream::connect(peer))
        .await
        .map_err(|_| unreachable(io::Error::new(io::ErrorKind::TimedOut, "connect timed out")))?
        .map_err(unreachable)?;
    stream.set_nodelay(true).map_err(unreachable)?;
    let Some(tls) = &shared.config.tls else {
        return Ok(Box::new(stream));
    };
    let connector = tokio_rustls::TlsConnector::from(tls.client());
    let handshake = connector.connect(tls.server_name(peer.ip()), stream);
    match tokio::time::timeout(HANDSHAKE_TIMEOUT, handshake).await {
        Ok(Ok(tls)) => Ok(Box::new(tls)),
        Ok(Err(e)) => Err(unreachable(e)),
        Err(_) => Err(unreachable(io::Error::new(
            io::ErrorKind::TimedOut,
            "TLS handshake timed out",
        ))),
    }
}

async fn exchange(
    stream: &mut Conn,
    dir: Direction,
    remote: &RegionDescriptor,
    runs: &[Run],
    local: &RegionHandle,
) -> io::Result<Result<(), Error>> {
    let mem = local.mem();
    let op = match dir {
        Direction::Write => Op::Write,
        Direction::Read => Op::Read,
    };
    for run in runs {
        let header = Header {
            op,
            region: remote.id,
            offset: run.remote_offset as u64,
            len: run.len as u64,
        };
        stream.write_all(&header.encode()).await?;
        if dir == Direction::Write {
            // SAFETY: `plan` checked the run against the local region, which `mem` keeps alive;
            // the engine does not write blocks that are being exported (region module docs).
            let src =
                unsafe { std::slice::from_raw_parts(mem.ptr().add(run.local_offset), run.len) };
            stream.write_all(src).await?;
        }
    }
    stream.flush().await?;
    let mut first_error = None;
    for run in runs {
        match read_status(stream, remote).await? {
            Ok(()) if dir == Direction::Read => {
                // SAFETY: as above; the engine does not use blocks being imported.
                let dst = unsafe {
                    std::slice::from_raw_parts_mut(mem.ptr().add(run.local_offset), run.len)
                };
                stream.read_exact(dst).await?;
            }
            Ok(()) => {}
            Err(Error::OutOfBounds { .. }) => {
                first_error.get_or_insert(Error::OutOfBounds {
                    side: Side::Remote,
                    offset: run.remote_offset,
                    len: run.len,
                    region_len: remote.len as usize,
                });
            }
            Err(e) => {
                first_error.get_or_insert(e);
            }
        }
    }
    Ok(first_error.map_or(Ok(()), Err))
}

async fn ping_on(stream: &mut Conn, remote: &RegionDescriptor) -> io::Result<Result<(), Error>> {
    let header = Header {
        op: Op::Ping,
        region: remote.id,
        offset: 0,
        len: 0,
    };
    stream.write_all(&header.encode()).await?;
    stream.flush().await?;
    read_status(stream, remote).await
}

async fn read_status(
    stream: &mut Conn,
    remote: &RegionDescriptor,
) -> io::Result<Result<(), Error>> {
    let mut b = [0u8; 1];
    stream.read_exact(&mut b).await?;
    let peer = remote.owner.to_string();
    Ok(match Status::decode(b[0]) {
        Some(Status::Ok) => Ok(()),
        Some(Status::UnknownRegion) => Err(Error::UnknownRegion {
            peer,
            id: remote.id,
        }),
        Some(Status::OutOfBounds) => Err(Error::OutOfBounds {
            side: Side::Remote,
            offset: 0,
            len: 0,
            region_len: remote.len as usize,
        }),
        None => Err(Error::Protocol {
            peer,
            message: format!("unknown status {}", b[0]),
        }),
    })
}

const _: () = assert!(HEADER_LEN == 25);
