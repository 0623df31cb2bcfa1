//! Store URIs, and what a listing says of an object, without a store: the
//! names every durable record and dataset object goes by, for the crates
//! that decide without I/O (`stoke-machine`, `stoke-core`'s domain types).
//! `stoke-store` opens stores by them and re-exports them.

use std::path::Path as FsPath;

use thiserror::Error;
use url::Url;

/// A URI that does not name a store stoke can use.
#[derive(Debug, Error)]
pub enum UriError {
    #[error(
        "{uri:?} is not a URI ({reason}); use file:///abs/path, s3://bucket/key, gs://, az://container/key, abfss://container@account.dfs.core.windows.net/key or memory://"
    )]
    Malformed { uri: String, reason: String },
    #[error("{uri}: unsupported scheme {scheme:?}; use file, s3, gs, az, abfss or memory")]
    Scheme { uri: String, scheme: String },
}

/// `az://container/key` is object_store's spelling of an Azure object;
/// `abfs[s]://container@account.dfs.core.windows.net/key` is Azure's own
/// (ABFS), the one Iceberg and Spark engines read, so table locations use
/// it.
const SCHEMES: [&str; 7] = ["file", "memory", "s3", "gs", "az", "abfs", "abfss"];

/// A validated store URI.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct StoreUri {
    url: Url,
}

impl StoreUri {
    pub fn parse(text: &str) -> Result<Self, UriError> {
        let url = Url::parse(text).map_err(|e| UriError::Malformed {
            uri: text.to_string(),
            reason: e.to_string(),
        })?;
        if !SCHEMES.contains(&url.scheme()) {
            return Err(UriError::Scheme {
                uri: text.to_string(),
                scheme: url.scheme().to_string(),
            });
        }
        if matches!(url.scheme(), "abfs" | "abfss")
            && (url.username().is_empty() || url.host_str().is_none_or(|h| !h.contains('.')))
        {
            return Err(UriError::Malformed {
                uri: text.to_string(),
                reason: "an ABFS URI names its container and account: \
                         abfss://container@account.dfs.core.windows.net/key"
                    .to_string(),
            });
        }
        Ok(Self { url })
    }

    /// A `file://` URI for a local path (made absolute against the current
    /// folder).
    pub fn from_local_path(path: &FsPath) -> Result<Self, UriError> {
        let abs = std::path::absolute(path).map_err(|e| UriError::Malformed {
            uri: path.display().to_string(),
            reason: e.to_string(),
        })?;
        let url = Url::from_file_path(&abs).map_err(|()| UriError::Malformed {
            uri: path.display().to_string(),
            reason: "not an absolute path".to_string(),
        })?;
        Ok(Self { url })
    }

    /// Keeps a URI as it is; turns a plain path into a `file://` URI relative
    /// to `base`.
    pub fn resolve_path_or_uri(text: &str, base: &FsPath) -> Result<String, String> {
        if text.contains("://") {
            return Self::parse(text)
                .map(|u| u.to_string())
                .map_err(|e| e.to_string());
        }
        let trailing_slash = text.ends_with('/');
        let uri = Self::from_local_path(&base.join(text)).map_err(|e| e.to_string())?;
        let mut s = uri.to_string();
        if trailing_slash && !s.ends_with('/') {
            s.push('/');
        }
        Ok(s)
    }

    pub fn as_str(&self) -> &str {
        self.url.as_str()
    }

    pub fn scheme(&self) -> &str {
        self.url.scheme()
    }

    /// This URI with `segment` appended as a child ("a/b" + "c" = "a/b/c").
    pub fn join(&self, segment: &str) -> StoreUri {
        let base = self.url.as_str().trim_end_matches('/');
        let seg = segment.trim_start_matches('/');
        match Url::parse(&format!("{base}/{seg}")) {
            Ok(url) => Self { url },
            // Appending a plain segment to a valid URL stays valid; keep the
            // base if the segment held something a URL cannot.
            Err(_) => self.clone(),
        }
    }

    /// The URI's path ("/a/b" of "s3://bucket/a/b").
    pub fn url_path(&self) -> &str {
        self.url.path()
    }

    /// The URI of another object in the same store, at `path` (without
    /// its leading slash: "a/b").
    pub fn with_path(&self, path: &str) -> StoreUri {
        let mut url = self.url.clone();
        url.set_path(&format!("/{path}"));
        Self { url }
    }

    /// The last path segment ("part-1.parquet").
    pub fn file_name(&self) -> &str {
        self.url
            .path()
            .trim_end_matches('/')
            .rsplit('/')
            .next()
            .unwrap_or("")
    }

    /// The local path of a `file://` URI (`None` for other schemes), for
    /// readers that read local files directly rather than through a store.
    pub fn local_path(&self) -> Option<std::path::PathBuf> {
        if self.scheme() != "file" {
            return None;
        }
        self.url.to_file_path().ok()
    }

    /// Whether `other` lives in the same store (scheme and bucket), so an
    /// object can be copied from one to the other inside the store.
    pub fn same_store(&self, other: &StoreUri) -> bool {
        self.store_key() == other.store_key()
    }

    /// The bucket or container (empty for `file://` and `memory://`).
    pub fn authority(&self) -> &str {
        self.url.authority()
    }

    /// What one store is named by: scheme and bucket ("s3://bucket").
    pub fn store_key(&self) -> String {
        format!("{}://{}", self.url.scheme(), self.url.authority())
    }
}

impl std::fmt::Display for StoreUri {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.url.as_str())
    }
}

/// One listed object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Listed {
    pub uri: StoreUri,
    pub size: u64,
    /// The store's entity tag of the object, when it gives one (S3, GCS
    /// and Azure from the content or upload; local files from inode,
    /// modification time and size): what tells a changed object apart.
    pub e_tag: Option<String>,
    /// The object's version, on a versioned bucket.
    pub version: Option<String>,
}

/// A record as compact JSON: progress records are written once per
/// checkpoint and plans can list a million shards, so no indentation
/// (`jq .` shows them indented).
pub fn to_json_bytes<T: serde::Serialize>(value: &T) -> Vec<u8> {
    // Records are plain structs of strings and numbers: serialising cannot fail.
    serde_json::to_vec(value).unwrap_or_default()
}
