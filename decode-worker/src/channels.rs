//! gRPC channels to prefill workers, one per endpoint and reused by every request (a channel
//! multiplexes calls over HTTP/2 and reconnects by itself), instead of a connection per request.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use tonic::transport::Channel;

/// More endpoints than this (pods come and go) and the cache starts over.
const MAX_ENDPOINTS: usize = 256;

pub use cleave_tls::BadEndpoint;

/// Prefill workers' channels by endpoint.
#[derive(Default)]
pub struct Channels {
    by_endpoint: Mutex<HashMap<String, Channel>>,
    /// Mutual TLS on every channel (`--internal-tls-*`).
    tls: Option<cleave_tls::Mutual>,
}

impl Channels {
    /// No channels yet; each one made over mutual TLS with `tls`.
    pub fn new(tls: Option<cleave_tls::Mutual>) -> Channels {
        Channels {
            by_endpoint: Mutex::default(),
            tls,
        }
    }

    /// The channel to `endpoint` (`http://host:port`), made on first use; connects lazily.
    pub fn get(&self, endpoint: &str) -> Result<Channel, BadEndpoint> {
        let mut map = self.by_endpoint.lock().expect("channels lock");
        if let Some(c) = map.get(endpoint) {
            return Ok(c.clone());
        }
        let channel =
            cleave_tls::lazy_channel(endpoint, self.tls.as_ref(), Duration::from_secs(5))?;
        if map.len() >= MAX_ENDPOINTS {
            map.clear();
        }
        map.insert(endpoint.to_string(), channel.clone());
        Ok(channel)
    }

    /// Endpoints with a channel.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.by_endpoint.lock().expect("channels lock").len()
    }
}

#[cfg(test)]
mod tests {
    use super::Channels;

    #[tokio::test]
    async fn one_channel_per_endpoint_and_bad_endpoints_are_errors() {
        let c = Channels::default();
        c.get("http://127.0.0.1:1").unwrap();
        c.get("http://127.0.0.1:1").unwrap();
        c.get("http://127.0.0.1:2").unwrap();
        assert_eq!(c.len(), 2);
        let err = c.get("not a uri\n").unwrap_err();
        assert_eq!(err.endpoint, "not a uri\n");
        assert!(err.to_string().starts_with("endpoint "), "{err}");
    }
}
