//! Checks every real store server gets alike (`s3.rs`, `azure.rs`): the
//! conditional writes stoke's durable state relies on, and one coordinator
//! per state root.

use std::path::PathBuf;
use std::process::Command;

use bytes::Bytes;
use stoke_store::{StoreError, StoreUri};

use crate::{DEADLINE, Proc, TestEnv, assert_matches_reference, bin, committed_rows, repo_root};

/// Runs an install script of `scripts/` (idempotent) and returns the path
/// it prints: the installed tool, or the folder it is in.
pub fn installed(script: &str) -> PathBuf {
    let out = Command::new(repo_root().join("scripts").join(script))
        .output()
        .unwrap_or_else(|e| panic!("running scripts/{script}: {e}"));
    assert!(
        out.status.success(),
        "scripts/{script} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
}

/// Create-only refuses an existing object; compare-and-swap succeeds on
/// the current version only; the read gives the swapped bytes and version.
pub fn assert_conditional_writes(env: &TestEnv) {
    let stores = env.stores();
    let uri = StoreUri::parse(&env.uri("cas/record.json")).expect("uri");
    let v1 = env
        .block_on(stores.put_new_versioned(&uri, Bytes::from_static(b"1")))
        .expect("create");
    // Create-only (If-None-Match: *) refuses an existing object.
    let again = env.block_on(stores.put_new_versioned(&uri, Bytes::from_static(b"x")));
    assert!(
        matches!(again, Err(StoreError::AlreadyExists { .. })),
        "{again:?}"
    );
    // Compare-and-swap (If-Match) succeeds on the current version only.
    let v2 = env
        .block_on(stores.put_if(&uri, Bytes::from_static(b"2"), &v1))
        .expect("swap on the current version");
    assert_ne!(v1, v2);
    let stale = env.block_on(stores.put_if(&uri, Bytes::from_static(b"3"), &v1));
    assert!(
        matches!(stale, Err(StoreError::Conflict { .. })),
        "{stale:?}"
    );
    let (bytes, version) = env
        .block_on(stores.get_versioned(&uri))
        .expect("read")
        .expect("exists");
    assert_eq!(bytes, Bytes::from_static(b"2"));
    assert_eq!(version.e_tag, v2.e_tag);
}

/// A second coordinator on the root is refused, naming the holder; after a
/// kill -9 of the first, the restarted one waits out the lease (2 s in
/// tests), takes the root over and runs the job at `spec` exactly once.
pub fn assert_one_coordinator_per_root(env: &TestEnv, spec: &str) {
    let mut first = env.coordinator(&[]);
    let mut cmd = Command::new(bin("stoke-coordinator"));
    cmd.args(["--listen", "127.0.0.1:0", "--http-listen", "off", "--root"])
        .arg(env.root())
        .envs(env.store_env());
    let mut second = Proc::spawn("second-coordinator", cmd, env.dir());
    let status = second.wait_exit(DEADLINE);
    assert!(!status.success());
    let log = second.log_text();
    let holder = first.addr.trim_start_matches("http://");
    assert!(
        log.contains("is held by another coordinator") && log.contains(holder),
        "{log}"
    );
    first.restart(&[]);
    let job_id = first.submit(spec);
    let _w = first.worker("stoke-worker", "w1", env.dir());
    first.wait_success(&job_id);
    assert!(
        first.proc.log_text().contains("took over the state root"),
        "{}",
        first.proc.log_text()
    );
    assert_matches_reference(&committed_rows(&env.manifest(&job_id)));
    env.assert_no_secrets_in_logs();
}
