//! The coordinator's side of authentication and TLS.
//!
//! - Tokens: when configured, every job-API call needs the client token and
//!   every worker-API call the worker token (`authorization: Bearer …`);
//!   every HTTP route but `/healthz` needs the client token, as a bearer
//!   token or as the password of HTTP basic auth (so a browser can open the
//!   status page). A refused call is logged with the peer's address and the
//!   reason, never with what it presented.
//! - TLS: one certificate and key serve gRPC and HTTP. With a client CA,
//!   worker-API calls also need a client certificate signed by it
//!   (clients of the job API may connect without one).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use stoke_core::security::{SecurityError, Token, read_pem};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls;
use tokio_rustls::server::TlsStream;
use tonic::service::Interceptor;
use tonic::transport::{Certificate, Identity, ServerTlsConfig};
use tracing::{debug, warn};

/// How long a TLS handshake may take before the connection is dropped.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Tokens and TLS for one coordinator. `Default` is neither: open, plain
/// text (for loopback, tests and a laptop).
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct ServerSecurity {
    pub client_token: Option<Token>,
    pub worker_token: Option<Token>,
    pub tls: Option<ServerTls>,
}

/// Certificate, key and optional client CA, as PEM.
#[derive(Clone, serde::Serialize)]
pub struct ServerTls {
    pub cert_path: PathBuf,
    pub key_path: PathBuf,
    pub client_ca_path: Option<PathBuf>,
    #[serde(skip)]
    cert_pem: Vec<u8>,
    #[serde(skip)]
    key_pem: Vec<u8>,
    #[serde(skip)]
    client_ca_pem: Option<Vec<u8>>,
}

impl std::fmt::Debug for ServerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerTls")
            .field("cert_path", &self.cert_path)
            .field("key_path", &self.key_path)
            .field("client_ca_path", &self.client_ca_path)
            .finish_non_exhaustive()
    }
}

impl ServerTls {
    /// Reads the PEM files and checks that they make a working TLS
    /// configuration (the key matches the certificate, the CA parses).
    pub fn load(
        cert_path: PathBuf,
        key_path: PathBuf,
        client_ca_path: Option<PathBuf>,
    ) -> Result<Self, SecurityError> {
        let tls = Self {
            cert_pem: read_pem(&cert_path, "--tls-cert")?,
            key_pem: read_pem(&key_path, "--tls-key")?,
            client_ca_pem: client_ca_path
                .as_deref()
                .map(|p| read_pem(p, "--tls-client-ca"))
                .transpose()?,
            cert_path,
            key_path,
            client_ca_path,
        };
        tls.rustls_config(Vec::new())?;
        Ok(tls)
    }

    /// Whether worker calls need a client certificate.
    pub fn requires_worker_certs(&self) -> bool {
        self.client_ca_pem.is_some()
    }

    /// tonic's settings for the gRPC server: the same certificate, and the
    /// client CA as optional client authentication (the worker
    /// interceptor then insists on a certificate for worker calls).
    pub fn grpc_config(&self) -> ServerTlsConfig {
        let mut config = ServerTlsConfig::new()
            .identity(Identity::from_pem(&self.cert_pem, &self.key_pem))
            .timeout(HANDSHAKE_TIMEOUT);
        if let Some(ca) = &self.client_ca_pem {
            config = config
                .client_ca_root(Certificate::from_pem(ca))
                .client_auth_optional(true);
        }
        config
    }

