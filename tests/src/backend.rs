//! The storage a test runs on: a `file://` root in a temporary folder, a
//! bucket on a real S3 server ([`crate::s3`]), or a container on a real
//! Azure Blob server ([`crate::azurite`]), holding the state root, the
//! fixture's data and model, and every output. Tests written against
//! [`TestEnv`] run on all three (see [`crate::backend_tests`]).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Output;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Mutex, OnceLock};

use bytes::Bytes;
use stoke_core::records::{Manifest, ProgressRecord};
use stoke_store::{StoreConfig, StoreUri, Stores};

use crate::azurite::{ACCOUNT, ACCOUNT_KEY, Azurite};
use crate::s3::{ACCESS_KEY, S3Server, SECRET_KEY};
use crate::{Coordinator, file_uri, fixture, stoke_cli_env, summary_field, text, uri_path};

/// Which storage a [`TestEnv`] uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    File,
    S3,
    Azure,
}

/// Stores for reading each test bucket from the test process, by bucket.
fn buckets() -> &'static Mutex<HashMap<String, Stores>> {
    static BUCKETS: OnceLock<Mutex<HashMap<String, Stores>>> = OnceLock::new();
    BUCKETS.get_or_init(Mutex::default)
}

fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("runtime")
    })
}

/// The stores that reach `uri` from the test process.
fn stores_for(uri: &str) -> Stores {
    let parsed = StoreUri::parse(uri).unwrap_or_else(|e| panic!("{uri}: {e}"));
    if parsed.scheme() == "file" {
        return Stores::new();
    }
    buckets()
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .get(parsed.authority())
        .cloned()
        .unwrap_or_else(|| panic!("{uri}: not a bucket of this test process"))
}

/// The bytes of an object, by URI (`file://` or a test bucket's `s3://`).
pub fn read_object(uri: &str) -> Vec<u8> {
    let stores = stores_for(uri);
    let parsed = StoreUri::parse(uri).expect("uri");
    runtime()
        .block_on(stores.get(&parsed))
        .unwrap_or_else(|e| panic!("reading {uri}: {e}"))
        .to_vec()
}

/// A test's storage, temporary folder and (for S3) server.
#[derive(Debug)]
pub struct TestEnv {
    pub backend: Backend,
    tmp: tempfile::TempDir,
    /// The S3 server (for S3 tests).
    pub s3: Option<S3Server>,
    /// The Azure Blob server (for Azure tests).
    pub azurite: Option<Azurite>,
    bucket: String,
    stores: Stores,
}

impl TestEnv {
    pub fn new(backend: Backend) -> Self {
        let tmp = tempfile::tempdir().expect("tempdir");
        match backend {
            Backend::File => Self {
                backend,
                tmp,
                s3: None,
                azurite: None,
                bucket: String::new(),
                stores: Stores::new(),
            },
            Backend::S3 => {
                let server = S3Server::start(&tmp.path().join("s3-data"), tmp.path());
                let bucket = Self::bucket_name();
                server.create_bucket(&bucket);
                let stores = Self::s3_stores(tmp.path(), &server.endpoint());
                buckets()
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(bucket.clone(), stores.clone());
                let env = Self {
                    backend,
                    tmp,
                    s3: Some(server),
                    azurite: None,
                    bucket,
                    stores,
                };
                env.upload_fixture();
                env
            }
            Backend::Azure => {
                let server = Azurite::start(&tmp.path().join("azure-data"), tmp.path());
                let container = Self::bucket_name();
                server.create_container(&container);
                let stores = Self::azure_stores(tmp.path(), &server.endpoint());
                buckets()
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(container.clone(), stores.clone());
                let env = Self {
                    backend,
                    tmp,
                    s3: None,
                    azurite: Some(server),
                    bucket: container,
                    stores,
                };
                env.upload_fixture();
                env
            }
        }
    }

