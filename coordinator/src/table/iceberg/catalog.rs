//! An Iceberg catalog opened from its spec, with its files read and
//! written through stoke's own store layer (`stoke-store`'s `Stores`):
//! one layer for `file`, `s3`, `az`, `gs` and `memory`, with the same
//! configuration, retries and write fence as every other write of the
//! coordinator (ADR 024). The `iceberg` crate ships only a local and an
//! in-memory storage, and its catalogs take any `StorageFactory`.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Arc, LazyLock, Mutex};

use async_trait::async_trait;
use bytes::Bytes;
use futures::StreamExt;
use futures::stream::BoxStream;
use iceberg::io::{
    FileMetadata, FileRead, FileWrite, InputFile, OutputFile, Storage, StorageConfig,
    StorageFactory,
};
use iceberg::{Catalog, CatalogBuilder, ErrorKind};
use iceberg_catalog_rest::RestCatalogBuilder;
use iceberg_catalog_sql::{SqlBindStyle, SqlCatalogBuilder};
use serde::{Deserialize, Serialize};
use stoke_core::spec::CatalogSpec;
use stoke_store::{StoreError, StoreUri, Stores};

use super::IcebergError;

/// Iceberg's storage over stoke's stores. Not meant to cross processes:
/// serialised (the trait asks for it) it carries no stores.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct StoreStorage {
    #[serde(skip)]
    stores: Stores,
}

impl StoreStorage {
    pub fn new(stores: Stores) -> Self {
        Self { stores }
    }
}

fn uri(path: &str) -> iceberg::Result<StoreUri> {
    StoreUri::parse(path).map_err(|e| {
        iceberg::Error::new(
            ErrorKind::DataInvalid,
            format!("not a location stoke can store to: {path}"),
        )
        .with_source(e)
    })
}

fn store_error(e: StoreError) -> iceberg::Error {
    let kind = match e {
        StoreError::NotFound { .. } => ErrorKind::DataInvalid,
        _ => ErrorKind::Unexpected,
    };
    iceberg::Error::new(kind, e.to_string()).with_source(e)
}

#[async_trait]
#[typetag::serde(name = "stoke")]
impl Storage for StoreStorage {
    async fn exists(&self, path: &str) -> iceberg::Result<bool> {
        match self.stores.head(&uri(path)?).await {
            Ok(_) => Ok(true),
            Err(StoreError::NotFound { .. }) => Ok(false),
            Err(e) => Err(store_error(e)),
        }
    }

    async fn metadata(&self, path: &str) -> iceberg::Result<FileMetadata> {
        let size = self.stores.size(&uri(path)?).await.map_err(store_error)?;
        Ok(FileMetadata { size })
    }

    async fn read(&self, path: &str) -> iceberg::Result<Bytes> {
        self.stores.get(&uri(path)?).await.map_err(store_error)
    }

    async fn reader(&self, path: &str) -> iceberg::Result<Box<dyn FileRead>> {
        Ok(Box::new(StoreRead {
            stores: self.stores.clone(),
            uri: uri(path)?,
        }))
    }

    async fn write(&self, path: &str, bs: Bytes) -> iceberg::Result<()> {
        self.stores
            .put(&uri(path)?, bs)
            .await
            .map_err(store_error)?;
        if path.ends_with(".metadata.json") {
            hold_after_metadata_written().await;
        }
        Ok(())
    }

    async fn writer(&self, path: &str) -> iceberg::Result<Box<dyn FileWrite>> {
        Ok(Box::new(StoreWrite {
            stores: self.stores.clone(),
            uri: uri(path)?,
            buffer: Vec::new(),
            closed: false,
        }))
    }

    async fn delete(&self, path: &str) -> iceberg::Result<()> {
        self.stores.delete(&uri(path)?).await.map_err(store_error)
    }