    /// A rustls server configuration (used for HTTP; also proves at start-up
    /// that the files make a usable configuration).
    fn rustls_config(&self, alpn: Vec<Vec<u8>>) -> Result<rustls::ServerConfig, SecurityError> {
        use rustls::pki_types::pem::PemObject;
        use rustls::pki_types::{CertificateDer, PrivateKeyDer};
        let bad = |what: &'static str, path: &PathBuf, error: String| SecurityError::PemFile {
            what,
            path: path.clone(),
            error,
        };
        let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&self.cert_pem)
            .collect::<Result<_, _>>()
            .map_err(|e| bad("--tls-cert", &self.cert_path, e.to_string()))?;
        if certs.is_empty() {
            return Err(bad(
                "--tls-cert",
                &self.cert_path,
                "no CERTIFICATE block".into(),
            ));
        }
        let key = PrivateKeyDer::from_pem_slice(&self.key_pem)
            .map_err(|e| bad("--tls-key", &self.key_path, e.to_string()))?;
        let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
        let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| SecurityError::Config(format!("TLS: {e}")))?;
        let builder = match (&self.client_ca_pem, &self.client_ca_path) {
            (Some(ca), Some(path)) => {
                let mut roots = rustls::RootCertStore::empty();
                for cert in CertificateDer::pem_slice_iter(ca) {
                    let cert = cert.map_err(|e| bad("--tls-client-ca", path, e.to_string()))?;
                    roots
                        .add(cert)
                        .map_err(|e| bad("--tls-client-ca", path, e.to_string()))?;
                }
                let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
                    Arc::new(roots),
                    provider,
                )
                .allow_unauthenticated()
                .build()
                .map_err(|e| bad("--tls-client-ca", path, e.to_string()))?;
                builder.with_client_cert_verifier(verifier)
            }
            _ => builder.with_no_client_auth(),
        };
        let mut config = builder.with_single_cert(certs, key).map_err(|e| {
            bad(
                "--tls-key",
                &self.key_path,
                format!("does not make a TLS identity with --tls-cert: {e}"),
            )
        })?;
        config.alpn_protocols = alpn;
        Ok(config)
    }

    /// Accepts TLS connections for the HTTP server: handshakes run
    /// concurrently (a slow client cannot hold up others) and are bounded
    /// by [`HANDSHAKE_TIMEOUT`]; failed handshakes are logged and dropped.
    pub fn http_listener(&self, listener: TcpListener) -> Result<TlsListener, SecurityError> {
        let config = self.rustls_config(vec![b"http/1.1".to_vec()])?;
        let acceptor = TlsAcceptor::from(Arc::new(config));
        let local = listener.local_addr().ok();
        let (tx, rx) = mpsc::channel(64);
        let accept_loop = tokio::spawn(async move {
            loop {
                let (stream, peer) = match listener.accept().await {
                    Ok(accepted) => accepted,
                    Err(e) => {
                        debug!(error = %e, "http accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let (acceptor, tx) = (acceptor.clone(), tx.clone());
                tokio::spawn(async move {
                    match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
                        Ok(Ok(tls)) => {
                            let _ = tx.send((tls, peer)).await;
                        }
                        Ok(Err(e)) => debug!(%peer, error = %e, "http TLS handshake failed"),
                        Err(_) => debug!(%peer, "http TLS handshake timed out"),
                    }
                });
            }
        });
        Ok(TlsListener {
            rx,
            local,
            accept_loop,
        })
    }
}

/// An HTTP listener that yields finished TLS connections.
#[derive(Debug)]
pub struct TlsListener {
    rx: mpsc::Receiver<(TlsStream<TcpStream>, SocketAddr)>,
    local: Option<SocketAddr>,
    accept_loop: tokio::task::JoinHandle<()>,
}

impl Drop for TlsListener {
    fn drop(&mut self) {
        self.accept_loop.abort();
    }
}

impl axum::serve::Listener for TlsListener {
    type Io = TlsStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.rx.recv().await {
            Some(conn) => conn,
            // The accept loop never ends on its own; if it did, wait for
            // shutdown rather than spin.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        self.local
            .ok_or_else(|| std::io::Error::other("no local address"))
    }
}

/// The peer's address as the HTTP middleware sees it, on either listener.
#[derive(Debug, Clone, Copy)]
pub struct Peer(pub SocketAddr);

impl axum::extract::connect_info::Connected<axum::serve::IncomingStream<'_, TcpListener>> for Peer {
    fn connect_info(stream: axum::serve::IncomingStream<'_, TcpListener>) -> Self {
        Self(*stream.remote_addr())
    }
}

impl axum::extract::connect_info::Connected<axum::serve::IncomingStream<'_, TlsListener>> for Peer {
    fn connect_info(stream: axum::serve::IncomingStream<'_, TlsListener>) -> Self {
        Self(*stream.remote_addr())
    }
}

impl ServerSecurity {
    /// Checks the combination: tokens come in pairs (a coordinator that
    /// checks only one side would leave the other open).
    pub fn validate(&self) -> Result<(), SecurityError> {
        match (&self.client_token, &self.worker_token) {
            (Some(_), None) => Err(SecurityError::Config(
                "a client token is set but no worker token: set STOKE_WORKER_TOKEN (or STOKE_WORKER_TOKEN_FILE) too, or neither".into(),
            )),
            (None, Some(_)) => Err(SecurityError::Config(
                "a worker token is set but no client token: set STOKE_CLIENT_TOKEN (or STOKE_CLIENT_TOKEN_FILE) too, or neither".into(),
            )),
            (Some(c), Some(w)) if w.same_as(c) => Err(SecurityError::Config(
                "the client and worker tokens are the same; use two different tokens so a leaked client token cannot commit checkpoints".into(),
            )),
            _ => Ok(()),
        }
    }

    /// The job API's interceptor.
    pub fn job_auth(&self) -> GrpcAuth {
        GrpcAuth {
            api: "job",
            token: self.client_token.clone(),
            hint: "set STOKE_CLIENT_TOKEN or STOKE_CLIENT_TOKEN_FILE",
            require_client_cert: false,
        }
    }

    /// The worker API's interceptor.
    pub fn worker_auth(&self) -> GrpcAuth {
        GrpcAuth {
            api: "worker",
            token: self.worker_token.clone(),
            hint: "set STOKE_WORKER_TOKEN or STOKE_WORKER_TOKEN_FILE",
            require_client_cert: self
                .tls
                .as_ref()
                .is_some_and(ServerTls::requires_worker_certs),
        }
    }
}

/// Checks the token (and, for workers, the client certificate) of every
/// gRPC call of one API.
#[derive(Debug, Clone)]
pub struct GrpcAuth {
    api: &'static str,
    token: Option<Token>,
    hint: &'static str,
    require_client_cert: bool,
}

