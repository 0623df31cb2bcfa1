//! Throwaway certificate authorities for the TLS tests (rcgen), and an
//! HTTP client that speaks TLS and sends a token, for the coordinator's
//! HTTP side.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose,
};
use tokio_rustls::rustls;

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

/// An HTTP/1.1 GET to `url` (`http://host:port` or `https://host:port`),
/// with an `Authorization` header when given and, for https, trusting the
/// CA in `ca` (PEM file). `None` when the connection, the TLS handshake or
/// the answer fails within `timeout`.
pub fn http_request(
    url: &str,
    path: &str,
    authorization: Option<&str>,
    ca: Option<&Path>,
    timeout: Duration,
) -> Option<(u16, String)> {
    let (tls, addr) = match url.split_once("://") {
        Some(("https", rest)) => (true, rest),
        Some((_, rest)) => (false, rest),
        None => (false, url),
    };
    let sock: std::net::SocketAddr = addr.parse().ok()?;
    let conn = std::net::TcpStream::connect_timeout(&sock, Duration::from_secs(1)).ok()?;
    conn.set_read_timeout(Some(timeout)).ok()?;
    conn.set_write_timeout(Some(timeout)).ok()?;
    let auth = authorization
        .map(|a| format!("Authorization: {a}\r\n"))
        .unwrap_or_default();
    let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\n{auth}Connection: close\r\n\r\n");
    let mut response = Vec::new();
    if tls {
        let mut roots = rustls::RootCertStore::empty();
        if let Some(ca) = ca {
            use rustls::pki_types::CertificateDer;
            use rustls::pki_types::pem::PemObject;
            for cert in CertificateDer::pem_file_iter(ca).ok()? {
                roots.add(cert.ok()?).ok()?;
            }
        }
        let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
        let config = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .ok()?
            .with_root_certificates(roots)
            .with_no_client_auth();
        let name = rustls::pki_types::ServerName::try_from(sock.ip().to_string()).ok()?;
        let client = rustls::ClientConnection::new(Arc::new(config), name).ok()?;
        let mut stream = rustls::StreamOwned::new(client, conn);
        stream.write_all(request.as_bytes()).ok()?;
        // A server that closes without close_notify still gave a full
        // answer (Connection: close); keep what arrived.
        let _ = stream.read_to_end(&mut response);
    } else {
        let mut conn = conn;
        conn.write_all(request.as_bytes()).ok()?;
        conn.read_to_end(&mut response).ok()?;
    }
    let response = String::from_utf8_lossy(&response).to_string();
    if !response.starts_with("HTTP/1.") {
        return None;
    }
    let code = response.split_whitespace().nth(1)?.parse().ok()?;
    let body = response
        .split_once("\r\n\r\n")
        .map_or(String::new(), |(_, b)| b.to_string());
    Some((code, body))
}
