//! stoke on a real Azure Blob server (Azurite on loopback): the
//! conditional writes stoke's durable state relies on, objects put in
//! blocks, and one coordinator per state root. The end-to-end, Delta and `.pt2`
//! suites run on it too (`backend_tests!`).

use std::process::Command;

use bytes::Bytes;
use stoke_store::{StoreConfig, StoreError, StoreUri, Stores};
use stoke_tests::*;

#[test]
fn the_server_honours_the_conditional_writes_stoke_relies_on() {
    let env = TestEnv::new(Backend::Azure);
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
    // A copy that must not replace an object refuses an existing one.
    let to = StoreUri::parse(&env.uri("cas/copy.json")).expect("uri");
    env.block_on(stores.copy(&uri, &to)).expect("copy");
    assert_eq!(
        env.block_on(stores.get(&to)).expect("read copy"),
        Bytes::from_static(b"2")
    );
}

#[test]
fn large_objects_past_the_multipart_threshold_read_back_whole() {
    let env = TestEnv::new(Backend::Azure);
    let server = env.azurite.as_ref().expect("server");
    let stores = Stores::with_config(StoreConfig {
        endpoint: Some(server.endpoint()),
        allow_http: true,
        credentials_file: Some(env.dir().join("azure-credentials")),
        multipart_threshold: 6 * 1024 * 1024,
        part_size: 5 * 1024 * 1024,
        ..StoreConfig::default()
    });
    let big: Vec<u8> = (0..12 * 1024 * 1024u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 24) as u8)
        .collect();
    let uri = StoreUri::parse(&env.uri("big/object.bin")).expect("uri");
    env.block_on(stores.put(&uri, Bytes::from(big.clone())))
        .expect("multipart put");
    assert_eq!(read_object(uri.as_str()), big);
}

/// The state root's lease is conditional writes on the store: on Azure as
/// on S3, a second coordinator is refused, and a crashed one's root is
/// taken over once its lease runs out; the job then runs exactly once.
#[test]
fn a_second_coordinator_is_refused_and_a_crashed_ones_root_is_taken_over() {
    let env = TestEnv::new(Backend::Azure);
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
    let spec = env.write_spec("job.toml", &env.spec("parquet", ""));
    let job_id = first.submit(&spec);
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
