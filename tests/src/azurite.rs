//! A real Azure Blob Storage server on loopback for the tests: Azurite,
//! Microsoft's emulator (from npm, installed by `scripts/azurite.sh` into
//! ~/.cache/stoke), serving a folder. stoke reaches it as it reaches Azure:
//! `az://container/...` URIs, an account name and key, and an endpoint.

use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use crate::s3::free_port;
use crate::{DEADLINE, Proc};

/// Azurite's well-known development account (the same in every copy of
/// the emulator; never a real account's).
pub const ACCOUNT: &str = "devstoreaccount1";
pub const ACCOUNT_KEY: &str =
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw==";

/// The folder Azurite and the Azure Blob SDK are installed in.
fn tools() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| crate::store_checks::installed("azurite.sh"))
}

/// One running Azurite blob service.
#[derive(Debug)]
pub struct Azurite {
    _proc: Proc,
    pub port: u16,
}

impl Azurite {
    /// Starts a blob service over `data` (created if missing), its log in
    /// `log_dir`.
    pub fn start(data: &Path, log_dir: &Path) -> Self {
        std::fs::create_dir_all(data).expect("azurite data folder");
        // Another process may take the port between probing and binding:
        // try a few.
        for _ in 0..5 {
            let port = free_port();
            let mut cmd = Command::new(tools().join("node_modules/.bin/azurite-blob"));
            cmd.arg("--blobHost")
                .arg("127.0.0.1")
                .arg("--blobPort")
                .arg(port.to_string())
                .arg("--location")
                .arg(data)
                .arg("--silent")
                // Whatever service version object_store's client asks for.
                .arg("--skipApiVersionCheck");
            let mut proc = Proc::spawn("azurite", cmd, log_dir);
            let end = std::time::Instant::now() + DEADLINE;
            loop {
                if TcpStream::connect(("127.0.0.1", port)).is_ok() {
                    return Self { _proc: proc, port };
                }
                if proc.child.try_wait().ok().flatten().is_some() || std::time::Instant::now() > end
                {
                    break;
                }
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
        }
        panic!("azurite did not start; see {}", log_dir.display());
    }

    /// The account's blob endpoint (path-style, as the emulator serves it).
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}/{ACCOUNT}", self.port)
    }

    /// Creates a container with the Azure Blob SDK (stoke never creates
    /// one: like a bucket, it is the deployment's).
    pub fn create_container(&self, name: &str) {
        let script = "const { BlobServiceClient } = require(process.argv[1]);\
            BlobServiceClient.fromConnectionString(process.argv[2])\
            .getContainerClient(process.argv[3]).create()\
            .catch(e => { console.error(e.message); process.exit(1); });";
        let connection = format!(
            "DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={ACCOUNT_KEY};BlobEndpoint={};",
            self.endpoint()
        );
        let out = Command::new("node")
            .arg("-e")
            .arg(script)
            .arg(tools().join("node_modules/@azure/storage-blob"))
            .arg(connection)
            .arg(name)
            .output()
            .expect("running node");
        assert!(
            out.status.success(),
            "creating container {name}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// The environment a stoke process needs to use this server.
    pub fn env(&self) -> Vec<(String, String)> {
        [
            ("AZURE_STORAGE_ACCOUNT_NAME", ACCOUNT.to_string()),
            ("AZURE_STORAGE_ACCOUNT_KEY", ACCOUNT_KEY.to_string()),
            ("STOKE_STORE_ENDPOINT", self.endpoint()),
            ("STOKE_STORE_ALLOW_HTTP", "true".to_string()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect()
    }
}
