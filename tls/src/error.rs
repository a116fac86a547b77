use std::io;
use std::path::PathBuf;

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
    /// Only part of the `--internal-tls-*` files were given.
    #[error(transparent)]
    Partial(#[from] cleave_config::internal_tls::PartialInternalTls),
    /// `--internal-tls-server-name` is not a DNS name or IP address.
    #[error("--internal-tls-server-name {name:?} is not a DNS name or IP address")]
    ServerName {
        /// The name given.
        name: String,
    },
}
