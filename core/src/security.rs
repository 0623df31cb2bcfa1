//! Who may talk to a coordinator: bearer tokens and TLS settings, read from
//! the environment (never from a flag, which `ps` would show), and the
//! client side of both: an [`Endpoint`] with TLS when the address is
//! `https://`, and an interceptor that sends the token with every call.
//!
//! Clients and workers have separate tokens, so a leaked client token
//! cannot commit checkpoints:
//!
//! | variable | read by | what |
//! |---|---|---|
//! | `STOKE_CLIENT_TOKEN` or `STOKE_CLIENT_TOKEN_FILE` | coordinator, CLI/SDK | the token for the job API and HTTP |
//! | `STOKE_WORKER_TOKEN` or `STOKE_WORKER_TOKEN_FILE` | coordinator, workers | the token for the worker API |
//! | `STOKE_TLS_CA` | CLI/SDK, workers | CA bundle (PEM) to trust for an `https://` coordinator |
//! | `STOKE_WORKER_TLS_CERT`, `STOKE_WORKER_TLS_KEY` | workers | the worker's client certificate and key (PEM) |
//!
//! A [`Token`] never prints its value: `Debug` and `Serialize` show only
//! that it is set and where from.

use std::path::{Path, PathBuf};
use std::time::Duration;

use thiserror::Error;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::Interceptor;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};

pub const CLIENT_TOKEN_VAR: &str = "STOKE_CLIENT_TOKEN";
pub const CLIENT_TOKEN_FILE_VAR: &str = "STOKE_CLIENT_TOKEN_FILE";
pub const WORKER_TOKEN_VAR: &str = "STOKE_WORKER_TOKEN";
pub const WORKER_TOKEN_FILE_VAR: &str = "STOKE_WORKER_TOKEN_FILE";
pub const TLS_CA_VAR: &str = "STOKE_TLS_CA";
pub const WORKER_TLS_CERT_VAR: &str = "STOKE_WORKER_TLS_CERT";
pub const WORKER_TLS_KEY_VAR: &str = "STOKE_WORKER_TLS_KEY";

/// Every security variable a client, worker or coordinator may see: the
/// binaries' unknown-variable checks accept all of them, so one environment
/// (`stoke run --local`, a shared Kubernetes Secret) serves every process.
pub const SECURITY_ENV_VARS: [&str; 10] = [
    CLIENT_TOKEN_VAR,
    CLIENT_TOKEN_FILE_VAR,
    WORKER_TOKEN_VAR,
    WORKER_TOKEN_FILE_VAR,
    TLS_CA_VAR,
    WORKER_TLS_CERT_VAR,
    WORKER_TLS_KEY_VAR,
    "STOKE_TLS_CERT",
    "STOKE_TLS_KEY",
    "STOKE_TLS_CLIENT_CA",
];

/// The shortest token accepted: a guessable token is no protection.
pub const MIN_TOKEN_LEN: usize = 16;
/// The longest token accepted (it travels in every request's headers).
pub const MAX_TOKEN_LEN: usize = 4096;

#[derive(Debug, Error)]
pub enum SecurityError {
    #[error("{var} and {file_var} are both set; set one")]
    BothSet {
        var: &'static str,
        file_var: &'static str,
    },
    #[error("{source_name}: reading the token file {path}: {error}")]
    TokenFile {
        source_name: String,
        path: PathBuf,
        error: std::io::Error,
    },
    #[error("{source_name}: {reason}")]
    BadToken { source_name: String, reason: String },
    #[error("{what} {path}: {error}")]
    PemFile {
        what: &'static str,
        path: PathBuf,
        error: String,
    },
    #[error("{0}")]
    Config(String),
    #[error("coordinator address {uri:?}: {message}")]
    Address { uri: String, message: String },
}

/// A bearer token. Its value is only reachable through [`Token::matches`]
/// and the request header it makes.
#[derive(Clone)]
pub struct Token {
    value: String,
    /// Where it came from, for messages: `STOKE_CLIENT_TOKEN` or
    /// `STOKE_CLIENT_TOKEN_FILE (/run/secrets/token)`.
    source: String,
}

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Token(<redacted>, from {})", self.source)
    }
}

impl serde::Serialize for Token {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&format!("<set, from {}>", self.source))
    }
}

impl Token {
    /// Checks a token's shape: 16 to 4096 visible ASCII characters (it goes
    /// into an HTTP header, and spaces or control characters there are
    /// almost always a copy-paste accident).
    pub fn new(value: impl Into<String>, source: impl Into<String>) -> Result<Self, SecurityError> {
        let value = value.into();
        let source = source.into();
        let bad = |reason: String| SecurityError::BadToken {
            source_name: source.clone(),
            reason,
        };
        if value.len() < MIN_TOKEN_LEN {
            return Err(bad(format!(
                "the token is {} characters; use at least {MIN_TOKEN_LEN} (for example `openssl rand -hex 32`)",
                value.len()
            )));
        }
        if value.len() > MAX_TOKEN_LEN {
            return Err(bad(format!(
                "the token is {} characters; at most {MAX_TOKEN_LEN}",
                value.len()
            )));
        }
        if let Some(pos) = value.bytes().position(|b| !(0x21..=0x7e).contains(&b)) {
            return Err(bad(format!(
                "the token has a space, control or non-ASCII character at position {pos}; use visible ASCII only"
            )));
        }
        Ok(Self { value, source })
    }

