//! Turning a store URI into an `object_store`: the one place that knows the
//! cloud builders. Each builder starts from the SDK's own environment
//! variables (`AWS_*`, `GOOGLE_*`, `AZURE_*`), then takes stoke's
//! credentials file and [`StoreConfig`] on top, with timeouts and retries on
//! every request. A store with no credentials at all is refused here, with
//! the variables to set, rather than failing later inside a retry loop.

use std::collections::BTreeMap;
use std::path::Path as FsPath;
use std::sync::Arc;

use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey};
use object_store::azure::{AzureConfigKey, MicrosoftAzureBuilder};
use object_store::gcp::{GoogleCloudStorageBuilder, GoogleConfigKey};
use object_store::local::LocalFileSystem;
use object_store::memory::InMemory;
use object_store::{BackoffConfig, ClientConfigKey, ObjectStore, RetryConfig};

use super::StoreUri;
use super::config::StoreConfig;
use crate::StoreError;

/// Opens the store that holds `uri` (its scheme and bucket/container).
pub(super) fn open(
    uri: &StoreUri,
    config: &StoreConfig,
) -> Result<Arc<dyn ObjectStore>, StoreError> {
    match uri.scheme() {
        "memory" => Ok(Arc::new(InMemory::new())),
        "file" => Ok(Arc::new(LocalFileSystem::new())),
        "s3" => open_s3(uri, config),
        "gs" => open_gcs(uri, config),
        // object_store reads the account and container of an ABFS URI.
        "az" | "abfs" | "abfss" => open_azure(uri, config),
        other => Err(StoreError::Config {
            uri: uri.to_string(),
            message: format!("unsupported scheme {other:?}"),
        }),
    }
}

fn retry(config: &StoreConfig) -> RetryConfig {
    RetryConfig {
        backoff: BackoffConfig::default(),
        max_retries: config.max_retries,
        retry_timeout: config.retry_timeout,
    }
}

/// Client settings every cloud builder takes, as (key, value) pairs.
fn client_settings(config: &StoreConfig) -> Vec<(ClientConfigKey, String)> {
    let mut settings = vec![
        (
            ClientConfigKey::Timeout,
            humantime::format_duration(config.request_timeout).to_string(),
        ),
        (
            ClientConfigKey::ConnectTimeout,
            humantime::format_duration(config.connect_timeout).to_string(),
        ),
    ];
    if config.allow_http {
        settings.push((ClientConfigKey::AllowHttp, "true".to_string()));
    }
    settings
}

fn is_true(value: Option<String>) -> bool {
    value.is_some_and(|v| matches!(v.to_ascii_lowercase().as_str(), "true" | "1" | "yes"))
}

/// A credentials file's settings (of `profile`'s section, if given) as the
/// store's configuration keys; a key the store does not know is refused,
/// naming the file.
fn file_settings<K: std::str::FromStr>(
    uri: &StoreUri,
    path: &FsPath,
    profile: Option<&str>,
) -> Result<Vec<(K, String)>, StoreError> {
    read_key_values(uri, path, profile)?
        .into_iter()
        .map(|(key, value)| {
            let parsed = key.parse::<K>().map_err(|_| StoreError::Config {
                uri: uri.to_string(),
                message: format!("{}: unknown key {key:?}", path.display()),
            })?;
            Ok((parsed, value))
        })
        .collect()
}

fn bucket_root(uri: &StoreUri) -> String {
    format!("{}://{}", uri.scheme(), uri.authority())
}

