//! Registering the worker in etcd so that routers find it: one key
//! `<prefix><role>/<random hex>` holding `{"role":"decode","endpoint":"http://host:port"}`,
//! attached to a lease that this worker keeps alive. On shutdown the lease is revoked (the key
//! goes at once); a killed worker stops renewing it and its key expires after the lease TTL.
//! When etcd is restarted or the lease is lost, the worker registers again under a new lease.

use std::hash::{BuildHasher, Hasher};
use std::net::SocketAddr;
use std::time::Duration;

use etcd_client::{Client, PutOptions};
use tokio_util::sync::CancellationToken;

use crate::config::{Role, WorkerConfig};

/// Why registering failed.
#[derive(Debug, thiserror::Error)]
pub enum RegisterError {
    /// etcd could not be reached or refused a request (boxed: etcd's error is large).
    #[error("etcd: {0}")]
    Etcd(#[from] Box<etcd_client::Error>),
    /// `--advertise-addr` or the listen address gives no usable endpoint.
    #[error("invalid advertise address {0:?}")]
    Advertise(String),
}

impl From<etcd_client::Error> for RegisterError {
    fn from(e: etcd_client::Error) -> Self {
        RegisterError::Etcd(Box::new(e))
    }
}

/// The value stored under a worker's key (the router reads the same JSON).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Record {
    /// `decode` or `prefill`.
    pub role: Role,
    /// The gRPC endpoint routers dial (`http://host:port`).
    pub endpoint: String,
}

/// The key of one registration: `<prefix><role>/<id>`.
pub fn key(prefix: &str, role: Role, id: &str) -> String {
    let role = match role {
        Role::Decode => "decode",
        Role::Prefill => "prefill",
    };
    format!("{prefix}{role}/{id}")
}

/// A random 64-bit hex id (from the process's hash seed, the pid and the time).
pub fn random_id() -> String {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(std::process::id());
    if let Ok(t) = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH) {
        h.write_u128(t.as_nanos());
    }
    format!("{:016x}", h.finish())
}

/// The endpoint routers dial: `advertise` (a host, or `host:port`) or else the bound gRPC
/// address, with the bound port when `advertise` names none.
pub fn endpoint(advertise: Option<&str>, grpc_addr: SocketAddr) -> Result<String, RegisterError> {
    let Some(a) = advertise.map(str::trim).filter(|a| !a.is_empty()) else {
        if grpc_addr.ip().is_unspecified() {
            return Err(RegisterError::Advertise(format!(
                "{grpc_addr} (listening on all interfaces: set --advertise-addr)"
            )));
        }
        return Ok(format!("http://{grpc_addr}"));
    };
    let a = a
        .trim_start_matches("http://")
        .trim_end_matches('/')
        .to_string();
    if a.parse::<SocketAddr>().is_ok() {
        return Ok(format!("http://{a}"));
    }
    let has_port = match a.rsplit_once(':') {
        // `[v6]:port` or `name:port`; a bare v6 address has several colons and no brackets.
        Some((host, port)) => {
            port.parse::<u16>().is_ok() && (host.ends_with(']') || !host.contains(':'))
        }
        None => false,
    };
    if has_port {
        return Ok(format!("http://{a}"));
    }
    if a.contains(':') && !a.starts_with('[') {
        return Ok(format!("http://[{a}]:{}", grpc_addr.port()));
    }
    if a.contains('/') {
        return Err(RegisterError::Advertise(a));
    }
    Ok(format!("http://{a}:{}", grpc_addr.port()))
}

/// The etcd settings of a worker, or `None` when `--etcd` is not set.
fn endpoints(config: &WorkerConfig) -> Option<Vec<String>> {
    let list: Vec<String> = config
        .etcd
        .as_deref()?
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(String::from)
        .collect();
    (!list.is_empty()).then_some(list)
}

/// Registers this worker when `--etcd` is set: puts its key under a fresh lease (failing when
/// etcd is unreachable), then keeps it registered until `shutdown`, revoking the lease at the
/// end. The returned task ends after the revocation.
pub async fn start(
    role: Role,
    config: &WorkerConfig,
    grpc_addr: SocketAddr,
    shutdown: CancellationToken,
) -> Result<Option<tokio::task::JoinHandle<()>>, RegisterError> {
    let Some(etcd) = endpoints(config) else {
        return Ok(None);
    };
    let record = Record {
        role,
        endpoint: endpoint(config.advertise_addr.as_deref(), grpc_addr)?,
    };
    let key = key(&config.etcd_prefix, role, &random_id());
    let ttl = config.etcd_lease_ttl.as_secs().max(1) as i64;
    let mut client = Client::connect(&etcd, None).await?;
    let lease = put(&mut client, &key, &record, ttl).await?;
    tracing::info!(%key, endpoint = %record.endpoint, ttl, "registered in etcd");
    Ok(Some(tokio::spawn(keep(
        client, key, record, ttl, lease, shutdown,
    ))))
}

