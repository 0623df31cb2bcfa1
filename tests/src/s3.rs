//! A real S3-protocol server on loopback for the tests: `s3s-fs` (from
//! crates.io, installed by `scripts/s3-server.sh` into ~/.cache/stoke),
//! serving a folder. It can be stopped and started again on the same port
//! and folder, as an outage and recovery.

use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use crate::{DEADLINE, Proc, wait_until};

pub const ACCESS_KEY: &str = "stoke-test-key";
pub const SECRET_KEY: &str = "stoke-test-secret-0123456789";

/// The s3s-fs binary, installed on first use.
pub fn s3s_fs() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| crate::store_checks::installed("s3-server.sh"))
}

/// A free TCP port on 127.0.0.1 (bound and released).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// One running (or stopped) S3 server.
#[derive(Debug)]
pub struct S3Server {
    proc: Option<Proc>,
    pub data: PathBuf,
    pub port: u16,
    log_dir: PathBuf,
    starts: u32,
}

impl S3Server {
    /// Starts a server over `data` (created if missing).
    pub fn start(data: &Path, log_dir: &Path) -> Self {
        std::fs::create_dir_all(data).expect("s3 data folder");
        let mut server = Self {
            proc: None,
            data: data.to_path_buf(),
            port: 0,
            log_dir: log_dir.to_path_buf(),
            starts: 0,
        };
        // Another process may take the port between probing and binding:
        // try a few.
        for _ in 0..5 {
            server.port = free_port();
            if server.try_start() {
                return server;
            }
        }
        panic!("s3s-fs did not start; see {}", log_dir.display());
    }

    fn try_start(&mut self) -> bool {
        let mut cmd = Command::new(s3s_fs());
        cmd.arg("--host")
            .arg("127.0.0.1")
            .arg("--port")
            .arg(self.port.to_string())
            .arg("--access-key")
            .arg(ACCESS_KEY)
            .arg("--secret-key")
            .arg(SECRET_KEY)
            .arg(&self.data)
            .env("RUST_LOG", "warn");
        let name = format!("s3-{}", self.starts);
        self.starts += 1;
        let mut proc = Proc::spawn(&name, cmd, &self.log_dir);
        let end = std::time::Instant::now() + DEADLINE;
        loop {
            if TcpStream::connect(("127.0.0.1", self.port)).is_ok() {
                self.proc = Some(proc);
                return true;
            }
            if proc.child.try_wait().ok().flatten().is_some() || std::time::Instant::now() > end {
                return false;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }

    /// Stops the server (SIGKILL): requests fail until [`S3Server::resume`].
    pub fn stop(&mut self) {
        if let Some(mut proc) = self.proc.take() {
            let _ = proc.child.kill();
            let _ = proc.child.wait();
        }
        wait_until("the S3 port to close", DEADLINE, || {
            TcpStream::connect(("127.0.0.1", self.port))
                .is_err()
                .then_some(())
        });
    }

    /// Starts the server again on the same port and folder.
    pub fn resume(&mut self) {
        assert!(self.proc.is_none(), "the S3 server already runs");
        let ok = (0..20).any(|_| {
            self.try_start() || {
                std::thread::sleep(std::time::Duration::from_millis(100));
                false
            }
        });
        assert!(ok, "s3s-fs did not start again on port {}", self.port);
    }

    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Creates a bucket (a folder of the server's data).
    pub fn create_bucket(&self, name: &str) {
        std::fs::create_dir_all(self.data.join(name)).expect("bucket folder");
    }

    /// The environment a stoke process needs to use this server at
    /// `endpoint` (this server's, or a proxy's in front of it).
    pub fn env_for(endpoint: &str) -> Vec<(String, String)> {
        [
            ("AWS_ACCESS_KEY_ID", ACCESS_KEY),
            ("AWS_SECRET_ACCESS_KEY", SECRET_KEY),
            ("AWS_REGION", "us-east-1"),
            ("STOKE_STORE_ENDPOINT", endpoint),
            ("STOKE_STORE_ALLOW_HTTP", "true"),
        ]
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
    }
}