    /// A bucket (or container) name of its own for each test.
    fn bucket_name() -> String {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        format!(
            "stoke-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        )
    }

    /// Stores for the test process on Azurite, the account's key in a
    /// credentials file (`az://` takes `key = value` lines).
    fn azure_stores(dir: &Path, endpoint: &str) -> Stores {
        let creds = dir.join("azure-credentials");
        std::fs::write(
            &creds,
            format!(
                "azure_storage_account_name = {ACCOUNT}\nazure_storage_account_key = {ACCOUNT_KEY}\n"
            ),
        )
        .expect("credentials file");
        Stores::with_config(StoreConfig {
            endpoint: Some(endpoint.to_string()),
            allow_http: true,
            credentials_file: Some(creds),
            ..StoreConfig::default()
        })
    }

    /// Stores for the test process, with the test credentials in a
    /// credentials file (the test process's own environment has none).
    fn s3_stores(dir: &Path, endpoint: &str) -> Stores {
        let creds = dir.join("aws-credentials");
        std::fs::write(
            &creds,
            format!(
                "[default]\naws_access_key_id = {ACCESS_KEY}\naws_secret_access_key = {SECRET_KEY}\n"
            ),
        )
        .expect("credentials file");
        Stores::with_config(StoreConfig {
            endpoint: Some(endpoint.to_string()),
            allow_http: true,
            region: Some("us-east-1".to_string()),
            credentials_file: Some(creds),
            ..StoreConfig::default()
        })
    }

    fn upload_fixture(&self) {
        let fx = fixture();
        let mut files = Vec::new();
        for folder in ["parquet", "jsonl", "long"] {
            for path in crate::files_under(&fx.join(folder)) {
                files.push(path);
            }
        }
        files.push(fx.join("model.pt"));
        for path in files {
            let rel = path.strip_prefix(fx).expect("under the fixture");
            let uri = format!("{}/{}", self.fixture_base(), rel.display());
            self.put(&uri, std::fs::read(&path).expect("fixture file"));
        }
    }

    /// Writes an object (to the bucket, or a file).
    pub fn put(&self, uri: &str, bytes: Vec<u8>) {
        let parsed = StoreUri::parse(uri).expect("uri");
        runtime()
            .block_on(self.stores.put(&parsed, Bytes::from(bytes)))
            .unwrap_or_else(|e| panic!("writing {uri}: {e}"));
    }

    /// The temporary folder for specs and logs.
    pub fn dir(&self) -> &Path {
        self.tmp.path()
    }

    /// Where data for this test lives: a folder URI or `s3://bucket`.
    fn base(&self) -> String {
        match self.backend {
            Backend::File => file_uri(self.tmp.path()),
            Backend::S3 => format!("s3://{}", self.bucket),
            Backend::Azure => format!("az://{}", self.bucket),
        }
    }

    fn fixture_base(&self) -> String {
        match self.backend {
            Backend::File => file_uri(fixture()),
            Backend::S3 => format!("s3://{}/fixture", self.bucket),
            Backend::Azure => format!("az://{}/fixture", self.bucket),
        }
    }

    /// A URI for `name` in this test's storage.
    pub fn uri(&self, name: &str) -> String {
        format!("{}/{name}", self.base())
    }

    /// A URI for `name` as table formats want it: on Azure, Azure's own
    /// spelling (`abfss://container@account.dfs.core.windows.net/...`),
    /// which Iceberg engines read; elsewhere [`TestEnv::uri`].
    pub fn table_uri(&self, name: &str) -> String {
        match self.backend {
            Backend::Azure => format!(
                "abfss://{}@{}.dfs.core.windows.net/{name}",
                self.bucket,
                crate::azurite::ACCOUNT
            ),
            _ => self.uri(name),
        }
    }

    /// A URI in the fixture (`parquet/`, `model.pt`, ...).
    pub fn fixture_uri(&self, rel: &str) -> String {
        format!("{}/{rel}", self.fixture_base())
    }

    /// The state root.
    pub fn root(&self) -> String {
        self.uri("root")
    }

    /// The environment stoke processes need to reach this storage.
    pub fn store_env(&self) -> Vec<(String, String)> {
        match (&self.s3, &self.azurite) {
            (Some(server), _) => S3Server::env_for(&server.endpoint()),
            (None, Some(server)) => server.env(),
            (None, None) => Vec::new(),
        }
    }

    /// A torchscript spec over the fixture, in this storage.
    pub fn spec(&self, format: &str, extra: &str) -> String {
        self.spec_in(format, format, extra)
    }

    pub fn spec_in(&self, format: &str, folder: &str, extra: &str) -> String {
        crate::fixture_model_spec(
            format,
            format!("{}/", self.fixture_uri(folder)),
            self.fixture_uri("model.pt"),
            extra,
        )
        .toml()
    }

    /// Writes a spec file into the test folder; returns its path.
    pub fn write_spec(&self, name: &str, text: &str) -> String {
        let path = self.dir().join(name);
        std::fs::write(&path, text).expect("write spec");
        path.display().to_string()
    }

    /// A coordinator on this storage's root. On S3 its root lease is short,
    /// so a test that kills and restarts it waits little for the lease.
    pub fn coordinator(&self, extra: &[&str]) -> Coordinator {
        self.coordinator_with_env(extra, &[])
    }

    pub fn coordinator_with_env(&self, extra: &[&str], env: &[(&str, &str)]) -> Coordinator {
        let mut flags: Vec<&str> = extra.to_vec();
        if self.backend != Backend::File && !flags.contains(&"--root-lock-ttl") {
            flags.extend(["--root-lock-ttl", "2s"]);
        }
        Coordinator::start_on(&self.root(), self.dir(), &flags, env, self.store_env())
    }

    /// `stoke run SPEC <mode> --device DEVICE --threads 1 --root ROOT` with
    /// this storage's settings (`mode`: `--embedded`, `--local N`).
    pub fn stoke_run(&self, spec: &str, mode: &[&str], device: &str, root: &str) -> Output {
        let mut args = vec!["run", spec];
        args.extend_from_slice(mode);
        args.extend(["--device", device, "--threads", "1", "--root", root]);
        self.cli(&args)
    }

    /// [`Self::stoke_run`] on the CPU, which must succeed; returns the job
    /// id from its summary.
    pub fn stoke_run_ok(&self, spec: &str, mode: &[&str], root: &str) -> String {
        let out = self.stoke_run(spec, mode, "cpu", root);
        let stdout = text(&out.stdout);
        assert!(
            out.status.success(),
            "stoke run {spec}: {stdout}\n{}",
            text(&out.stderr)
        );
        summary_field(&stdout, "job").unwrap_or_else(|| panic!("no job id in {stdout}"))
    }

    /// Runs the CLI (not bound to a coordinator) with this storage's settings.
    pub fn cli(&self, args: &[&str]) -> Output {
        stoke_cli_env(args, &self.store_env())
    }

    fn get_json<T: serde::de::DeserializeOwned>(&self, uri: &str) -> Option<T> {
        let parsed = StoreUri::parse(uri).expect("uri");
        runtime()
            .block_on(self.stores.get_json(&parsed))
            .unwrap_or_else(|e| panic!("reading {uri}: {e}"))
    }

    /// The manifest of a job under `root` (a root URI of this storage).
    pub fn manifest_in(&self, root: &str, job_id: &str) -> Manifest {
        let uri = format!("{root}/jobs/{job_id}/manifest.json");
        self.get_json(&uri)
            .unwrap_or_else(|| panic!("no manifest at {uri}"))
    }

    pub fn manifest(&self, job_id: &str) -> Manifest {
        self.manifest_in(&self.root(), job_id)
    }

    /// A shard's committed progress, if written yet.
    pub fn progress(&self, job_id: &str, shard_id: &str) -> Option<ProgressRecord> {
        let root = StoreUri::parse(&self.root()).expect("root uri");
        let layout = stoke_core::layout::RootLayout::new(root).job(job_id);
        runtime()
            .block_on(stoke_core::progress::load(&self.stores, &layout))
            .ok()
            .and_then(|mut stored| stored.records.remove(shard_id))
    }

    /// Every object under a prefix URI, sorted.
    pub fn list(&self, prefix: &str) -> Vec<String> {
        let parsed = StoreUri::parse(prefix).expect("uri");
        runtime()
            .block_on(self.stores.list(&parsed))
            .unwrap_or_else(|e| panic!("listing {prefix}: {e}"))
            .into_iter()
            .map(|l| l.uri.to_string())
            .collect()
    }

    /// True when the object exists.
    pub fn exists(&self, uri: &str) -> bool {
        let parsed = StoreUri::parse(uri).expect("uri");
        runtime().block_on(self.stores.size(&parsed)).is_ok()
    }

    /// Checks that no log under the test folder holds the store's secret
    /// key (processes log URIs and errors, never credentials).
    pub fn assert_no_secrets_in_logs(&self) {
        let mut checked = 0;
        for path in crate::files_under(self.dir()) {
            if path.extension().is_some_and(|e| e == "log") {
                let text = std::fs::read_to_string(&path).unwrap_or_default();
                assert!(
                    !text.contains(SECRET_KEY),
                    "{} contains the S3 secret key",
                    path.display()
                );
                assert!(
                    !text.contains(ACCOUNT_KEY),
                    "{} contains the Azure account key",
                    path.display()
                );
                checked += 1;
            }
        }
        assert!(
            checked > 0,
            "no logs to check under {}",
            self.dir().display()
        );
    }

    /// The stores the test process reaches this storage with.
    pub fn stores(&self) -> &Stores {
        &self.stores
    }

    /// Runs a store call on the harness's runtime.
    pub fn block_on<F: std::future::Future>(&self, f: F) -> F::Output {
        runtime().block_on(f)
    }

    /// A local path for a `file://` URI (file backend only).
    pub fn local_path(&self, uri: &str) -> PathBuf {
        uri_path(uri)
    }
}

impl Drop for TestEnv {
    fn drop(&mut self) {
        // A failed test keeps its folder (logs, specs, S3 data) for a look.
        if std::thread::panicking() {
            let Ok(spare) = tempfile::tempdir() else {
                return;
            };
            let kept = std::mem::replace(&mut self.tmp, spare).keep();
            eprintln!("test files kept in {}", kept.display());
        }
    }
}

/// Writes each test once per backend: `mod file { #[test] fn name() }`,
/// `mod s3 { ... }` and `mod azure { ... }`, the body getting `env: TestEnv` of that backend.
#[macro_export]
macro_rules! backend_tests {
    ($(fn $name:ident($env:ident) $body:block)*) => {
        mod file {
            #[allow(unused_imports)]
            use super::*;
            $(
                #[test]
                fn $name() {
                    let $env = $crate::TestEnv::new($crate::Backend::File);
                    $body
                }
            )*
        }
        mod s3 {
            #[allow(unused_imports)]
            use super::*;
            $(
                #[test]
                fn $name() {
                    let $env = $crate::TestEnv::new($crate::Backend::S3);
                    $body
                }
            )*
        }
        mod azure {
            #[allow(unused_imports)]
            use super::*;
            $(
                #[test]
                fn $name() {
                    let $env = $crate::TestEnv::new($crate::Backend::Azure);
                    $body
                }
            )*
        }
    };
}
