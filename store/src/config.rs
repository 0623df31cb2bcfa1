//! How stoke reaches object stores: endpoint, region, credentials file,
//! timeouts, retries and multipart sizes, read from `STOKE_STORE_*`
//! variables. The cloud SDK variables (`AWS_*`, `GOOGLE_*`, `AZURE_*`) are
//! read by `object_store`'s builders in [`super::open`]; these are stoke's
//! own and apply to whichever scheme a URI names.

use std::path::PathBuf;
use std::time::Duration;

use serde::Serialize;

use crate::ConfigError;

/// Settings for opening cloud stores. `Default` is what a process gets with
/// no `STOKE_STORE_*` variables set.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct StoreConfig {
    /// Endpoint URL for S3-compatible servers (MinIO, Ceph, a local test
    /// server), Azure (Azurite) or a GCS emulator.
    pub endpoint: Option<String>,
    /// Region (S3); `us-east-1` when neither this nor `AWS_REGION` is set.
    pub region: Option<String>,
    /// Permit plain-HTTP endpoints (off by default).
    pub allow_http: bool,
    /// A file with credentials: for `s3://` an AWS credentials file (INI,
    /// the `[AWS_PROFILE]` or `[default]` section) or `key = value` lines;
    /// for `gs://` a service-account or application-default JSON file; for
    /// `az://` `key = value` lines (`azure_storage_account_key = ...`).
    pub credentials_file: Option<PathBuf>,
    /// Allow credentials from the platform's metadata service (EC2 instance
    /// role, GCE service account, Azure managed identity) when no explicit
    /// credentials are configured. Off by default so a missing credential
    /// is an immediate, clear error instead of minutes of retries against a
    /// metadata endpoint that does not exist.
    pub instance_credentials: bool,
    /// Limit on one request, from connecting to the end of the body.
    #[serde(with = "humantime_serde")]
    pub request_timeout: Duration,
    #[serde(with = "humantime_serde")]
    pub connect_timeout: Duration,
    /// Retries of one request (5xx, 429, connection failures, timeouts of
    /// idempotent requests), with exponential backoff.
    pub max_retries: usize,
    /// No retry starts after this long since the first try.
    #[serde(with = "humantime_serde")]
    pub retry_timeout: Duration,
    /// Objects larger than this are written with a multipart upload.
    pub multipart_threshold: u64,
    /// Size of each part of a multipart upload (S3 needs at least 5 MiB).
    pub part_size: usize,
}

impl Default for StoreConfig {
    fn default() -> Self {
        Self {
            endpoint: None,
            region: None,
            allow_http: false,
            credentials_file: None,
            instance_credentials: false,
            request_timeout: Duration::from_secs(30),
            connect_timeout: Duration::from_secs(5),
            max_retries: 10,
            retry_timeout: Duration::from_secs(120),
            multipart_threshold: 64 * 1024 * 1024,
            part_size: 16 * 1024 * 1024,
        }
    }
}

/// The environment variables [`StoreConfig::from_env`] reads.
pub const STORE_ENV_VARS: [&str; 11] = [
    "STOKE_STORE_ENDPOINT",
    "STOKE_STORE_REGION",
    "STOKE_STORE_ALLOW_HTTP",
    "STOKE_STORE_CREDENTIALS_FILE",
    "STOKE_STORE_INSTANCE_CREDENTIALS",
    "STOKE_STORE_TIMEOUT",
    "STOKE_STORE_CONNECT_TIMEOUT",
    "STOKE_STORE_RETRIES",
    "STOKE_STORE_RETRY_TIMEOUT",
    "STOKE_STORE_MULTIPART_THRESHOLD",
    "STOKE_STORE_PART_SIZE",
];

const MIN_PART_SIZE: usize = 5 * 1024 * 1024;

impl StoreConfig {
    /// How long a worker holding a lease waits on one store operation
    /// before its attempt fails and the lease goes back (issue 58; ADR
    /// 020): a request and one retry, both unanswered (a request's limit
    /// covers its connect; the retry's backoff, under a second, comes on
    /// top). 65 s at the defaults; `STOKE_STORE_RETRY_TIMEOUT` may make it
    /// shorter.
    pub fn holder_gives_up_after(&self) -> Duration {
        self.holder_retry_timeout() + self.request_timeout
    }

