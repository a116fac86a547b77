//! `cleave-tls`: TLS material for cleave's processes, built with rustls (`ring` provider).
//!
//! - [`pem`]: certificates, keys and CA roots read from PEM, with errors that name the file;
//! - [`endpoint_config`]: the OpenAI endpoint's server config (optional client certificates);
//! - [`Mutual`]: the mutual-TLS identity of the internal traffic (`--internal-tls-*`): rustls
//!   configs for the KV transport's TCP path and, with the `grpc` feature, tonic's settings for
//!   the gRPC server and channels.

#![forbid(unsafe_code)]

mod error;
mod mutual;
pub mod pem;
#[cfg(feature = "testing")]
pub mod testing;

pub use error::TlsError;
pub use mutual::Mutual;
#[cfg(feature = "grpc")]
pub use mutual::{grpc_endpoint, lazy_channel, BadEndpoint};

use std::path::Path;
use std::sync::Arc;

use rustls::server::WebPkiClientVerifier;
use rustls::ServerConfig;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

/// The provider every config is built with (explicit, so the process-wide default does not
/// matter).
pub fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// A server config presenting `chain`/`key` (read from `cert`/`key_path`, named in errors),
/// requiring client certificates that chain to `client_ca` when given, offering `alpn`.
pub fn server_config(
    (cert, chain): (&Path, Vec<CertificateDer<'static>>),
    (key_path, key): (&Path, PrivateKeyDer<'static>),
    client_ca: Option<(&Path, &[u8])>,
    alpn: &[&[u8]],
) -> Result<ServerConfig, TlsError> {
    let identity = |source| TlsError::Identity {
        cert: cert.to_path_buf(),
        key: key_path.to_path_buf(),
        source,
    };
    let provider = provider();
    let builder = ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(identity)?;
    let builder = match client_ca {
        Some((path, pem)) => {
            let roots = pem::roots(path, pem)?;
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                .build()
                .map_err(|source| TlsError::ClientCa {
                    path: path.to_path_buf(),
                    source,
                })?;
            builder.with_client_cert_verifier(verifier)
        }
        None => builder.with_no_client_auth(),
    };
    let mut config = builder.with_single_cert(chain, key).map_err(identity)?;
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Ok(config)
}

/// The OpenAI endpoint's server config from the PEM contents of its files: HTTP/2 and
/// HTTP/1.1 by ALPN, client certificates required when a client CA is given.
pub fn endpoint_config(
    files: &cleave_config::router::TlsFiles,
    cert_pem: &[u8],
    key_pem: &[u8],
    client_ca_pem: Option<&[u8]>,
) -> Result<ServerConfig, TlsError> {
    let chain = pem::certs(&files.cert, cert_pem)?;
    let key = pem::private_key(&files.key, key_pem)?;
    let ca = files.client_ca.as_deref().zip(client_ca_pem);
    server_config(
        (&files.cert, chain),
        (&files.key, key),
        ca,
        &[b"h2", b"http/1.1"],
    )
}
