//! stoke's object stores: store URIs, and the one place that turns a URI
//! into an `object_store`.
//!
//! Everything stoke reads or writes (datasets, models, outputs, its own
//! durable state) is named by a URI: `file:///abs/path`, `memory:///key`,
//! `s3://bucket/key`, `gs://bucket/key`, `az://container/key`. `Stores`
//! caches one store per scheme and authority, so every user of a `Stores`
//! value sees the same `memory://` store; [`open`] builds them from
//! [`StoreConfig`] and the cloud SDKs' environment variables.

mod config;
mod error;
mod local;
mod open;

pub use config::{STORE_ENV_VARS, StoreConfig};
pub use error::{ConfigError, StoreError};
pub use stoke_uri::{Listed, StoreUri, UriError, to_json_bytes};

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};
use object_store::path::Path;
use object_store::{
    ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload, UpdateVersion, WriteMultipart,
};

/// A listed object from the store's metadata.
fn listed(uri: StoreUri, meta: object_store::ObjectMeta) -> Listed {
    Listed {
        uri,
        size: meta.size,
        e_tag: meta.e_tag,
        version: meta.version,
    }
}

/// The object path of `uri` inside its store.
pub(crate) fn object_path(uri: &StoreUri) -> Result<Path, UriError> {
    Path::from_url_path(uri.url_path()).map_err(|e| UriError::Malformed {
        uri: uri.to_string(),
        reason: e.to_string(),
    })
}

/// The version of an object as read, for a later compare-and-swap write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectVersion {
    pub e_tag: Option<String>,
    pub version: Option<String>,
}

/// Opens stores by URI and caches them; clones share the cache.
#[derive(Debug, Clone, Default)]
pub struct Stores {
    cache: Arc<Mutex<HashMap<String, Arc<dyn ObjectStore>>>>,
    config: Arc<StoreConfig>,
    fence: Option<WriteFence>,
}

/// Lets writes through only while a lease (the coordinator's hold on its
/// state root) is known valid: a process that could not renew its lease
/// must not write records another holder may now own.
#[derive(Debug, Clone)]
pub struct WriteFence {
    valid_until: Arc<Mutex<Option<tokio::time::Instant>>>,
    what: Arc<str>,
}

impl WriteFence {
    /// A fence that is closed until [`WriteFence::extend_until`] opens it.
    pub fn new(what: &str) -> Self {
        Self {
            valid_until: Arc::default(),
            what: Arc::from(what),
        }
    }

    pub fn extend_until(&self, until: tokio::time::Instant) {
        *self.valid_until.lock().unwrap_or_else(|p| p.into_inner()) = Some(until);
    }

    pub fn close(&self) {
        *self.valid_until.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }

    pub fn is_open(&self) -> bool {
        self.valid_until
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_some_and(|t| tokio::time::Instant::now() < t)
    }

    fn check(&self, uri: &StoreUri) -> Result<(), StoreError> {
        if self.is_open() {
            return Ok(());
        }
        Err(StoreError::Fenced {
            uri: uri.to_string(),
            reason: format!("{} is not currently held by this process", self.what),
        })
    }
}

impl Stores {
    /// Stores with default settings (cloud credentials still come from the
    /// SDKs' environment variables).
    pub fn new() -> Self {
        Self::default()
    }

    pub fn with_config(config: StoreConfig) -> Self {
        Self {
            cache: Arc::default(),
            config: Arc::new(config),
            fence: None,
        }
    }

    /// Stores configured by this process's `STOKE_STORE_*` variables.
    pub fn from_env() -> Result<Self, ConfigError> {
        Ok(Self::with_config(StoreConfig::from_env()?))
    }

    pub fn config(&self) -> &StoreConfig {
        &self.config
    }

    /// The same stores (sharing the cache), with every write checked
    /// against `fence` first.
    pub fn fenced(&self, fence: WriteFence) -> Self {
        Self {
            fence: Some(fence),
            ..self.clone()
        }
    }

