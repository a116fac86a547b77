//! Forming the group: rank 0 listens at the leader address, every other rank connects to it and
//! says who it is and where it listens; rank 0 answers with the table of addresses; then every
//! rank connects to the ranks below it (the connection to rank 0 is the rendezvous one), so each
//! pair of ranks shares one TCP connection.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use crate::{GroupConfig, GroupError};

const MAGIC: &[u8; 4] = b"CLVC";
const VERSION: u32 = 1;
/// Longest listen address a hello may carry.
const MAX_ADDR: usize = 1024;

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> GroupError {
    let what = what.into();
    move |source| GroupError::Io { what, source }
}

/// A rank whose listener is bound but that has not joined the group yet. Lets rank 0 bind port 0
/// and tell the others where it is before it waits for them.
pub struct Pending {
    pub(crate) cfg: GroupConfig,
    listener: TcpListener,
}

impl Pending {
    /// Binds this rank's listener (rank 0: the leader address's port unless `bind_addr` says
    /// otherwise; other ranks: `bind_addr` or an ephemeral port on every interface).
    pub fn bind(cfg: GroupConfig) -> Result<Pending, GroupError> {
        if cfg.world == 0 || cfg.rank >= cfg.world {
            return Err(GroupError::Config(format!(
                "rank {} is not a rank of a group of {}",
                cfg.rank, cfg.world
            )));
        }
        if !crate::transport_available(cfg.transport) {
            return Err(GroupError::Unsupported(format!(
                "this build has no {:?} (UCX was not found when it was built); use tcp",
                cfg.transport
            )));
        }
        let bind = match cfg.bind_addr {
            Some(a) => a,
            None if cfg.rank == 0 => {
                let leader = resolve(&cfg.leader_addr)?;
                let any: std::net::IpAddr = if leader.is_ipv4() {
                    std::net::Ipv4Addr::UNSPECIFIED.into()
                } else {
                    std::net::Ipv6Addr::UNSPECIFIED.into()
                };
                SocketAddr::new(any, leader.port())
            }
            None => "0.0.0.0:0".parse().expect("literal address"),
        };
        let listener =
            TcpListener::bind(bind).map_err(io(format!("rank {}: bind {bind}", cfg.rank)))?;
        Ok(Pending { cfg, listener })
    }

    /// Where this rank listens (for rank 0: what the others should use as the leader address).
    pub fn local_addr(&self) -> Result<SocketAddr, GroupError> {
        self.listener.local_addr().map_err(io("listener address"))
    }

    /// Joins the group: returns one connection per peer (`None` at this rank's own index).
    pub(crate) fn mesh(self) -> Result<Vec<Option<TcpStream>>, GroupError> {
        let cfg = &self.cfg;
        let deadline = Instant::now() + cfg.connect_timeout;
        let mut links: Vec<Option<TcpStream>> = (0..cfg.world).map(|_| None).collect();
        if cfg.world == 1 {
            return Ok(links);
        }
        let table = if cfg.rank == 0 {
            let mut table = vec![String::new(); cfg.world];
            for _ in 1..cfg.world {
                let (mut s, peer) = accept(&self.listener, deadline, cfg)?;
                let (rank, addr) = read_hello(&mut s, cfg)?;
                if rank == 0 || links[rank].is_some() {
                    return Err(GroupError::Protocol(format!(
                        "{peer} claims rank {rank}, which is taken"
                    )));
                }
                table[rank] = addr;
                links[rank] = Some(s);
            }
            let mut msg = Vec::new();
            for addr in &table[1..] {
                put_str(&mut msg, addr);
            }
            for s in links.iter_mut().flatten() {
                s.write_all(&msg).map_err(io("send address table"))?;
            }
            table
        } else {
            let mut s = connect_retry(&cfg.leader_addr, deadline, cfg.rank, 0)?;
            let port = self.local_addr()?.port();
            let host = match (&cfg.advertise_host, cfg.bind_addr) {
                (Some(h), _) => h.clone(),
                (None, Some(b)) if !b.ip().is_unspecified() => b.ip().to_string(),
                // The address this host used to reach the leader is one the leader's network
                // can route back to.
                (None, _) => s
                    .local_addr()
                    .map_err(io("local address"))?
                    .ip()
                    .to_string(),
            };
            let addr = join_host_port(&host, port);
            write_hello(&mut s, cfg, &addr)?;
            let mut table = vec![cfg.leader_addr.clone()];
            for _ in 1..cfg.world {
                table.push(get_str(&mut s)?);
            }
            links[0] = Some(s);
            table
        };
        // Ranks above 0 connect downwards and accept from above.
        for (peer, addr) in table.iter().enumerate().take(cfg.rank).skip(1) {
            let mut s = connect_retry(addr, deadline, cfg.rank, peer)?;
            write_hello(&mut s, cfg, "")?;
            links[peer] = Some(s);
        }
        if cfg.rank > 0 {
            for _ in cfg.rank + 1..cfg.world {
                let (mut s, peer) = accept(&self.listener, deadline, cfg)?;
                let (rank, _) = read_hello(&mut s, cfg)?;
                if rank <= cfg.rank || links[rank].is_some() {
                    return Err(GroupError::Protocol(format!(
                        "{peer} claims rank {rank}, unexpected at rank {}",
                        cfg.rank
                    )));
                }
                links[rank] = Some(s);
            }
        }
        for s in links.iter().flatten() {
            s.set_nodelay(true).map_err(io("set TCP_NODELAY"))?;
            s.set_read_timeout(None).map_err(io("clear read timeout"))?;
            s.set_write_timeout(None)
                .map_err(io("clear write timeout"))?;
            s.set_nonblocking(true).map_err(io("set non-blocking"))?;
        }
        Ok(links)
    }
}