    /// A holder's retry budget: one retry after a request that went
    /// unanswered (it fails after `request_timeout`), no more.
    fn holder_retry_timeout(&self) -> Duration {
        self.retry_timeout
            .min(self.request_timeout + self.connect_timeout)
    }

    /// The settings of a lease holder (a worker): retries end once a
    /// request and one retry went unanswered, so a worker cut off from the
    /// store gives its shard back instead of holding it through minutes of
    /// retries into the same hole (see [`Self::holder_gives_up_after`]).
    pub fn for_holder(mut self) -> Self {
        self.retry_timeout = self.holder_retry_timeout();
        self
    }

    /// Reads the `STOKE_STORE_*` variables of this process.
    pub fn from_env() -> Result<Self, ConfigError> {
        Self::from_vars(|name| std::env::var(name).ok())
    }

    /// Reads the `STOKE_STORE_*` variables through `var` (for tests).
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Self, ConfigError> {
        let mut config = Self::default();
        let get = |name: &str| var(name).filter(|v| !v.trim().is_empty());
        if let Some(v) = get("STOKE_STORE_ENDPOINT") {
            url::Url::parse(&v).map_err(|e| ConfigError::new("STOKE_STORE_ENDPOINT", &v, e))?;
            config.endpoint = Some(v);
        }
        config.region = get("STOKE_STORE_REGION");
        if let Some(v) = get("STOKE_STORE_ALLOW_HTTP") {
            config.allow_http = parse_bool("STOKE_STORE_ALLOW_HTTP", &v)?;
        }
        config.credentials_file = get("STOKE_STORE_CREDENTIALS_FILE").map(PathBuf::from);
        if let Some(v) = get("STOKE_STORE_INSTANCE_CREDENTIALS") {
            config.instance_credentials = parse_bool("STOKE_STORE_INSTANCE_CREDENTIALS", &v)?;
        }
        if let Some(v) = get("STOKE_STORE_TIMEOUT") {
            config.request_timeout = parse_duration("STOKE_STORE_TIMEOUT", &v)?;
        }
        if let Some(v) = get("STOKE_STORE_CONNECT_TIMEOUT") {
            config.connect_timeout = parse_duration("STOKE_STORE_CONNECT_TIMEOUT", &v)?;
        }
        if let Some(v) = get("STOKE_STORE_RETRIES") {
            config.max_retries = v
                .trim()
                .parse()
                .map_err(|e| ConfigError::new("STOKE_STORE_RETRIES", &v, e))?;
        }
        if let Some(v) = get("STOKE_STORE_RETRY_TIMEOUT") {
            config.retry_timeout = parse_duration("STOKE_STORE_RETRY_TIMEOUT", &v)?;
        }
        if let Some(v) = get("STOKE_STORE_MULTIPART_THRESHOLD") {
            config.multipart_threshold = parse_size("STOKE_STORE_MULTIPART_THRESHOLD", &v)?;
        }
        if let Some(v) = get("STOKE_STORE_PART_SIZE") {
            let size = parse_size("STOKE_STORE_PART_SIZE", &v)?;
            config.part_size = usize::try_from(size)
                .ok()
                .filter(|s| *s >= MIN_PART_SIZE)
                .ok_or_else(|| {
                    ConfigError::new("STOKE_STORE_PART_SIZE", &v, "must be at least 5MiB")
                })?;
        }
        Ok(config)
    }
}

fn parse_bool(var: &str, value: &str) -> Result<bool, ConfigError> {
    match value.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Ok(true),
        "0" | "false" | "no" | "off" => Ok(false),
        _ => Err(ConfigError::new(var, value, "expected true or false")),
    }
}

fn parse_duration(var: &str, value: &str) -> Result<Duration, ConfigError> {
    humantime::parse_duration(value.trim()).map_err(|e| ConfigError::new(var, value, e))
}