fn open_s3(uri: &StoreUri, config: &StoreConfig) -> Result<Arc<dyn ObjectStore>, StoreError> {
    let mut builder = AmazonS3Builder::from_env().with_url(bucket_root(uri));
    if let Some(path) = &config.credentials_file {
        let profile = std::env::var("AWS_PROFILE").unwrap_or_else(|_| "default".to_string());
        for (key, value) in file_settings::<AmazonS3ConfigKey>(uri, path, Some(&profile))? {
            builder = builder.with_config(key, value);
        }
    }
    if let Some(endpoint) = &config.endpoint {
        builder = builder.with_endpoint(endpoint);
    }
    if let Some(region) = &config.region {
        builder = builder.with_region(region);
    }
    for (key, value) in client_settings(config) {
        builder = builder.with_config(AmazonS3ConfigKey::Client(key), value);
    }
    let has_credentials = builder
        .get_config_value(&AmazonS3ConfigKey::AccessKeyId)
        .is_some()
        || builder
            .get_config_value(&AmazonS3ConfigKey::WebIdentityTokenFile)
            .is_some()
        || builder
            .get_config_value(&AmazonS3ConfigKey::ContainerCredentialsRelativeUri)
            .is_some()
        || builder
            .get_config_value(&AmazonS3ConfigKey::ContainerCredentialsFullUri)
            .is_some()
        || is_true(builder.get_config_value(&AmazonS3ConfigKey::SkipSignature));
    let hint = "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, point \
                   STOKE_STORE_CREDENTIALS_FILE at an AWS credentials file, use a web identity \
                   (AWS_WEB_IDENTITY_TOKEN_FILE and AWS_ROLE_ARN), or set \
                   STOKE_STORE_INSTANCE_CREDENTIALS=true to use the instance's role";
    built(uri, config, has_credentials, hint, |retry| {
        builder.with_retry(retry).build()
    })
}

fn open_gcs(uri: &StoreUri, config: &StoreConfig) -> Result<Arc<dyn ObjectStore>, StoreError> {
    let mut builder = GoogleCloudStorageBuilder::from_env().with_url(bucket_root(uri));
    if let Some(path) = &config.credentials_file {
        builder = builder.with_config(
            GoogleConfigKey::ApplicationCredentials,
            path.display().to_string(),
        );
    }
    if let Some(endpoint) = &config.endpoint {
        builder = builder.with_config(GoogleConfigKey::BaseUrl, endpoint);
    }
    for (key, value) in client_settings(config) {
        builder = builder.with_config(GoogleConfigKey::Client(key), value);
    }
    let default_adc = std::env::var_os("HOME").is_some_and(|home| {
        FsPath::new(&home)
            .join(".config/gcloud/application_default_credentials.json")
            .is_file()
    });
    let has_credentials = [
        GoogleConfigKey::ServiceAccount,
        GoogleConfigKey::ServiceAccountKey,
        GoogleConfigKey::ApplicationCredentials,
    ]
    .iter()
    .any(|key| builder.get_config_value(key).is_some())
        || is_true(builder.get_config_value(&GoogleConfigKey::SkipSignature))
        || default_adc;
    let hint = "set GOOGLE_APPLICATION_CREDENTIALS (or STOKE_STORE_CREDENTIALS_FILE) to a \
                   service-account JSON file, GOOGLE_SERVICE_ACCOUNT_KEY to its contents, or \
                   STOKE_STORE_INSTANCE_CREDENTIALS=true to use the VM's service account";
    built(uri, config, has_credentials, hint, |retry| {
        builder.with_retry(retry).build()
    })
}

