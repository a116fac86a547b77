//! The mutual-TLS identity of the internal traffic (`--internal-tls-*`).

use std::net::IpAddr;
use std::sync::Arc;

use cleave_config::internal_tls::{InternalTls, InternalTlsArgs};
use rustls::client::WebPkiServerVerifier;
use rustls::{ClientConfig, ServerConfig};
use rustls_pki_types::ServerName;

use crate::{pem, provider, server_config, TlsError};

/// A process's identity for its peers, loaded once at start-up: its certificate and key, and the
/// CA every peer's certificate must chain to, whichever side of a connection it is on.
#[derive(Clone, Debug)]
pub struct Mutual {
    files: InternalTls,
    server: Arc<ServerConfig>,
    client: Arc<ClientConfig>,
    server_name: Option<ServerName<'static>>,
    #[cfg_attr(not(feature = "grpc"), allow(dead_code))]
    pem: Pem,
}

/// The files' contents, for tonic (which builds its own rustls configs from PEM).
#[derive(Clone, Debug, PartialEq, Eq)]
struct Pem {
    cert: Vec<u8>,
    key: Vec<u8>,
    ca: Vec<u8>,
}

/// The same files with the same contents.
impl PartialEq for Mutual {
    fn eq(&self, other: &Mutual) -> bool {
        self.files == other.files && self.pem == other.pem
    }
}

impl Mutual {
    /// Reads and checks the files; an error names the file and what is wrong with it.
    pub fn load(files: &InternalTls) -> Result<Mutual, TlsError> {
        let pem = Pem {
            cert: pem::read(&files.cert)?,
            key: pem::read(&files.key)?,
            ca: pem::read(&files.ca)?,
        };
        let chain = pem::certs(&files.cert, &pem.cert)?;
        let key = pem::private_key(&files.key, &pem.key)?;
        let server = server_config(
            (&files.cert, chain.clone()),
            (&files.key, key.clone_key()),
            Some((&files.ca, &pem.ca)),
            &[],
        )?;
        let roots = Arc::new(pem::roots(&files.ca, &pem.ca)?);
        let identity = |source| TlsError::Identity {
            cert: files.cert.clone(),
            key: files.key.clone(),
            source,
        };
        let verifier = WebPkiServerVerifier::builder_with_provider(roots, provider())
            .build()
            .map_err(|e| TlsError::Pem {
                path: files.ca.clone(),
                what: format!("not a usable CA: {e}"),
            })?;
        let client = ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(identity)?
            .dangerous() // Not dangerous: the standard WebPKI verifier over our CA only.
            .with_custom_certificate_verifier(verifier)
            .with_client_auth_cert(chain, key)
            .map_err(identity)?;
        let server_name = files
            .server_name
            .as_ref()
            .map(|name| {
                ServerName::try_from(name.clone())
                    .map_err(|_| TlsError::ServerName { name: name.clone() })
            })
            .transpose()?;
        Ok(Mutual {
            files: files.clone(),
            server: Arc::new(server),
            client: Arc::new(client),
            server_name,
            pem,
        })
    }

    /// The identity the `--internal-tls-*` flags name, `None` when they name none (plain).
    pub fn from_args(args: &InternalTlsArgs) -> Result<Option<Mutual>, TlsError> {
        args.files()?.map(|files| Mutual::load(&files)).transpose()
    }

    /// The files it was loaded from.
    pub fn files(&self) -> &InternalTls {
        &self.files
    }

    /// The config for accepting peers (their certificate required).
    pub fn server(&self) -> Arc<ServerConfig> {
        self.server.clone()
    }

    /// The config for connecting to peers (presenting this process's certificate).
    pub fn client(&self) -> Arc<ClientConfig> {
        self.client.clone()
    }

    /// The name a peer dialled at `ip` must prove: `--internal-tls-server-name`, else the IP.
    pub fn server_name(&self, ip: IpAddr) -> ServerName<'static> {
        self.server_name.clone().unwrap_or(ServerName::from(ip))
    }
}

#[cfg(feature = "grpc")]
mod grpc {
    use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity, ServerTlsConfig};

    use super::Mutual;

    impl Mutual {
        /// tonic's server settings: this identity, client certificates from the CA required.
        pub fn grpc_server(&self) -> ServerTlsConfig {
            ServerTlsConfig::new()
                .identity(Identity::from_pem(&self.pem.cert, &self.pem.key))
                .client_ca_root(Certificate::from_pem(&self.pem.ca))
        }

        /// tonic's channel settings: trust the CA only, present this identity.
        pub fn grpc_client(&self) -> ClientTlsConfig {
            let tls = ClientTlsConfig::new()
                .ca_certificate(Certificate::from_pem(&self.pem.ca))
                .identity(Identity::from_pem(&self.pem.cert, &self.pem.key));
            match &self.files.server_name {
                Some(name) => tls.domain_name(name.clone()),
                None => tls,
            }
        }
    }

    /// An endpoint no channel can be made to (not a URI, or TLS settings it cannot take).
    #[derive(Debug, thiserror::Error)]
    #[error("endpoint {endpoint:?}: {source}")]
    pub struct BadEndpoint {
        /// The endpoint as configured, discovered or sent.
        pub endpoint: String,
        /// Why no channel could be made.
        #[source]
        pub source: tonic::transport::Error,
    }

    /// A channel to `url` that connects on first use (and reconnects by itself), giving up a
    /// connection attempt after `connect_timeout`: the one way the router and the workers make
    /// their channels to one another.
    pub fn lazy_channel(
        url: &str,
        tls: Option<&Mutual>,
        connect_timeout: std::time::Duration,
    ) -> Result<tonic::transport::Channel, BadEndpoint> {
        let bad = |source| BadEndpoint {
            endpoint: url.to_string(),
            source,
        };
        Ok(endpoint(url, tls)
            .map_err(bad)?
            .connect_timeout(connect_timeout)
            .tcp_nodelay(true)
            .connect_lazy())
    }

    /// A channel endpoint for `url` (`http://host:port`, as workers advertise themselves):
    /// plain, or over mutual TLS (`https://`) with `tls`.
    pub fn endpoint(url: &str, tls: Option<&Mutual>) -> Result<Endpoint, tonic::transport::Error> {
        match tls {
            None => Endpoint::from_shared(url.to_string()),
            Some(tls) => {
                let rest = url.strip_prefix("http://").unwrap_or(url);
                let url = if rest.contains("://") {
                    rest.to_string()
                } else {
                    format!("https://{rest}")
                };
                Endpoint::from_shared(url)?.tls_config(tls.grpc_client())
            }
        }
    }
}

#[cfg(feature = "grpc")]
pub use grpc::{endpoint as grpc_endpoint, lazy_channel, BadEndpoint};