fn resolve(addr: &str) -> Result<SocketAddr, GroupError> {
    addr.to_socket_addrs()
        .map_err(io(format!("resolve {addr}")))?
        .next()
        .ok_or_else(|| GroupError::Config(format!("{addr} resolves to no address")))
}

fn join_host_port(host: &str, port: u16) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

fn left(deadline: Instant, cfg: &GroupConfig, waiting_for: &str) -> Result<Duration, GroupError> {
    let now = Instant::now();
    if now >= deadline {
        return Err(GroupError::Timeout(
            cfg.connect_timeout,
            format!("rank {} waiting for {waiting_for}", cfg.rank),
        ));
    }
    Ok(deadline - now)
}

fn accept(
    l: &TcpListener,
    deadline: Instant,
    cfg: &GroupConfig,
) -> Result<(TcpStream, SocketAddr), GroupError> {
    l.set_nonblocking(true)
        .map_err(io("listener non-blocking"))?;
    loop {
        let wait = left(deadline, cfg, "the other ranks to connect")?;
        match l.accept() {
            Ok((s, peer)) => {
                s.set_nonblocking(false)
                    .map_err(io("accepted socket blocking"))?;
                s.set_read_timeout(Some(wait)).map_err(io("read timeout"))?;
                s.set_write_timeout(Some(wait))
                    .map_err(io("write timeout"))?;
                return Ok((s, peer));
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                // A non-blocking accept polled until the group's deadline (std has no accept
                // with a timeout).
                #[allow(clippy::disallowed_methods)]
                std::thread::sleep(Duration::from_millis(2))
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(io("accept")(e)),
        }
    }
}

/// Connects to `addr`, retrying while the peer is not listening yet.
fn connect_retry(
    addr: &str,
    deadline: Instant,
    rank: usize,
    peer: usize,
) -> Result<TcpStream, GroupError> {
    loop {
        let now = Instant::now();
        if now >= deadline {
            return Err(GroupError::Timeout(
                Duration::ZERO,
                format!("rank {rank} could not connect to rank {peer} at {addr}"),
            ));
        }
        let wait = (deadline - now).min(Duration::from_secs(2));
        let attempt = addr
            .to_socket_addrs()
            .map_err(io(format!("resolve {addr}")))
            .and_then(|mut a| {
                a.next()
                    .ok_or_else(|| GroupError::Config(format!("{addr} resolves to no address")))
            })
            .and_then(|a| {
                TcpStream::connect_timeout(&a, wait).map_err(io(format!("connect to {addr}")))
            });
        match attempt {
            Ok(s) => {
                let wait = (deadline.saturating_duration_since(Instant::now()))
                    .max(Duration::from_millis(1));
                s.set_read_timeout(Some(wait)).map_err(io("read timeout"))?;
                s.set_write_timeout(Some(wait))
                    .map_err(io("write timeout"))?;
                return Ok(s);
            }
            // Not up yet (or DNS not there yet in a fresh pod): try again shortly.
            // A retry with a deadline: the peer's listener cannot signal us before it exists.
            #[allow(clippy::disallowed_methods)]
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

fn write_hello(s: &mut TcpStream, cfg: &GroupConfig, addr: &str) -> Result<(), GroupError> {
    let mut msg = Vec::with_capacity(16 + addr.len());
    msg.extend_from_slice(MAGIC);
    msg.extend_from_slice(&VERSION.to_le_bytes());
    msg.extend_from_slice(&(cfg.rank as u32).to_le_bytes());
    msg.extend_from_slice(&(cfg.world as u32).to_le_bytes());
    put_str(&mut msg, addr);
    s.write_all(&msg).map_err(io("send hello"))
}

fn read_u32(s: &mut TcpStream) -> Result<u32, GroupError> {
    let mut b = [0u8; 4];
    s.read_exact(&mut b).map_err(io("read handshake"))?;
    Ok(u32::from_le_bytes(b))
}

/// Reads a peer's hello: its rank and advertised listen address.
fn read_hello(s: &mut TcpStream, cfg: &GroupConfig) -> Result<(usize, String), GroupError> {
    let mut magic = [0u8; 4];
    s.read_exact(&mut magic).map_err(io("read hello"))?;
    if &magic != MAGIC {
        return Err(GroupError::Protocol(format!(
            "rank {}: a connection that is not a cleave collective peer",
            cfg.rank
        )));
    }
    let version = read_u32(s)?;
    let rank = read_u32(s)? as usize;
    let world = read_u32(s)? as usize;
    if version != VERSION || world != cfg.world || rank >= world {
        return Err(GroupError::Protocol(format!(
            "peer says rank {rank} of {world} (protocol {version}); this is rank {} of {} (protocol {VERSION})",
            cfg.rank, cfg.world
        )));
    }
    Ok((rank, get_str(s)?))
}

fn put_str(msg: &mut Vec<u8>, s: &str) {
    msg.extend_from_slice(&(s.len() as u32).to_le_bytes());
    msg.extend_from_slice(s.as_bytes());
}

fn get_str(s: &mut TcpStream) -> Result<String, GroupError> {
    let len = read_u32(s)? as usize;
    if len > MAX_ADDR {
        return Err(GroupError::Protocol(format!(
            "a {len}-byte address in the handshake"
        )));
    }
    let mut b = vec![0u8; len];
    s.read_exact(&mut b).map_err(io("read handshake"))?;
    String::from_utf8(b).map_err(|_| GroupError::Protocol("address is not UTF-8".into()))
}