fn open_azure(uri: &StoreUri, config: &StoreConfig) -> Result<Arc<dyn ObjectStore>, StoreError> {
    let mut builder = MicrosoftAzureBuilder::from_env().with_url(bucket_root(uri));
    if let Some(path) = &config.credentials_file {
        for (key, value) in file_settings::<AzureConfigKey>(uri, path, None)? {
            builder = builder.with_config(key, value);
        }
    }
    if let Some(endpoint) = &config.endpoint {
        builder = builder.with_endpoint(endpoint.clone());
    }
    for (key, value) in client_settings(config) {
        builder = builder.with_config(AzureConfigKey::Client(key), value);
    }
    let has_credentials = [
        AzureConfigKey::AccessKey,
        AzureConfigKey::SasKey,
        AzureConfigKey::Token,
        AzureConfigKey::ClientSecret,
        AzureConfigKey::FederatedTokenFile,
    ]
    .iter()
    .any(|key| builder.get_config_value(key).is_some())
        || [
            AzureConfigKey::UseEmulator,
            AzureConfigKey::UseAzureCli,
            AzureConfigKey::SkipSignature,
        ]
        .iter()
        .any(|key| is_true(builder.get_config_value(key)));
    let hint = "set AZURE_STORAGE_ACCOUNT_NAME with AZURE_STORAGE_ACCOUNT_KEY or \
                   AZURE_STORAGE_SAS_KEY, a service principal (AZURE_CLIENT_ID, \
                   AZURE_CLIENT_SECRET, AZURE_TENANT_ID), workload identity \
                   (AZURE_FEDERATED_TOKEN_FILE), STOKE_STORE_CREDENTIALS_FILE, or \
                   STOKE_STORE_INSTANCE_CREDENTIALS=true to use a managed identity";
    built(uri, config, has_credentials, hint, |retry| {
        builder.with_retry(retry).build()
    })
}

/// What opening every cloud store ends with: without credentials (and
/// without `instance_credentials`) a refusal saying how to give them
/// (`hint`); otherwise the store `build` makes with stoke's retries.
fn built<S: ObjectStore>(
    uri: &StoreUri,
    config: &StoreConfig,
    has_credentials: bool,
    hint: &str,
    build: impl FnOnce(RetryConfig) -> object_store::Result<S>,
) -> Result<Arc<dyn ObjectStore>, StoreError> {
    if !has_credentials && !config.instance_credentials {
        return Err(StoreError::Credentials {
            uri: uri.to_string(),
            hint: hint.to_string(),
        });
    }
    let store = build(retry(config)).map_err(|source| StoreError::Open {
        uri: uri.to_string(),
        source,
    })?;
    Ok(Arc::new(store))
}

/// Reads `key = value` lines (`#`/`;` comments). With `section`, a file that
/// has `[sections]` (an AWS credentials file) yields only that section's
/// keys (`[name]` or `[profile name]`); keys are lower-cased, as the
/// builders' key names are.
fn read_key_values(
    uri: &StoreUri,
    path: &FsPath,
    section: Option<&str>,
) -> Result<BTreeMap<String, String>, StoreError> {
    let text = std::fs::read_to_string(path).map_err(|e| StoreError::Config {
        uri: uri.to_string(),
        message: format!("reading credentials file {}: {e}", path.display()),
    })?;
    parse_key_values(&text, section).map_err(|message| StoreError::Config {
        uri: uri.to_string(),
        message: format!("credentials file {}: {message}", path.display()),
    })
}

