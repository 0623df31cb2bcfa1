//! A minimal HTTP/1.1 client for the coordinator's HTTP side (health,
//! readiness, `/api/status`, `/metrics`), with TLS and a token when the
//! cluster runs with them.

use std::io::{Read, Write};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use tokio_rustls::rustls;

/// A plain HTTP/1.1 GET; `None` when the server does not answer within a
/// second. Returns the status code and body.
pub fn http_get(addr: &str, path: &str) -> Option<(u16, String)> {
    http_get_within(addr, path, Duration::from_secs(1))
}

/// [`http_get`] waiting up to `timeout` for the answer.
pub fn http_get_within(addr: &str, path: &str, timeout: Duration) -> Option<(u16, String)> {
    http_request(addr, path, None, None, timeout)
}

/// An HTTP/1.1 GET to `url` (`http://host:port`, `https://host:port` or
/// `host:port`), with an `Authorization` header when given and, for https,
/// trusting the CA in `ca` (PEM file). `None` when the connection, the TLS
/// handshake or the answer fails within `timeout`.
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
    let sock: std::net::SocketAddr = addr.trim().parse().ok()?;
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

/// The value of one series (`name{labels}`, whole) in Prometheus text, as
/// `/metrics` serves it.
pub fn metric(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
}
