//! TLS on the OpenAI endpoint (`--tls-cert`, `--tls-key`, optionally `--tls-client-ca`):
//! rustls with the `ring` provider, HTTP/1.1 and HTTP/2 chosen by ALPN, and certificate
//! reload without restart.
//!
//! [`TlsReloader`] holds the current [`ServerConfig`]; every new connection takes the config in
//! force when it is accepted, so a reload ([`TlsReloader::reload`], called by the reload task in
//! [`crate::serve`] when the files' contents change or on `SIGHUP`) affects new connections only:
//! established connections, and the streams on them, keep their session to the end. A renewed
//! pair that does not load (say the key was written before the certificate) is logged and the
//! old one stays in force until the files load again.
//!
//! With a client CA, a client must present a certificate issued by it (mutual TLS); the
//! handshake of one without fails before any HTTP is read.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use rustls::server::WebPkiClientVerifier;
use rustls::{RootCertStore, ServerConfig};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;

/// Longest time a client may take to finish the TLS handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

pub use cleave_config::router::TlsFiles;

/// Why a TLS identity could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A file could not be read.
    #[error("reading {}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// A file is not valid PEM of the expected kind.
    #[error("{}: {what}", path.display())]
    Pem {
        /// The file.
        path: PathBuf,
        /// What was expected and what was wrong.
        what: String,
    },
    /// rustls refused the certificate chain and key (e.g. the key does not match).
    #[error("the certificate {} and key {} do not form a usable TLS identity", cert.display(), key.display())]
    Identity {
        /// The certificate file.
        cert: PathBuf,
        /// The key file.
        key: PathBuf,
        /// The cause.
        #[source]
        source: rustls::Error,
    },
    /// The client CA could not be turned into a verifier.
    #[error("client CA {}", path.display())]
    ClientCa {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: rustls::server::VerifierBuilderError,
    },
}

/// The files' bytes as last read: cert, key, client CA.
type Contents = [Option<Vec<u8>>; 3];

/// The endpoint's TLS configuration, reloadable.
#[derive(Debug)]
pub struct TlsReloader {
    files: TlsFiles,
    state: Mutex<State>,
    generation: watch::Sender<u64>,
}

#[derive(Debug)]
struct State {
    config: Arc<ServerConfig>,
    /// What `config` was built from.
    loaded: Contents,
    /// The last contents that failed to load (warned about once).
    refused: Option<Contents>,
}

impl TlsReloader {
    /// Loads the files; an error names the file and what is wrong with it.
    pub fn load(files: TlsFiles) -> Result<Self, TlsError> {
        let contents = read_all(&files)?;
        let config = server_config(&files, &contents)?;
        Ok(TlsReloader {
            files,
            state: Mutex::new(State {
                config,
                loaded: contents,
                refused: None,
            }),
            generation: watch::Sender::new(0),
        })
    }

    /// The files served.
    pub fn files(&self) -> &TlsFiles {
        &self.files
    }

    /// Reads the files again and, when their contents changed and load, serves them to new
    /// connections. `Ok(true)`: a new identity is in force. A changed set that fails is
    /// returned as an error once; the same contents are not retried until they change again.
    pub fn reload(&self) -> Result<bool, TlsError> {
        let contents = read_all(&self.files)?;
        let mut state = self.state.lock().expect("tls state");
        if contents == state.loaded || state.refused.as_ref() == Some(&contents) {
            return Ok(false);
        }
        match server_config(&self.files, &contents) {
            Ok(config) => {
                state.config = config;
                state.loaded = contents;
                state.refused = None;
                drop(state);
                self.generation.send_modify(|g| *g += 1);
                Ok(true)
            }
            Err(e) => {
                state.refused = Some(contents);
                Err(e)
            }
        }
    }

    /// Counts the reloads that took effect (tests and the reload task wait on it).
    pub fn generation(&self) -> watch::Receiver<u64> {
        self.generation.subscribe()
    }

    /// The acceptor for a connection accepted now.
    pub fn acceptor(&self) -> TlsAcceptor {
        TlsAcceptor::from(self.state.lock().expect("tls state").config.clone())
    }
}

