//! Mutual TLS between cleave's own processes (`--internal-tls-*`): the gRPC between the router
//! and the workers and between decode and prefill workers, and the KV transport's TCP path
//! (the UCX backend's control channel, and the TCP backend's data). One flag set per binary;
//! every process presents its certificate and requires the peer's, both issued by the CA.
//!
//! The files are cert-manager's Secret layout (`tls.crt`, `tls.key`, `ca.crt`), so the operator
//! mounts the Secret and points the flags at it ([`SECRET_CERT`], [`SECRET_KEY`], [`SECRET_CA`]).

use std::path::{Path, PathBuf};

use clap::Args;

/// The `--internal-tls-*` flags.
#[derive(Args, Clone, Debug, Default, PartialEq, Eq)]
pub struct InternalTlsArgs {
    /// Speak mutual TLS to cleave's other processes (gRPC and the KV transport's TCP path) with
    /// this PEM certificate chain; needs `--internal-tls-key` and `--internal-tls-ca`. Peers
    /// without a certificate from the CA are refused.
    #[arg(long, env = "CLEAVE_INTERNAL_TLS_CERT")]
    pub internal_tls_cert: Option<PathBuf>,
    /// The PEM private key of `--internal-tls-cert`.
    #[arg(long, env = "CLEAVE_INTERNAL_TLS_KEY")]
    pub internal_tls_key: Option<PathBuf>,
    /// The PEM CA certificates peers' certificates must chain to.
    #[arg(long, env = "CLEAVE_INTERNAL_TLS_CA")]
    pub internal_tls_ca: Option<PathBuf>,
    /// The name every peer's certificate is checked against (one certificate shared by a
    /// pool); by default the host or IP dialled, which the certificate must then carry.
    #[arg(long, env = "CLEAVE_INTERNAL_TLS_SERVER_NAME")]
    pub internal_tls_server_name: Option<String>,
}

/// The files of an internal TLS identity, all present.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InternalTls {
    /// The certificate chain, leaf first (`tls.crt`).
    pub cert: PathBuf,
    /// Its private key (`tls.key`).
    pub key: PathBuf,
    /// The CA peers' certificates must chain to (`ca.crt`).
    pub ca: PathBuf,
    /// The name peers' certificates are checked against; `None`: the address dialled.
    pub server_name: Option<String>,
}

/// Why the `--internal-tls-*` flags do not make an identity.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("mutual TLS needs --internal-tls-cert, --internal-tls-key and --internal-tls-ca; {missing} is missing")]
pub struct PartialInternalTls {
    /// The first flag not given.
    pub missing: &'static str,
}

impl InternalTlsArgs {
    /// The identity, `None` when no `--internal-tls-*` file flag is given (plain gRPC and TCP).
    pub fn files(&self) -> Result<Option<InternalTls>, PartialInternalTls> {
        let (cert, key, ca) = (
            &self.internal_tls_cert,
            &self.internal_tls_key,
            &self.internal_tls_ca,
        );
        if cert.is_none() && key.is_none() && ca.is_none() {
            return Ok(None);
        }
        let need = |v: &Option<PathBuf>, missing| v.clone().ok_or(PartialInternalTls { missing });
        Ok(Some(InternalTls {
            cert: need(cert, "--internal-tls-cert")?,
            key: need(key, "--internal-tls-key")?,
            ca: need(ca, "--internal-tls-ca")?,
            server_name: self.internal_tls_server_name.clone(),
        }))
    }

    /// The flags for a mounted cert-manager Secret at `dir`.
    pub fn in_dir(dir: &Path, server_name: Option<String>) -> InternalTlsArgs {
        InternalTlsArgs {
            internal_tls_cert: Some(dir.join(SECRET_CERT)),
            internal_tls_key: Some(dir.join(SECRET_KEY)),
            internal_tls_ca: Some(dir.join(SECRET_CA)),
            internal_tls_server_name: server_name,
        }
    }

    /// The same settings as flags (how `cleave up` passes them to its processes).
    pub fn flags(&self) -> Vec<String> {
        let path = |p: &Option<PathBuf>| p.as_ref().map(|p| p.display().to_string());
        [
            ("--internal-tls-cert", path(&self.internal_tls_cert)),
            ("--internal-tls-key", path(&self.internal_tls_key)),
            ("--internal-tls-ca", path(&self.internal_tls_ca)),
            (
                "--internal-tls-server-name",
                self.internal_tls_server_name.clone(),
            ),
        ]
        .into_iter()
        .filter_map(|(flag, v)| Some([flag.to_string(), v?]))
        .flatten()
        .collect()
    }
}

/// The certificate's key in a cert-manager (`kubernetes.io/tls`) Secret.
pub const SECRET_CERT: &str = "tls.crt";
/// The private key's key in the Secret.
pub const SECRET_KEY: &str = "tls.key";
/// The CA's key in the Secret.
pub const SECRET_CA: &str = "ca.crt";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_three_files_or_none() {
        assert_eq!(InternalTlsArgs::default().files(), Ok(None));
        let dir = InternalTlsArgs::in_dir(Path::new("/tls"), Some("cleave".into()));
        let files = dir.files().unwrap().unwrap();
        assert_eq!(files.ca, Path::new("/tls/ca.crt"));
        assert_eq!(files.server_name.as_deref(), Some("cleave"));
        let no_ca = InternalTlsArgs {
            internal_tls_ca: None,
            ..dir.clone()
        };
        let err = no_ca.files().unwrap_err();
        assert_eq!(err.missing, "--internal-tls-ca");
        assert!(
            err.to_string().contains("--internal-tls-ca is missing"),
            "{err}"
        );
        assert_eq!(dir.flags().len(), 2 * 4);
        assert_eq!(dir.flags()[..2], ["--internal-tls-cert", "/tls/tls.crt"]);
    }
}
