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
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use rustls::ServerConfig;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;

/// Longest time a client may take to finish the TLS handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

pub use cleave_config::router::TlsFiles;

pub use cleave_tls::TlsError;

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
    Ok([
        Some(cleave_tls::pem::read(&files.cert)?),
        Some(cleave_tls::pem::read(&files.key)?),
        files
            .client_ca
            .as_deref()
            .map(cleave_tls::pem::read)
            .transpose()?,
    ])
}

fn server_config(files: &TlsFiles, contents: &Contents) -> Result<Arc<ServerConfig>, TlsError> {
    let [Some(cert_pem), Some(key_pem), ca_pem] = contents else {
        unreachable!("read_all always reads the certificate and the key");
    };
    cleave_tls::endpoint_config(files, cert_pem, key_pem, ca_pem.as_deref()).map(Arc::new)
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
