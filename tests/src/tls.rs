//! Throwaway certificate authorities for the TLS tests (rcgen). The HTTP
//! client that speaks TLS and sends a token is the sandbox's
//! [`http_request`].

use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose,
};

/// A certificate authority whose files live in a folder.
pub struct TestCa {
    issuer: CertifiedIssuer<'static, KeyPair>,
    dir: PathBuf,
    name: String,
    /// The CA certificate (PEM), what clients trust.
    pub cert: PathBuf,
}

impl std::fmt::Debug for TestCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TestCa({})", self.name)
    }
}

/// A certificate and its key, as PEM files.
#[derive(Debug, Clone)]
pub struct CertFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
}

impl TestCa {
    /// A new CA named `name`, its certificate written to `dir/<name>-ca.pem`.
    pub fn new(dir: &Path, name: &str) -> Self {
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("ca params");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(DnType::CommonName, format!("stoke test CA {name}"));
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let key = KeyPair::generate().expect("ca key");
        let issuer = CertifiedIssuer::self_signed(params, key).expect("self-signed CA");
        let cert = dir.join(format!("{name}-ca.pem"));
        std::fs::write(&cert, issuer.pem()).expect("writing the CA");
        Self {
            issuer,
            dir: dir.to_path_buf(),
            name: name.to_string(),
            cert,
        }
    }

    fn issue(&self, file: &str, sans: &[&str], usage: ExtendedKeyUsagePurpose) -> CertFiles {
        let mut params =
            CertificateParams::new(sans.iter().map(|s| s.to_string()).collect::<Vec<_>>())
                .expect("params");
        params.distinguished_name.push(DnType::CommonName, file);
        params.extended_key_usages = vec![usage];
        let key = KeyPair::generate().expect("key");
        let cert = params.signed_by(&key, &self.issuer).expect("signing");
        let files = CertFiles {
            cert: self.dir.join(format!("{}-{file}.pem", self.name)),
            key: self.dir.join(format!("{}-{file}-key.pem", self.name)),
        };
        std::fs::write(&files.cert, cert.pem()).expect("writing a certificate");
        std::fs::write(&files.key, key.serialize_pem()).expect("writing a key");
        files
    }

    /// A server certificate for 127.0.0.1 and localhost.
    pub fn server(&self) -> CertFiles {
        self.issue(
            "server",
            &["127.0.0.1", "localhost"],
            ExtendedKeyUsagePurpose::ServerAuth,
        )
    }

    /// A client certificate (for a worker).
    pub fn client(&self, name: &str) -> CertFiles {
        self.issue(name, &[name], ExtendedKeyUsagePurpose::ClientAuth)
    }
}

pub use stoke_sandbox::http_request;
