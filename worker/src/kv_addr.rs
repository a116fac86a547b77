//! The KV transport's listen address and the IP it advertises to peers. A worker listening on
//! loopback or one interface advertises that IP; one listening on every interface (a pod)
//! advertises `--kv-advertise`, else the host of `--advertise-addr`, else the address of its
//! default route's interface.

use std::net::{IpAddr, SocketAddr, UdpSocket};

use cleave_kv_transfer::TransportConfig;

use crate::config::WorkerConfig;
use crate::WorkerError;

/// The transport settings `config` asks for.
pub fn transport_config(config: &WorkerConfig) -> Result<TransportConfig, WorkerError> {
    let listen = config
        .kv_listen
        .unwrap_or_else(|| SocketAddr::new(config.grpc_addr.ip(), 0));
    let advertise = match config.kv_advertise {
        Some(ip) => Some(ip),
        None if listen.ip().is_unspecified() => Some(
            config
                .advertise_addr
                .as_deref()
                .and_then(host_ip)
                .map_or_else(default_route_ip, Ok)
                .map_err(|why| WorkerError::NoAdvertise { listen, why })?,
        ),
        None => None,
    };
    Ok(TransportConfig {
        backend: config.transport,
        listen,
        advertise,
        ..Default::default()
    })
}

/// The IP in `host` or `host:port` (`[v6]:port` too), when it is one.
fn host_ip(a: &str) -> Option<IpAddr> {
    let a = a.trim();
    a.parse::<IpAddr>()
        .ok()
        .or_else(|| a.parse::<SocketAddr>().ok().map(|s| s.ip()))
}

/// The local address the kernel picks to reach a public address (no packet is sent).
fn default_route_ip() -> std::io::Result<IpAddr> {
    let s = UdpSocket::bind("0.0.0.0:0")?;
    s.connect("192.0.2.1:9")?;
    let ip = s.local_addr()?.ip();
    if ip.is_unspecified() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::AddrNotAvailable,
            "no address on the default route",
        ));
    }
    Ok(ip)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        config: WorkerConfig,
    }

    fn config(args: &[&str]) -> WorkerConfig {
        Cli::try_parse_from([&["w", "--model", "m.gguf"], args].concat())
            .unwrap()
            .config
    }

    #[test]
    fn listen_follows_grpc_and_advertise_is_resolved() {
        let t = transport_config(&config(&["--grpc-addr", "10.1.2.3:5000"])).unwrap();
        assert_eq!(t.listen, "10.1.2.3:0".parse().unwrap());
        assert_eq!(t.advertise, None);
        let t = transport_config(&config(&[
            "--grpc-addr",
            "0.0.0.0:5000",
            "--advertise-addr",
            "10.9.8.7:5000",
        ]))
        .unwrap();
        assert_eq!(t.advertise, Some("10.9.8.7".parse().unwrap()));
        let t = transport_config(&config(&[
            "--kv-listen",
            "0.0.0.0:7000",
            "--kv-advertise",
            "10.0.0.5",
            "--advertise-addr",
            "10.9.8.7",
        ]))
        .unwrap();
        assert_eq!(t.listen.port(), 7000);
        assert_eq!(t.advertise, Some("10.0.0.5".parse().unwrap()));
        assert_eq!(host_ip("[::1]:80"), Some("::1".parse().unwrap()));
        assert_eq!(host_ip("worker-0.svc"), None);
    }
}