    async fn delete_prefix(&self, path: &str) -> iceberg::Result<()> {
        let prefix = if path.ends_with('/') {
            path.to_string()
        } else {
            format!("{path}/")
        };
        let listed = self
            .stores
            .list(&uri(&prefix)?)
            .await
            .map_err(store_error)?;
        for object in listed {
            self.stores.delete(&object.uri).await.map_err(store_error)?;
        }
        Ok(())
    }

    async fn delete_stream(&self, mut paths: BoxStream<'static, String>) -> iceberg::Result<()> {
        while let Some(path) = paths.next().await {
            self.delete(&path).await?;
        }
        Ok(())
    }

    fn new_input(&self, path: &str) -> iceberg::Result<InputFile> {
        Ok(InputFile::new(Arc::new(self.clone()), path.to_string()))
    }

    fn new_output(&self, path: &str) -> iceberg::Result<OutputFile> {
        Ok(OutputFile::new(Arc::new(self.clone()), path.to_string()))
    }
}

/// Fault injection (`coordinator::iceberg_metadata_written=return(DIR)`):
/// a table's new metadata file is written and the catalog has not yet
/// swapped it in. Marks `DIR/reached` and waits (at most two minutes) for
/// `DIR/go`: a test's other writer commits meanwhile, and the catalog's
/// compare-and-swap then refuses this commit.
async fn hold_after_metadata_written() {
    let dir: Option<String> = (|| {
        fail::fail_point!("coordinator::iceberg_metadata_written", |dir| dir);
        None
    })();
    let Some(dir) = dir else {
        return;
    };
    let dir = std::path::PathBuf::from(dir);
    if let Err(e) = tokio::fs::write(dir.join("reached"), b"").await {
        tracing::warn!(error = %e, "fault point iceberg_metadata_written: no marker");
        return;
    }
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(120);
    while tokio::fs::metadata(dir.join("go")).await.is_err()
        && tokio::time::Instant::now() < deadline
    {
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// Ranged reads of one object.
struct StoreRead {
    stores: Stores,
    uri: StoreUri,
}

#[async_trait]
impl FileRead for StoreRead {
    async fn read(&self, range: Range<u64>) -> iceberg::Result<Bytes> {
        self.stores
            .get_range(&self.uri, range)
            .await
            .map_err(store_error)
    }
}

/// A whole object, written once at its close (Iceberg's metadata files
/// and manifests are small).
struct StoreWrite {
    stores: Stores,
    uri: StoreUri,
    buffer: Vec<u8>,
    closed: bool,
}

#[async_trait]
impl FileWrite for StoreWrite {
    async fn write(&mut self, bs: Bytes) -> iceberg::Result<()> {
        if self.closed {
            return Err(iceberg::Error::new(
                ErrorKind::Unexpected,
                format!("writing to {} after its close", self.uri),
            ));
        }
        self.buffer.extend_from_slice(&bs);
        Ok(())
    }

    async fn close(&mut self) -> iceberg::Result<()> {
        if self.closed {
            return Err(iceberg::Error::new(
                ErrorKind::Unexpected,
                format!("{} closed twice", self.uri),
            ));
        }
        self.closed = true;
        let bytes = Bytes::from(std::mem::take(&mut self.buffer));
        self.stores.put(&self.uri, bytes).await.map_err(store_error)
    }
}

/// Builds [`StoreStorage`] for a catalog's files.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct StoreStorageFactory {
    #[serde(skip)]
    stores: Stores,
}

impl StoreStorageFactory {
    pub fn new(stores: Stores) -> Self {
        Self { stores }
    }
}

#[typetag::serde(name = "stoke")]
impl StorageFactory for StoreStorageFactory {
    fn build(&self, _config: &StorageConfig) -> iceberg::Result<Arc<dyn Storage>> {
        Ok(Arc::new(StoreStorage::new(self.stores.clone())))
    }
}

/// A SQL catalog's database URI as sqlx opens it: the file is created if
/// it is missing.
fn sqlite_uri(uri: &str) -> String {
    if uri.contains('?') {
        uri.to_string()
    } else {
        format!("{uri}?mode=rwc")
    }
}

/// The catalog `spec` names, opened once per process and shared (a SQL
/// catalog holds a pool of database connections, a REST one its token).
/// A REST catalog's files are read and written with stoke's own store
/// settings, not with credentials the server may vend.
pub async fn open(spec: &CatalogSpec, stores: &Stores) -> Result<Arc<dyn Catalog>, IcebergError> {
    static OPEN: LazyLock<Mutex<HashMap<String, Arc<dyn Catalog>>>> =
        LazyLock::new(Default::default);
    let key = serde_json::to_string(spec).unwrap_or_default();
    if let Some(catalog) = OPEN
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .get(&key)
        .cloned()
    {
        return Ok(catalog);
    }
    let catalog: Arc<dyn Catalog> = match spec {
        CatalogSpec::Sql { uri, warehouse, .. } => {
            let props = HashMap::from([
                ("uri".to_string(), sqlite_uri(uri)),
                ("warehouse".to_string(), warehouse.clone()),
                (
                    "sql_bind_style".to_string(),
                    SqlBindStyle::QMark.to_string(),
                ),
            ]);
            load(SqlCatalogBuilder::default(), spec, props, stores).await?
        }
        CatalogSpec::Rest {
            uri,
            warehouse,
            token_env,
            credential_env,
            oauth2_server_uri,
            scope,
            properties,
        } => {
            let mut props: HashMap<String, String> = properties.clone().into_iter().collect();
            props.insert("uri".to_string(), uri.trim_end_matches('/').to_string());
            if let Some(w) = warehouse {
                props.insert("warehouse".to_string(), w.clone());
            }
            if let Some(var) = token_env {
                props.insert("token".to_string(), secret(spec, "bearer token", var)?);
            }
            if let Some(var) = credential_env {
                props.insert(
                    "credential".to_string(),
                    secret(spec, "OAuth2 client credentials", var)?,
                );
            }
            if let Some(o) = oauth2_server_uri {
                props.insert("oauth2-server-uri".to_string(), o.clone());
            }
            if let Some(s) = scope {
                props.insert("scope".to_string(), s.clone());
            }
            // The REST client's rustls takes the process's provider:
            // aws-lc-rs, tonic's (an error means one is installed).
            let _ = tokio_rustls::rustls::crypto::aws_lc_rs::default_provider().install_default();
            load(RestCatalogBuilder::default(), spec, props, stores).await?
        }
    };
    OPEN.lock()
        .unwrap_or_else(|p| p.into_inner())
        .insert(key, Arc::clone(&catalog));
    Ok(catalog)
}

/// A catalog built with `props`, its files through stoke's stores.
async fn load<B>(
    builder: B,
    spec: &CatalogSpec,
    props: HashMap<String, String>,
    stores: &Stores,
) -> Result<Arc<dyn Catalog>, IcebergError>
where
    B: CatalogBuilder,
    B::C: 'static,
{
    let catalog = builder
        .with_storage_factory(Arc::new(StoreStorageFactory::new(stores.clone())))
        .load(spec.name(), props)
        .await
        .map_err(|source| IcebergError::Open {
            catalog: describe(spec),
            source: Box::new(source),
        })?;
    Ok(Arc::new(catalog))
}

/// A secret the spec names by its environment variable, as the
/// coordinator has it.
fn secret(spec: &CatalogSpec, what: &str, var: &str) -> Result<String, IcebergError> {
    match std::env::var(var) {
        Ok(value) if !value.is_empty() => Ok(value),
        _ => Err(IcebergError::Secret {
            catalog: describe(spec),
            what: what.to_string(),
            var: var.to_string(),
        }),
    }
}

/// The catalog as messages name it: its kind, name and URI.
pub fn describe(spec: &CatalogSpec) -> String {
    match spec {
        CatalogSpec::Sql { uri, .. } => format!("SQL catalog {} at {uri}", spec.name()),
        CatalogSpec::Rest { uri, .. } => format!("REST catalog at {uri}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn iceberg_reads_and_writes_through_stokes_stores() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file_root = format!("file://{}", dir.path().display());
        for root in ["memory:///wh".to_string(), file_root] {
            let storage = StoreStorageFactory::new(Stores::new())
                .build(&StorageConfig::new())
                .expect("storage");
            let path = format!("{root}/t/metadata/v1.json");
            assert!(!storage.exists(&path).await.expect("exists"));
            storage
                .write(&path, Bytes::from_static(b"0123456789"))
                .await
                .expect("write");
            assert!(storage.exists(&path).await.expect("exists"));
            assert_eq!(storage.metadata(&path).await.expect("meta").size, 10);
            let reader = storage.reader(&path).await.expect("reader");
            assert_eq!(reader.read(2..5).await.expect("range").as_ref(), b"234");
            let mut writer = storage
                .writer(&format!("{root}/t/data/a.parquet"))
                .await
                .expect("writer");
            writer.write(Bytes::from_static(b"ab")).await.expect("w");
            writer.write(Bytes::from_static(b"cd")).await.expect("w");
            writer.close().await.expect("close");
            assert!(writer.write(Bytes::from_static(b"x")).await.is_err());
            let a = format!("{root}/t/data/a.parquet");
            assert_eq!(storage.read(&a).await.expect("read").as_ref(), b"abcd");
            storage
                .delete_prefix(&format!("{root}/t"))
                .await
                .expect("delete prefix");
            assert!(!storage.exists(&path).await.expect("exists"));
            assert!(!storage.exists(&a).await.expect("exists"));
            let e = storage.read(&a).await.expect_err("gone");
            assert_eq!(e.kind(), ErrorKind::DataInvalid, "{e}");
            let e = storage
                .read("hdfs://nn/t")
                .await
                .expect_err("no such store");
            assert!(e.to_string().contains("hdfs://nn/t"), "{e}");
        }
    }

    #[tokio::test]
    async fn a_sql_catalog_keeps_its_tables_metadata_in_stokes_stores() {
        use iceberg::spec::{NestedField, PrimitiveType, Schema, Type};
        use iceberg::{NamespaceIdent, TableCreation};
        let dir = tempfile::tempdir().expect("tempdir");
        let stores = Stores::new();
        let spec = CatalogSpec::Sql {
            uri: format!("sqlite://{}/catalog.db", dir.path().display()),
            warehouse: "memory:///warehouse".to_string(),
            name: None,
        };
        let catalog = open(&spec, &stores).await.expect("catalog");
        let ns = NamespaceIdent::new("analytics".to_string());
        catalog
            .create_namespace(&ns, HashMap::new())
            .await
            .expect("namespace");
        let schema = Schema::builder()
            .with_fields(vec![Arc::new(NestedField::optional(
                1,
                "id",
                Type::Primitive(PrimitiveType::String),
            ))])
            .build()
            .expect("schema");
        let creation = TableCreation::builder()
            .name("t".to_string())
            .schema(schema)
            .build();
        let table = catalog.create_table(&ns, creation).await.expect("table");
        let location = table.metadata_location().expect("metadata location");
        assert!(
            location.starts_with("memory:///warehouse/analytics/t/metadata/"),
            "{location}"
        );
        let stored = stores
            .get(&StoreUri::parse(location).expect("uri"))
            .await
            .expect("the metadata file is in stoke's store");
        assert!(!stored.is_empty());
        // Opened again (the same spec), the catalog is the same one.
        let again = open(&spec, &stores).await.expect("catalog");
        assert!(Arc::ptr_eq(&catalog, &again));
        assert!(dir.path().join("catalog.db").exists());
    }
}