fn read_all(files: &TlsFiles) -> Result<Contents, TlsError> {
    let read = |p: &Path| {
        std::fs::read(p).map_err(|source| TlsError::Read {
            path: p.to_path_buf(),
            source,
        })
    };
    Ok([
        Some(read(&files.cert)?),
        Some(read(&files.key)?),
        files.client_ca.as_deref().map(read).transpose()?,
    ])
}

fn certs(path: &Path, pem: &[u8]) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| TlsError::Pem {
            path: path.to_path_buf(),
            what: format!("invalid PEM certificate: {e}"),
        })?;
    if certs.is_empty() {
        return Err(TlsError::Pem {
            path: path.to_path_buf(),
            what: "no `BEGIN CERTIFICATE` block".into(),
        });
    }
    Ok(certs)
}

/// The provider every config is built with (explicit, so the process-wide default does not
/// matter).
fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn server_config(files: &TlsFiles, contents: &Contents) -> Result<Arc<ServerConfig>, TlsError> {
    let [Some(cert_pem), Some(key_pem), ca_pem] = contents else {
        unreachable!("read_all always reads the certificate and the key");
    };
    let chain = certs(&files.cert, cert_pem)?;
    let key = PrivateKeyDer::from_pem_slice(key_pem).map_err(|e| TlsError::Pem {
        path: files.key.clone(),
        what: format!("no usable private key (PKCS#8, PKCS#1 or SEC1 PEM): {e}"),
    })?;
    let provider = provider();
    let builder = ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|source| TlsError::Identity {
            cert: files.cert.clone(),
            key: files.key.clone(),
            source,
        })?;
    let builder = match (&files.client_ca, ca_pem) {
        (Some(path), Some(pem)) => {
            let mut roots = RootCertStore::empty();
            for c in certs(path, pem)? {
                roots.add(c).map_err(|e| TlsError::Pem {
                    path: path.clone(),
                    what: format!("not a usable CA certificate: {e}"),
                })?;
            }
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                .build()
                .map_err(|source| TlsError::ClientCa {
                    path: path.clone(),
                    source,
                })?;
            builder.with_client_cert_verifier(verifier)
        }
        _ => builder.with_no_client_auth(),
    };
    let mut config = builder
        .with_single_cert(chain, key)
        .map_err(|source| TlsError::Identity {
            cert: files.cert.clone(),
            key: files.key.clone(),
            source,
        })?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// Serves `app` over TLS on `listener` until `shutdown`, then lets open connections finish
/// their requests (graceful shutdown of HTTP/1.1 and HTTP/2 alike).
pub async fn serve(
    listener: TcpListener,
    app: axum::Router,
    tls: Arc<TlsReloader>,
    shutdown: CancellationToken,
) -> io::Result<()> {
    let graceful = GracefulShutdown::new();
    let builder = auto::Builder::new(TokioExecutor::new());
    loop {
        let (tcp, peer) = tokio::select! {
            _ = shutdown.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    // E.g. out of file descriptors: back off instead of spinning.
                    tracing::warn!(error = %e, "accepting a connection failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        // Nagle off, as on the plain listener: streamed tokens are small writes.
        let _ = tcp.set_nodelay(true);
        let acceptor = tls.acceptor();
        let service = TowerToHyperService::new(app.clone());
        let builder = builder.clone();
        let watcher = graceful.watcher();
        tokio::spawn(async move {
            let stream = match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                Ok(Ok(s)) => s,
                Ok(Err(e)) => {
                    tracing::debug!(%peer, error = %e, "TLS handshake failed");
                    return;
                }
                Err(_) => {
                    tracing::debug!(%peer, "TLS handshake timed out");
                    return;
                }
            };
            let conn = builder.serve_connection_with_upgrades(TokioIo::new(stream), service);
            if let Err(e) = watcher.watch(conn.into_owned()).await {
                tracing::debug!(%peer, error = %e, "connection ended with an error");
            }
        });
    }
    drop(listener);
    graceful.shutdown().await;
    Ok(())
}