fn parse_key_values(text: &str, section: Option<&str>) -> Result<BTreeMap<String, String>, String> {
    let has_sections = text.lines().any(|l| l.trim_start().starts_with('['));
    let mut current: Option<String> = None;
    let mut found_section = !has_sections;
    let mut out = BTreeMap::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') || line.starts_with(';') {
            continue;
        }
        if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            let name = name.trim();
            let name = name.strip_prefix("profile ").unwrap_or(name).trim();
            current = Some(name.to_string());
            if section.is_some_and(|s| s == name) {
                found_section = true;
            }
            continue;
        }
        let in_scope = match (has_sections, section, &current) {
            (false, _, _) => true,
            (true, Some(want), Some(cur)) => want == cur,
            (true, Some(_), None) => false,
            (true, None, _) => true,
        };
        if !in_scope {
            continue;
        }
        // Line numbers only: a credentials line may hold a secret.
        let (key, value) = line
            .split_once('=')
            .ok_or_else(|| format!("line {}: expected key = value", n + 1))?;
        let value = value.trim().trim_matches('"');
        out.insert(key.trim().to_ascii_lowercase(), value.to_string());
    }
    if let Some(want) = section
        && !found_section
    {
        return Err(format!("no [{want}] section"));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aws_credentials_file_picks_the_profile() {
        let text = "[default]\naws_access_key_id = A\naws_secret_access_key = B\n\n\
                    [profile ci]\naws_access_key_id=C\n";
        let default = parse_key_values(text, Some("default")).expect("parse");
        assert_eq!(
            default.get("aws_access_key_id").map(String::as_str),
            Some("A")
        );
        assert_eq!(default.len(), 2);
        let ci = parse_key_values(text, Some("ci")).expect("parse");
        assert_eq!(ci.get("aws_access_key_id").map(String::as_str), Some("C"));
        let missing = parse_key_values(text, Some("prod")).expect_err("no section");
        assert!(missing.contains("[prod]"), "{missing}");
    }

    #[test]
    fn plain_key_values_and_errors_without_secrets() {
        let kv =
            parse_key_values("# c\nAZURE_STORAGE_ACCOUNT_KEY = \"s3cr3t\"\n", None).expect("parse");
        assert_eq!(
            kv.get("azure_storage_account_key").map(String::as_str),
            Some("s3cr3t")
        );
        let err = parse_key_values("justasecretvalue\n", None).expect_err("bad line");
        assert!(
            err.contains("line 1") && !err.contains("justasecretvalue"),
            "{err}"
        );
    }

    fn clear_cloud_env() -> bool {
        // The builders read the process environment; these tests only make
        // sense where no cloud credentials are set.
        !std::env::vars().any(|(k, _)| {
            k.starts_with("AWS_") || k.starts_with("GOOGLE_") || k.starts_with("AZURE_")
        })
    }

    #[test]
    fn missing_credentials_name_the_uri_and_what_to_set() {
        if !clear_cloud_env() {
            return;
        }
        let config = StoreConfig::default();
        for (uri, needle) in [
            ("s3://bucket/x", "AWS_ACCESS_KEY_ID"),
            ("az://container/x", "AZURE_STORAGE_ACCOUNT_KEY"),
            (
                "abfss://container@account.dfs.core.windows.net/x",
                "AZURE_STORAGE_ACCOUNT_KEY",
            ),
        ] {
            let uri = StoreUri::parse(uri).expect("uri");
            let err = open(&uri, &config).expect_err("no credentials");
            let text = err.to_string();
            assert!(
                text.starts_with(uri.as_str())
                    && text.contains("no credentials")
                    && text.contains(needle),
                "{text}"
            );
        }
    }

    #[test]
    fn abfs_uris_name_their_container_and_account() {
        let uri = StoreUri::parse("abfss://lake@acct.dfs.core.windows.net/wh/t").expect("abfss");
        assert_eq!(uri.url_path(), "/wh/t");
        assert_eq!(uri.store_key(), "abfss://lake@acct.dfs.core.windows.net");
        let err = StoreUri::parse("abfss://lake/wh").expect_err("no account");
        assert!(
            err.to_string()
                .contains("abfss://container@account.dfs.core.windows.net/key"),
            "{err}"
        );
    }

    #[test]
    fn explicit_credentials_open_without_touching_the_network() {
        let dir = tempfile::tempdir().expect("tempdir");
        let creds = dir.path().join("credentials");
        std::fs::write(
            &creds,
            "[default]\naws_access_key_id = AKIA\naws_secret_access_key = SECRET\n",
        )
        .expect("write");
        let config = StoreConfig {
            endpoint: Some("http://127.0.0.1:9".to_string()),
            allow_http: true,
            credentials_file: Some(creds),
            ..StoreConfig::default()
        };
        let uri = StoreUri::parse("s3://bucket/x").expect("uri");
        open(&uri, &config).expect("opens");
        let bad = StoreConfig {
            credentials_file: Some(dir.path().join("missing")),
            ..config
        };
        let err = open(&uri, &bad).expect_err("missing file").to_string();
        assert!(err.contains("reading credentials file"), "{err}");
    }
}