/// Grants a lease and puts the key under it; returns the lease id.
async fn put(
    client: &mut Client,
    key: &str,
    record: &Record,
    ttl: i64,
) -> Result<i64, etcd_client::Error> {
    let lease = client.lease_grant(ttl, None).await?.id();
    let value = serde_json::to_string(record).expect("record serializes");
    client
        .put(key, value, Some(PutOptions::new().with_lease(lease)))
        .await?;
    Ok(lease)
}

/// Renews `lease` every third of the TTL; registers again when renewal fails; revokes the
/// lease on shutdown.
async fn keep(
    mut client: Client,
    key: String,
    record: Record,
    ttl: i64,
    mut lease: i64,
    shutdown: CancellationToken,
) {
    let every = Duration::from_millis((ttl as u64 * 1000 / 3).max(200));
    'register: loop {
        if lease == 0 {
            match put(&mut client, &key, &record, ttl).await {
                Ok(l) => {
                    lease = l;
                    tracing::info!(%key, "registered in etcd again");
                }
                Err(e) => {
                    tracing::warn!(error = %e, "etcd registration failed; retrying");
                    tokio::select! {
                        _ = shutdown.cancelled() => return,
                        _ = tokio::time::sleep(every) => continue 'register,
                    }
                }
            }
        }
        let (mut keeper, mut stream) = match client.lease_keep_alive(lease).await {
            Ok(k) => k,
            Err(e) => {
                tracing::warn!(error = %e, "etcd keep-alive failed");
                lease = 0;
                continue 'register;
            }
        };
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => break 'register,
                _ = tokio::time::sleep(every) => {}
            }
            let alive = match keeper.keep_alive().await {
                Ok(()) => match stream.message().await {
                    Ok(Some(r)) => r.ttl() > 0,
                    _ => false,
                },
                Err(_) => false,
            };
            if !alive {
                tracing::warn!(%key, "etcd lease lost; registering again");
                lease = 0;
                continue 'register;
            }
        }
    }
    if lease != 0 {
        match tokio::time::timeout(Duration::from_secs(2), client.lease_revoke(lease)).await {
            Ok(Ok(_)) => tracing::info!(%key, "etcd lease revoked"),
            Ok(Err(e)) => tracing::warn!(error = %e, "revoking the etcd lease"),
            Err(_) => tracing::warn!("revoking the etcd lease timed out"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_and_value_format() {
        assert_eq!(
            key("/cleave/workers/", Role::Decode, "ab12"),
            "/cleave/workers/decode/ab12"
        );
        assert_eq!(key("/p/", Role::Prefill, "x"), "/p/prefill/x");
        let r = Record {
            role: Role::Decode,
            endpoint: "http://10.0.0.1:50051".into(),
        };
        let json = serde_json::to_string(&r).unwrap();
        assert_eq!(
            json,
            r#"{"role":"decode","endpoint":"http://10.0.0.1:50051"}"#
        );
        assert_eq!(serde_json::from_str::<Record>(&json).unwrap(), r);
        assert_eq!(random_id().len(), 16);
        assert_ne!(random_id(), random_id());
    }

    #[test]
    fn endpoints_from_advertise() {
        let bound: SocketAddr = "127.0.0.1:5000".parse().unwrap();
        let any: SocketAddr = "0.0.0.0:5000".parse().unwrap();
        assert_eq!(endpoint(None, bound).unwrap(), "http://127.0.0.1:5000");
        assert!(endpoint(None, any).is_err());
        assert_eq!(
            endpoint(Some("worker-0.svc"), any).unwrap(),
            "http://worker-0.svc:5000"
        );
        assert_eq!(
            endpoint(Some("worker-0.svc:7000"), any).unwrap(),
            "http://worker-0.svc:7000"
        );
        assert_eq!(endpoint(Some("::1"), any).unwrap(), "http://[::1]:5000");
        assert_eq!(endpoint(Some("[::1]:9"), any).unwrap(), "http://[::1]:9");
        assert_eq!(
            endpoint(Some("http://10.1.2.3"), any).unwrap(),
            "http://10.1.2.3:5000"
        );
    }
}