    fn check_fence(&self, uri: &StoreUri) -> Result<(), StoreError> {
        match &self.fence {
            Some(fence) => fence.check(uri),
            None => Ok(()),
        }
    }

    /// The store holding `uri`, and the object path inside it.
    pub fn resolve(&self, uri: &StoreUri) -> Result<(Arc<dyn ObjectStore>, Path), StoreError> {
        let path = object_path(uri)?;
        let key = uri.store_key();
        let mut cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(store) = cache.get(&key) {
            return Ok((Arc::clone(store), path));
        }
        let store = open::open(uri, &self.config)?;
        cache.insert(key, Arc::clone(&store));
        Ok((store, path))
    }

    pub async fn get(&self, uri: &StoreUri) -> Result<Bytes, StoreError> {
        let (store, path) = self.resolve(uri)?;
        let result = store
            .get(&path)
            .await
            .map_err(|e| StoreError::io("reading", uri.as_str(), e))?;
        result
            .bytes()
            .await
            .map_err(|e| StoreError::io("reading", uri.as_str(), e))
    }

    /// Reads each object whole, as [`Stores::get`] does: the bodies in
    /// order, or the first error. When every object is on the local file
    /// system they are read on one blocking thread, one after another: a
    /// small file is read in microseconds, where `object_store`'s local
    /// `get` takes two blocking tasks per object, whose thread hand-offs
    /// cost more than the read. Others are read all at once.
    pub async fn get_all(&self, uris: &[StoreUri]) -> Result<Vec<Bytes>, StoreError> {
        let local: Option<Vec<std::path::PathBuf>> =
            uris.iter().map(StoreUri::local_path).collect();
        if let Some(paths) = local {
            let read = tokio::task::spawn_blocking(move || {
                paths.iter().map(std::fs::read).collect::<Vec<_>>()
            })
            .await;
            // A blocking thread that died: the general path below.
            if let Ok(read) = read {
                let mut bodies = Vec::with_capacity(uris.len());
                for (uri, body) in uris.iter().zip(read) {
                    match body {
                        Ok(body) => bodies.push(Bytes::from(body)),
                        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                            return Err(StoreError::NotFound {
                                uri: uri.as_str().to_string(),
                            });
                        }
                        // Anything unusual (a folder, no permission): the
                        // general path, which says what went wrong.
                        Err(_) => bodies.push(self.get(uri).await?),
                    }
                }
                return Ok(bodies);
            }
        }
        futures::future::try_join_all(uris.iter().map(|uri| self.get(uri))).await
    }

    pub async fn get_range(
        &self,
        uri: &StoreUri,
        range: std::ops::Range<u64>,
    ) -> Result<Bytes, StoreError> {
        let (store, path) = self.resolve(uri)?;
        store
            .get_range(&path, range)
            .await
            .map_err(|e| StoreError::io("reading a range of", uri.as_str(), e))
    }

    pub async fn size(&self, uri: &StoreUri) -> Result<u64, StoreError> {
        Ok(self.head(uri).await?.size)
    }

    /// One object's size, entity tag and version.
    pub async fn head(&self, uri: &StoreUri) -> Result<Listed, StoreError> {
        let (store, path) = self.resolve(uri)?;
        let meta = store
            .head(&path)
            .await
            .map_err(|e| StoreError::io("looking up", uri.as_str(), e))?;
        Ok(listed(uri.clone(), meta))
    }

    /// Writes an object, replacing what was there. Objects over the
    /// configured threshold go up as a multipart upload (cloud stores).
    pub async fn put(&self, uri: &StoreUri, bytes: Bytes) -> Result<(), StoreError> {
        let local = matches!(uri.scheme(), "file" | "memory");
        if !local && bytes.len() as u64 > self.config.multipart_threshold {
            return self.put_multipart(uri, bytes).await;
        }
        self.put_mode(uri, bytes, PutMode::Overwrite)
            .await
            .map(|_| ())
    }

    async fn put_multipart(&self, uri: &StoreUri, bytes: Bytes) -> Result<(), StoreError> {
        self.check_fence(uri)?;
        let (store, path) = self.resolve(uri)?;
        let upload = store
            .put_multipart(&path)
            .await
            .map_err(|e| StoreError::io("starting a multipart upload of", uri.as_str(), e))?;
        let mut writer = WriteMultipart::new_with_chunk_size(upload, self.config.part_size);
        writer.put(bytes);
        writer
            .finish()
            .await
            .map_err(|e| StoreError::io("writing (multipart)", uri.as_str(), e))?;
        Ok(())
    }

    /// Reads an object with its version; `None` when it does not exist.
    pub async fn get_versioned(
        &self,
        uri: &StoreUri,
    ) -> Result<Option<(Bytes, ObjectVersion)>, StoreError> {
        let (store, path) = self.resolve(uri)?;
        let result = match store.get(&path).await {
            Ok(result) => result,
            Err(object_store::Error::NotFound { .. }) => return Ok(None),
            Err(e) => return Err(StoreError::io("reading", uri.as_str(), e)),
        };
        let version = ObjectVersion {
            e_tag: result.meta.e_tag.clone(),
            version: result.meta.version.clone(),
        };
        let bytes = result
            .bytes()
            .await
            .map_err(|e| StoreError::io("reading", uri.as_str(), e))?;
        Ok(Some((bytes, version)))
    }

    /// Replaces an object only if it is still at `expected` (compare and
    /// swap on the ETag/version): `Conflict` when another writer changed it.
    /// `file://` stores cannot compare atomically; there the caller's own
    /// lock (an OS file lock on the state root) is what serialises writers.
    pub async fn put_if(
        &self,
        uri: &StoreUri,
        bytes: Bytes,
        expected: &ObjectVersion,
    ) -> Result<ObjectVersion, StoreError> {
        let mode = if uri.scheme() == "file" {
            PutMode::Overwrite
        } else {
            PutMode::Update(UpdateVersion {
                e_tag: expected.e_tag.clone(),
                version: expected.version.clone(),
            })
        };
        self.put_mode(uri, bytes, mode).await
    }

    /// Writes an object only if none exists, returning its version.
    pub async fn put_new_versioned(
        &self,
        uri: &StoreUri,
        bytes: Bytes,
    ) -> Result<ObjectVersion, StoreError> {
        self.put_mode(uri, bytes, PutMode::Create).await
    }

    /// Writes an object only if none exists (`AlreadyExists` otherwise).
    pub async fn put_new(&self, uri: &StoreUri, bytes: Bytes) -> Result<(), StoreError> {
        self.put_mode(uri, bytes, PutMode::Create).await.map(|_| ())
    }

    /// Writes an object under `mode` (through the fence); its version.
    async fn put_mode(
        &self,
        uri: &StoreUri,
        bytes: Bytes,
        mode: PutMode,
    ) -> Result<ObjectVersion, StoreError> {
        self.check_fence(uri)?;
        let (store, path) = self.resolve(uri)?;
        let opts = PutOptions {
            mode,
            ..Default::default()
        };
        let result = store
            .put_opts(&path, PutPayload::from(bytes), opts)
            .await
            .map_err(|e| StoreError::io("writing", uri.as_str(), e))?;
        Ok(ObjectVersion {
            e_tag: result.e_tag,
            version: result.version,
        })
    }

    /// Copies an object, replacing what is at `to`: inside one store
    /// (bucket), a server-side copy on cloud stores and a hard link on
    /// `file://`, so the bytes are never downloaded again. Across stores
    /// (or file systems, where a hard link cannot go) the bytes are read
    /// and written. Copying again gives the same result.
    pub async fn copy(&self, from: &StoreUri, to: &StoreUri) -> Result<(), StoreError> {
        self.check_fence(to)?;
        let (store, from_path) = self.resolve(from)?;
        if from.same_store(to) {
            let to_path = object_path(to)?;
            match store.copy(&from_path, &to_path).await {
                Ok(()) => return Ok(()),
                Err(object_store::Error::NotFound { .. }) => {
                    return Err(StoreError::NotFound {
                        uri: from.to_string(),
                    });
                }
                // Another file system than the source's: copy the bytes.
                Err(_) if from.scheme() == "file" => {}
                Err(e) => return Err(StoreError::io("copying", to.as_str(), e)),
            }
        }
        let bytes = self.get(from).await?;
        self.put(to, bytes).await
    }

    /// Copies each `(from, to)` pair, as [`Stores::copy`] does; one result
    /// per pair, in order. Pairs within the local file system are done on
    /// one blocking thread, one after another (a hard link each, a rename
    /// only to replace an object already there): each is a few
    /// microseconds of system calls, where a blocking task per copy would
    /// cost more in thread hand-offs than the copy itself. Other pairs are
    /// copied `concurrency` at a time.
    pub async fn copy_all(
        &self,
        pairs: &[(StoreUri, StoreUri)],
        concurrency: usize,
    ) -> Vec<Result<(), StoreError>> {
        let routes = pairs
            .iter()
            .map(|(from, to)| {
                self.check_fence(to)?;
                Ok(from
                    .local_path()
                    .zip(to.local_path())
                    .map(|(f, t)| (f, t, from.to_string())))
            })
            .collect();
        let link = |(from, to, uri): (std::path::PathBuf, std::path::PathBuf, String)| {
            match local::link_local(&from, &to) {
                local::LocalCopy::Done => Some(Ok(())),
                local::LocalCopy::Missing => Some(Err(StoreError::NotFound { uri })),
                // Another file system, or anything unusual: the general
                // path (it copies the bytes).
                local::LocalCopy::Fallback => None,
            }
        };
        self.local_first(routes, link, concurrency, |i| {
            self.copy(&pairs[i].0, &pairs[i].1)
        })
        .await
    }

    /// Writes each `(uri, bytes)` as [`Stores::put`] does; one result per
    /// item, in order. Items on the local file system are written on one
    /// blocking thread, one after another (each to a temporary name, then
    /// renamed into place, as `object_store` writes them); others
    /// `concurrency` at a time.
    pub async fn put_all(
        &self,
        items: Vec<(StoreUri, Bytes)>,
        concurrency: usize,
    ) -> Vec<Result<(), StoreError>> {
        let routes = items
            .iter()
            .map(|(uri, bytes)| {
                self.check_fence(uri)?;
                Ok(uri.local_path().map(|path| (path, bytes.clone())))
            })
            .collect();
        // Anything unusual: the general path, which says what went wrong.
        let write = |(path, bytes): (std::path::PathBuf, Bytes)| {
            local::write_local(&path, &bytes).then_some(Ok(()))
        };
        let items = &items;
        self.local_first(routes, write, concurrency, |i| {
            self.put(&items[i].0, items[i].1.clone())
        })
        .await
    }

    /// One result per item, in order, for `copy_all` and `put_all`. Each
    /// route is the item's fence refusal, or what the local fast path
    /// needs (`Some`) or nothing (the general path). The local items run
    /// through `local` on one blocking thread, one after another; those it
    /// answers `None` for, and the rest, go through `general`,
    /// `concurrency` at a time.
    async fn local_first<A, L, G, F>(
        &self,
        routes: Vec<Result<Option<A>, StoreError>>,
        local: L,
        concurrency: usize,
        general: G,
    ) -> Vec<Result<(), StoreError>>
    where
        A: Send + 'static,
        L: Fn(A) -> Option<Result<(), StoreError>> + Send + 'static,
        G: Fn(usize) -> F,
        F: std::future::Future<Output = Result<(), StoreError>>,
    {
        let mut results: Vec<Option<Result<(), StoreError>>> =
            std::iter::repeat_with(|| None).take(routes.len()).collect();
        let mut fast = Vec::new();
        let mut slow = Vec::new();
        for (i, route) in routes.into_iter().enumerate() {
            match route {
                Err(e) => results[i] = Some(Err(e)),
                Ok(Some(arg)) => fast.push((i, arg)),
                Ok(None) => slow.push(i),
            }
        }
        if !fast.is_empty() {
            let fast_idx: Vec<usize> = fast.iter().map(|(i, _)| *i).collect();
            let done = tokio::task::spawn_blocking(move || {
                fast.into_iter()
                    .map(|(i, arg)| (i, local(arg)))
                    .collect::<Vec<_>>()
            })
            .await;
            match done {
                Ok(done) => {
                    for (i, outcome) in done {
                        match outcome {
                            Some(result) => results[i] = Some(result),
                            None => slow.push(i),
                        }
                    }
                }
                // The blocking thread died: the general path does them.
                Err(_) => slow.extend(fast_idx),
            }
        }
        let general = &general;
        let mut rest = futures::stream::iter(slow)
            .map(|i| async move { (i, general(i).await) })
            .buffer_unordered(concurrency.max(1));
        while let Some((i, result)) = rest.next().await {
            results[i] = Some(result);
        }
        results.into_iter().map(|r| r.unwrap_or(Ok(()))).collect()
    }

    pub async fn delete(&self, uri: &StoreUri) -> Result<(), StoreError> {
        self.check_fence(uri)?;
        let (store, path) = self.resolve(uri)?;
        match store.delete(&path).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(StoreError::io("deleting", uri.as_str(), e)),
        }
    }

    /// Every object under `prefix` (recursively), sorted by URI. A URI that
    /// names one object lists just that object.
    pub async fn list(&self, prefix: &StoreUri) -> Result<Vec<Listed>, StoreError> {
        let (store, path) = self.resolve(prefix)?;
        let metas: Vec<_> = store
            .list(Some(&path))
            .try_collect()
            .await
            .map_err(|e| StoreError::io("listing", prefix.as_str(), e))?;
        let mut out: Vec<Listed> = metas
            .into_iter()
            .map(|m| listed(prefix.with_path(m.location.as_ref()), m))
            .collect();
        if out.is_empty() && !prefix.as_str().ends_with('/') {
            match store.head(&path).await {
                Ok(meta) => out.push(listed(prefix.clone(), meta)),
                Err(object_store::Error::NotFound { .. }) => {}
                Err(e) => return Err(StoreError::io("looking up", prefix.as_str(), e)),
            }
        }
        out.sort_by(|a, b| a.uri.as_str().cmp(b.uri.as_str()));
        Ok(out)
    }

    /// The names of the immediate child folders of `prefix`, sorted.
    pub async fn list_dirs(&self, prefix: &StoreUri) -> Result<Vec<String>, StoreError> {
        let (store, path) = self.resolve(prefix)?;
        let listed = match store.list_with_delimiter(Some(&path)).await {
            Ok(listed) => listed,
            Err(object_store::Error::NotFound { .. }) => return Ok(Vec::new()),
            Err(e) => return Err(StoreError::io("listing", prefix.as_str(), e)),
        };
        let mut names: Vec<String> = listed
            .common_prefixes
            .iter()
            .filter_map(|p| p.filename().map(str::to_string))
            .collect();
        names.sort();
        Ok(names)
    }

    /// Reads and decodes a JSON record; `None` when it does not exist.
    pub async fn get_json<T: serde::de::DeserializeOwned>(
        &self,
        uri: &StoreUri,
    ) -> Result<Option<T>, StoreError> {
        match self.get(uri).await {
            Ok(bytes) => {
                serde_json::from_slice(&bytes)
                    .map(Some)
                    .map_err(|source| StoreError::Decode {
                        uri: uri.to_string(),
                        source,
                    })
            }
            Err(StoreError::NotFound { .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }

    pub async fn put_json<T: serde::Serialize>(
        &self,
        uri: &StoreUri,
        value: &T,
    ) -> Result<(), StoreError> {
        self.put(uri, Bytes::from(to_json_bytes(value))).await
    }

    pub async fn put_json_new<T: serde::Serialize>(
        &self,
        uri: &StoreUri,
        value: &T,
    ) -> Result<(), StoreError> {
        self.put_new(uri, Bytes::from(to_json_bytes(value))).await
    }
}

#[cfg(test)]
mod tests;