    /// Reads a token from `var`, or from the file named by `file_var`
    /// (surrounding whitespace trimmed, as secret files usually end in a
    /// newline). `None` when neither is set.
    pub fn from_env(
        var: &'static str,
        file_var: &'static str,
    ) -> Result<Option<Self>, SecurityError> {
        let value = std::env::var(var).ok().filter(|v| !v.is_empty());
        let file = std::env::var_os(file_var).filter(|v| !v.is_empty());
        match (value, file) {
            (Some(_), Some(_)) => Err(SecurityError::BothSet { var, file_var }),
            (Some(value), None) => Self::new(value, var).map(Some),
            (None, Some(path)) => Self::from_file(Path::new(&path), file_var).map(Some),
            (None, None) => Ok(None),
        }
    }

    /// Reads a token from a file, trimming surrounding whitespace.
    pub fn from_file(path: &Path, what: &str) -> Result<Self, SecurityError> {
        let source_name = format!("{what} ({})", path.display());
        let text = std::fs::read_to_string(path).map_err(|error| SecurityError::TokenFile {
            source_name: source_name.clone(),
            path: path.to_path_buf(),
            error,
        })?;
        Self::new(text.trim(), source_name)
    }

    /// Whether `presented` is this token, in time that does not depend on
    /// where the two differ.
    pub fn matches(&self, presented: &[u8]) -> bool {
        let ours = self.value.as_bytes();
        if ours.len() != presented.len() {
            return false;
        }
        ours.iter()
            .zip(presented)
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
    }

    /// Whether two tokens hold the same value.
    pub fn same_as(&self, other: &Token) -> bool {
        self.matches(other.value.as_bytes())
    }

    /// Where the token came from (a variable or a file), for messages.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// The `authorization` header value: `Bearer <token>`.
    pub fn bearer(&self) -> Result<MetadataValue<Ascii>, SecurityError> {
        format!("Bearer {}", self.value)
            .parse()
            .map_err(|_| SecurityError::BadToken {
                source_name: self.source.clone(),
                reason: "not a valid header value".into(),
            })
    }
}

/// Reads a PEM file, checking it holds at least one PEM block, so a wrong
/// path or a DER file is named at start-up rather than at the first call.
pub fn read_pem(path: &Path, what: &'static str) -> Result<Vec<u8>, SecurityError> {
    let bytes = std::fs::read(path).map_err(|e| SecurityError::PemFile {
        what,
        path: path.to_path_buf(),
        error: e.to_string(),
    })?;
    if !bytes.windows(11).any(|w| w == b"-----BEGIN ") {
        return Err(SecurityError::PemFile {
            what,
            path: path.to_path_buf(),
            error: "not a PEM file (no -----BEGIN line)".into(),
        });
    }
    Ok(bytes)
}

/// Who is calling: picks which token and client certificate are sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// The CLI and SDK: the job API.
    Client,
    /// A worker: the worker API.
    Worker,
}

/// How a client or worker reaches a coordinator: the token it sends and
/// the TLS it speaks.
#[derive(Debug, Clone, Default)]
pub struct ClientSecurity {
    pub token: Option<Token>,
    /// PEM CA bundle to trust (`STOKE_TLS_CA`); without it an `https://`
    /// coordinator is checked against the system's roots.
    pub ca_pem: Option<Vec<u8>>,
    /// PEM certificate and key the worker presents (mutual TLS).
    pub identity: Option<(Vec<u8>, Vec<u8>)>,
}

impl ClientSecurity {
    /// Reads the settings for `role` from the environment.
    pub fn from_env(role: Role) -> Result<Self, SecurityError> {
        let token = match role {
            Role::Client => Token::from_env(CLIENT_TOKEN_VAR, CLIENT_TOKEN_FILE_VAR)?,
            Role::Worker => Token::from_env(WORKER_TOKEN_VAR, WORKER_TOKEN_FILE_VAR)?,
        };
        let path_var = |var: &str| std::env::var_os(var).filter(|v| !v.is_empty());
        let ca_pem = path_var(TLS_CA_VAR)
            .map(|p| read_pem(Path::new(&p), TLS_CA_VAR))
            .transpose()?;
        let identity = match role {
            Role::Client => None,
            Role::Worker => match (path_var(WORKER_TLS_CERT_VAR), path_var(WORKER_TLS_KEY_VAR)) {
                (Some(cert), Some(key)) => Some((
                    read_pem(Path::new(&cert), WORKER_TLS_CERT_VAR)?,
                    read_pem(Path::new(&key), WORKER_TLS_KEY_VAR)?,
                )),
                (None, None) => None,
                _ => {
                    return Err(SecurityError::Config(format!(
                        "{WORKER_TLS_CERT_VAR} and {WORKER_TLS_KEY_VAR} go together; set both or neither"
                    )));
                }
            },
        };
        Ok(Self {
            token,
            ca_pem,
            identity,
        })
    }

