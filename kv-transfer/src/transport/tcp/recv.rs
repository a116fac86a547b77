//! The owner's side of the TCP backend: accepts connections and serves each one's requests in
//! order, copying write payloads straight from the socket into the region.

use super::wire::{Header, Op, Status, HEADER_LEN};
use super::{Conn, Shared, HANDSHAKE_TIMEOUT};
use crate::region::RegionMem;
use std::io;
use std::sync::Arc;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

/// Accepts connections until `stop` is cancelled (the transport was dropped); each connection
/// is closed then as well, so peers see the owner go away.
pub(super) async fn serve(listener: TcpListener, shared: Arc<Shared>, stop: CancellationToken) {
    loop {
        let stream = tokio::select! {
            _ = stop.cancelled() => return,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    tracing::warn!(error = %e, "kv-transfer accept failed");
                    continue;
                }
            },
        };
        let shared = Arc::clone(&shared);
        let stop = stop.clone();
        tokio::spawn(async move {
            tokio::select! {
                _ = stop.cancelled() => {}
                result = accept(stream, &shared) => {
                    if let Err(e) = result {
                        tracing::debug!(error = %e, "kv-transfer connection ended");
                    }
                }
            }
        });
    }
}

/// Serves one accepted connection, after the TLS handshake when the transport has TLS.
async fn accept(stream: TcpStream, shared: &Shared) -> io::Result<()> {
    stream.set_nodelay(true)?;
    let stream: Conn = match &shared.config.tls {
        None => Box::new(stream),
        Some(tls) => {
            let acceptor = tokio_rustls::TlsAcceptor::from(tls.server());
            let handshake = tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream));
            match handshake.await {
                Ok(tls) => Box::new(tls?),
                Err(_) => return Err(io::Error::new(io::ErrorKind::TimedOut, "TLS handshake")),
            }
        }
    };
    connection(stream, shared).await
}

async fn connection(mut stream: Conn, shared: &Shared) -> io::Result<()> {
    loop {
        let mut raw = [0u8; HEADER_LEN];
        match stream.read_exact(&mut raw).await {
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e),
        }
        let header = Header::decode(&raw)
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "unknown request op"))?;
        let target = lookup(shared, &header);
        match (header.op, target) {
            (Op::Write, Ok(mem)) => {
                let offset = header.offset as usize;
                // SAFETY: `lookup` checked `offset + len` against the region, which `mem` keeps
                // alive; peers only write blocks the engine is not using (region module docs).
                let dst = unsafe {
                    std::slice::from_raw_parts_mut(mem.ptr().add(offset), header.len as usize)
                };
                stream.read_exact(dst).await?;
                stream.write_all(&[Status::Ok as u8]).await?;
            }
            (Op::Write, Err(status)) => {
                let mut payload = (&mut stream).take(header.len);
                tokio::io::copy(&mut payload, &mut tokio::io::sink()).await?;
                stream.write_all(&[status as u8]).await?;
            }
            (Op::Read, Ok(mem)) => {
                // SAFETY: as above; a read only copies bytes out.
                let src = unsafe {
                    std::slice::from_raw_parts(
                        mem.ptr().add(header.offset as usize),
                        header.len as usize,
                    )
                };
                stream.write_all(&[Status::Ok as u8]).await?;
                stream.write_all(src).await?;
            }
            (Op::Read | Op::Ping, Err(status)) => stream.write_all(&[status as u8]).await?,
            (Op::Ping, Ok(_)) => stream.write_all(&[Status::Ok as u8]).await?,
        }
        // TLS buffers records; the peer waits for this reply.
        stream.flush().await?;
    }
}

/// The region a request addresses, if it exists and holds the requested range.
fn lookup(shared: &Shared, header: &Header) -> Result<Arc<RegionMem>, Status> {
    let mem = shared
        .regions
        .lock()
        .expect("region registry poisoned")
        .get(&header.region)
        .and_then(|weak| weak.upgrade())
        .ok_or(Status::UnknownRegion)?;
    let end = header
        .offset
        .checked_add(header.len)
        .ok_or(Status::OutOfBounds)?;
    if end > mem.len() as u64 {
        return Err(Status::OutOfBounds);
    }
    Ok(mem)
}
