//! Certificates made at test time (feature `testing`): a CA per test, certificates it issues,
//! and cert-manager-layout directories for `--internal-tls-*`.

use std::path::{Path, PathBuf};

use cleave_config::internal_tls::{InternalTls, SECRET_CA, SECRET_CERT, SECRET_KEY};
pub use rcgen::ExtendedKeyUsagePurpose;
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair, KeyUsagePurpose};
use rustls_pki_types::CertificateDer;

/// A CA made for one test.
pub struct TestCa {
    cert: rcgen::Certificate,
    key: KeyPair,
}

/// A certificate and its key, as PEM and DER.
pub struct Issued {
    /// The certificate, PEM.
    pub cert_pem: String,
    /// Its key, PKCS#8 PEM.
    pub key_pem: String,
    /// The certificate, DER.
    pub der: CertificateDer<'static>,
    /// Its key, PKCS#8 DER.
    pub key_der: Vec<u8>,
}

impl TestCa {
    /// A new self-signed CA called `name`.
    pub fn new(name: &str) -> TestCa {
        let mut p = CertificateParams::new(Vec::<String>::new()).expect("CA params");
        p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        p.distinguished_name.push(DnType::CommonName, name);
        p.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let key = KeyPair::generate().expect("CA key");
        let cert = p.self_signed(&key).expect("CA certificate");
        TestCa { cert, key }
    }

    /// The CA certificate, DER.
    pub fn der(&self) -> CertificateDer<'static> {
        self.cert.der().clone()
    }

    /// The CA certificate, PEM.
    pub fn pem(&self) -> String {
        self.cert.pem()
    }

    /// A certificate for `names` (DNS names or IPs) good for `usages`.
    pub fn issue(&self, names: &[&str], usages: &[ExtendedKeyUsagePurpose]) -> Issued {
        let names: Vec<String> = names.iter().map(|s| s.to_string()).collect();
        let mut p = CertificateParams::new(names).expect("certificate params");
        p.distinguished_name.push(DnType::CommonName, "cleave test");
        p.extended_key_usages = usages.to_vec();
        let key = KeyPair::generate().expect("key");
        let cert = p
            .signed_by(&key, &self.cert, &self.key)
            .expect("certificate");
        Issued {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
            der: cert.der().clone(),
            key_der: key.serialize_der(),
        }
    }

    /// Writes a cert-manager-layout Secret into `dir` (created): a certificate for
    /// 127.0.0.1, `localhost` and `cleave-internal`, good as server and client, and this CA.
    pub fn write_secret(&self, dir: &Path) -> InternalTls {
        std::fs::create_dir_all(dir).expect("creating the secret directory");
        let id = self.issue(
            &["127.0.0.1", "localhost", "cleave-internal"],
            &[
                ExtendedKeyUsagePurpose::ServerAuth,
                ExtendedKeyUsagePurpose::ClientAuth,
            ],
        );
        let write = |name: &str, text: &str| -> PathBuf {
            let p = dir.join(name);
            std::fs::write(&p, text).expect("writing the secret");
            p
        };
        InternalTls {
            cert: write(SECRET_CERT, &id.cert_pem),
            key: write(SECRET_KEY, &id.key_pem),
            ca: write(SECRET_CA, &self.pem()),
            server_name: None,
        }
    }
}