    /// An endpoint for `uri` (`http://host:port` or `https://host:port`),
    /// with TLS for `https://`. A CA or client certificate with an
    /// `http://` address is refused: it would silently go unused.
    pub fn endpoint(&self, uri: &str) -> Result<Endpoint, SecurityError> {
        let address = |message: String| SecurityError::Address {
            uri: uri.to_string(),
            message,
        };
        let endpoint =
            Endpoint::from_shared(uri.to_string()).map_err(|e| address(e.to_string()))?;
        let https = uri.starts_with("https://");
        if !https {
            if self.ca_pem.is_some() || self.identity.is_some() {
                return Err(address(format!(
                    "TLS is configured ({TLS_CA_VAR} or a client certificate) but the address is not https://"
                )));
            }
            return Ok(endpoint);
        }
        let mut tls = ClientTlsConfig::new();
        tls = match &self.ca_pem {
            Some(pem) => tls.ca_certificate(Certificate::from_pem(pem)),
            None => tls.with_native_roots(),
        };
        if let Some((cert, key)) = &self.identity {
            tls = tls.identity(Identity::from_pem(cert, key));
        }
        endpoint
            .tls_config(tls.timeout(Duration::from_secs(10)))
            .map_err(|e| address(format!("TLS settings: {e}")))
    }

    /// The interceptor that adds the token to every call (none without a
    /// token).
    pub fn interceptor(&self) -> Result<TokenInterceptor, SecurityError> {
        Ok(TokenInterceptor(
            self.token.as_ref().map(Token::bearer).transpose()?,
        ))
    }
}

/// Adds `authorization: Bearer <token>` to every call.
#[derive(Clone, Default)]
pub struct TokenInterceptor(Option<MetadataValue<Ascii>>);

impl std::fmt::Debug for TokenInterceptor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() {
            "TokenInterceptor(<token>)"
        } else {
            "TokenInterceptor(none)"
        })
    }
}

impl Interceptor for TokenInterceptor {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(value) = &self.0 {
            req.metadata_mut().insert("authorization", value.clone());
        }
        Ok(req)
    }
}

/// A channel that sends the token with every call.
pub type AuthChannel = InterceptedService<Channel, TokenInterceptor>;

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_checked_and_never_printed() {
        assert!(matches!(
            Token::new("short", "T"),
            Err(SecurityError::BadToken { .. })
        ));
        let e = Token::new("has a space in the middle", "T").unwrap_err();
        assert!(e.to_string().contains("position 3"), "{e}");
        let t = Token::new("0123456789abcdef-secret", "STOKE_CLIENT_TOKEN").unwrap();
        assert!(t.matches(b"0123456789abcdef-secret"));
        assert!(!t.matches(b"0123456789abcdef-secreT"));
        assert!(!t.matches(b"0123456789abcdef"));
        let shown = format!("{t:?} {}", serde_json::to_string(&t).unwrap());
        assert!(!shown.contains("secret"), "{shown}");
        assert!(shown.contains("STOKE_CLIENT_TOKEN"), "{shown}");
    }

    #[test]
    fn token_files_are_trimmed_and_named_in_errors() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("token");
        std::fs::write(&path, "  0123456789abcdef-secret\n").unwrap();
        let t = Token::from_file(&path, "STOKE_WORKER_TOKEN_FILE").unwrap();
        assert!(t.matches(b"0123456789abcdef-secret"));
        let missing = Token::from_file(&dir.path().join("nope"), "STOKE_WORKER_TOKEN_FILE")
            .unwrap_err()
            .to_string();
        assert!(missing.contains("STOKE_WORKER_TOKEN_FILE"), "{missing}");
        assert!(missing.contains("nope"), "{missing}");
        std::fs::write(&path, "short\n").unwrap();
        let short = Token::from_file(&path, "F").unwrap_err().to_string();
        assert!(short.contains("at least 16"), "{short}");
        assert!(!short.contains("short\n"), "{short}");
    }

    #[test]
    fn pem_files_are_checked() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ca.pem");
        std::fs::write(&path, b"\x30\x82binary").unwrap();
        let e = read_pem(&path, "STOKE_TLS_CA").unwrap_err().to_string();
        assert!(
            e.contains("not a PEM file") && e.contains("STOKE_TLS_CA"),
            "{e}"
        );
    }

    #[test]
    fn tls_settings_need_an_https_address() {
        let security = ClientSecurity {
            ca_pem: Some(b"-----BEGIN CERTIFICATE-----".to_vec()),
            ..Default::default()
        };
        let e = security.endpoint("http://127.0.0.1:7070").unwrap_err();
        assert!(e.to_string().contains("not https://"), "{e}");
        assert!(
            ClientSecurity::default()
                .endpoint("http://127.0.0.1:7070")
                .is_ok()
        );
    }
}