fn parse_size(var: &str, value: &str) -> Result<u64, ConfigError> {
    value
        .trim()
        .parse::<bytesize::ByteSize>()
        .map(|s| s.as_u64())
        .map_err(|e| ConfigError::new(var, value, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let pairs: Vec<(String, String)> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |name| {
            pairs
                .iter()
                .find(|(k, _)| k == name)
                .map(|(_, v)| v.clone())
        }
    }

    #[test]
    fn defaults_without_variables() {
        assert_eq!(
            StoreConfig::from_vars(|_| None).expect("config"),
            StoreConfig::default()
        );
    }

    #[test]
    fn reads_every_variable() {
        let config = StoreConfig::from_vars(vars(&[
            ("STOKE_STORE_ENDPOINT", "http://127.0.0.1:9000"),
            ("STOKE_STORE_REGION", "eu-west-1"),
            ("STOKE_STORE_ALLOW_HTTP", "true"),
            ("STOKE_STORE_CREDENTIALS_FILE", "/etc/stoke/creds"),
            ("STOKE_STORE_INSTANCE_CREDENTIALS", "yes"),
            ("STOKE_STORE_TIMEOUT", "5s"),
            ("STOKE_STORE_CONNECT_TIMEOUT", "1s"),
            ("STOKE_STORE_RETRIES", "3"),
            ("STOKE_STORE_RETRY_TIMEOUT", "1m"),
            ("STOKE_STORE_MULTIPART_THRESHOLD", "8MiB"),
            ("STOKE_STORE_PART_SIZE", "5MiB"),
        ]))
        .expect("config");
        assert_eq!(config.endpoint.as_deref(), Some("http://127.0.0.1:9000"));
        assert_eq!(config.region.as_deref(), Some("eu-west-1"));
        assert!(config.allow_http && config.instance_credentials);
        assert_eq!(config.request_timeout, Duration::from_secs(5));
        assert_eq!(config.connect_timeout, Duration::from_secs(1));
        assert_eq!(config.max_retries, 3);
        assert_eq!(config.retry_timeout, Duration::from_secs(60));
        assert_eq!(config.multipart_threshold, 8 * 1024 * 1024);
        assert_eq!(config.part_size, 5 * 1024 * 1024);
    }

    #[test]
    fn a_holder_gives_up_after_a_request_and_one_retry() {
        let config = StoreConfig::default();
        assert_eq!(config.holder_gives_up_after(), Duration::from_secs(65));
        let holder = config.clone().for_holder();
        assert_eq!(holder.retry_timeout, Duration::from_secs(35));
        assert_eq!(holder.request_timeout, config.request_timeout);
        let short = StoreConfig::from_vars(vars(&[
            ("STOKE_STORE_TIMEOUT", "2s"),
            ("STOKE_STORE_CONNECT_TIMEOUT", "1s"),
        ]))
        .expect("config");
        assert_eq!(short.holder_gives_up_after(), Duration::from_secs(5));
        // A shorter retry budget of the user's own stays.
        let user =
            StoreConfig::from_vars(vars(&[("STOKE_STORE_RETRY_TIMEOUT", "10s")])).expect("config");
        assert_eq!(
            user.clone().for_holder().retry_timeout,
            Duration::from_secs(10)
        );
        assert_eq!(user.holder_gives_up_after(), Duration::from_secs(40));
    }

    #[test]
    fn bad_values_name_the_variable() {
        for (var, value) in [
            ("STOKE_STORE_ALLOW_HTTP", "maybe"),
            ("STOKE_STORE_TIMEOUT", "soon"),
            ("STOKE_STORE_RETRIES", "-1"),
            ("STOKE_STORE_ENDPOINT", "not a url"),
            ("STOKE_STORE_PART_SIZE", "1MiB"),
        ] {
            let err = StoreConfig::from_vars(vars(&[(var, value)])).expect_err(var);
            let text = err.to_string();
            assert!(text.contains(var) && text.contains(value), "{text}");
        }
    }
}