/// Why a call was refused, for the log (never what it presented).
fn bearer_problem(value: Option<&[u8]>, token: &Token) -> Option<&'static str> {
    let Some(value) = value else {
        return Some("no token");
    };
    match value.strip_prefix(b"Bearer ") {
        None => Some("authorization is not a bearer token"),
        Some(presented) if token.matches(presented) => None,
        Some(_) => Some("wrong token"),
    }
}

impl Interceptor for GrpcAuth {
    fn call(&mut self, req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        if self.require_client_cert && req.peer_certs().is_none_or(|c| c.is_empty()) {
            warn!(api = self.api, peer = ?req.remote_addr(), reason = "no client certificate", "refused a call");
            return Err(tonic::Status::unauthenticated(format!(
                "the {} API needs a client certificate signed by the coordinator's client CA (set STOKE_WORKER_TLS_CERT and STOKE_WORKER_TLS_KEY)",
                self.api
            )));
        }
        let Some(token) = &self.token else {
            return Ok(req);
        };
        let value = req.metadata().get("authorization").map(|v| v.as_bytes());
        match bearer_problem(value, token) {
            None => Ok(req),
            Some(reason) => {
                warn!(api = self.api, peer = ?req.remote_addr(), reason, "refused a call");
                Err(tonic::Status::unauthenticated(format!(
                    "missing or wrong token for the coordinator's {} API; {}",
                    self.api, self.hint
                )))
            }
        }
    }
}

/// HTTP middleware: the client token as `Bearer`, or as the password of
/// basic auth (any user name), on every route it wraps.
pub async fn http_auth(State(token): State<Option<Token>>, req: Request, next: Next) -> Response {
    let Some(token) = token else {
        return next.run(req).await;
    };
    match http_problem(req.headers(), &token) {
        None => next.run(req).await,
        Some(reason) => {
            let peer = req
                .extensions()
                .get::<axum::extract::ConnectInfo<Peer>>()
                .map(|c| c.0.0);
            warn!(api = "http", path = %req.uri().path(), ?peer, reason, "refused a request");
            let mut response = (
                StatusCode::UNAUTHORIZED,
                "401 unauthorized: send the client token (Authorization: Bearer <token>, or as the basic-auth password)\n",
            )
                .into_response();
            response.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static("Basic realm=\"stoke\", charset=\"UTF-8\""),
            );
            response
        }
    }
}

/// Why a request does not carry the client token, if it does not.
pub(crate) fn http_problem(headers: &HeaderMap, token: &Token) -> Option<&'static str> {
    let value = headers.get(header::AUTHORIZATION).map(|v| v.as_bytes());
    let Some(value) = value else {
        return Some("no token");
    };
    if let Some(basic) = value.strip_prefix(b"Basic ") {
        let Ok(decoded) = base64::engine::general_purpose::STANDARD.decode(basic) else {
            return Some("malformed basic auth");
        };
        let password = match decoded.iter().position(|&b| b == b':') {
            Some(colon) => &decoded[colon + 1..],
            None => return Some("malformed basic auth"),
        };
        return (!token.matches(password)).then_some("wrong token");
    }
    bearer_problem(Some(value), token)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn token() -> Token {
        Token::new("client-token-0123456789", "test").expect("token")
    }

    #[test]
    fn http_accepts_bearer_and_basic_and_names_the_problem() {
        let t = token();
        let with = |v: &str| {
            let mut h = HeaderMap::new();
            h.insert(header::AUTHORIZATION, v.parse().expect("header"));
            http_problem(&h, &t)
        };
        assert_eq!(http_problem(&HeaderMap::new(), &t), Some("no token"));
        assert_eq!(with("Bearer client-token-0123456789"), None);
        assert_eq!(with("Bearer client-token-0123456780"), Some("wrong token"));
        let basic = base64::engine::general_purpose::STANDARD.encode("me:client-token-0123456789");
        assert_eq!(with(&format!("Basic {basic}")), None);
        let wrong = base64::engine::general_purpose::STANDARD.encode("client-token-0123456789");
        assert_eq!(
            with(&format!("Basic {wrong}")),
            Some("malformed basic auth")
        );
        assert_eq!(with("Token x"), Some("authorization is not a bearer token"));
    }

    #[test]
    fn tokens_come_in_different_pairs() {
        let c = token();
        let w = Token::new("worker-token-0123456789", "test").expect("token");
        let s = |client: Option<&Token>, worker: Option<&Token>| ServerSecurity {
            client_token: client.cloned(),
            worker_token: worker.cloned(),
            tls: None,
        };
        assert!(s(None, None).validate().is_ok());
        assert!(s(Some(&c), Some(&w)).validate().is_ok());
        assert!(s(Some(&c), None).validate().is_err());
        assert!(s(None, Some(&w)).validate().is_err());
        let e = s(Some(&c), Some(&c)).validate().expect_err("same token");
        assert!(e.to_string().contains("the same"), "{e}");
    }
}
