//! stoke on a real Azure Blob server (Azurite on loopback): the
//! conditional writes stoke's durable state relies on, objects put in
//! blocks, and one coordinator per state root. The end-to-end, Delta and `.pt2`
//! suites run on it too (`backend_tests!`).

use bytes::Bytes;
use stoke_store::{StoreConfig, StoreUri, Stores};
use stoke_tests::*;

#[test]
fn the_server_honours_the_conditional_writes_stoke_relies_on() {
    let env = TestEnv::new(Backend::Azure);
    store_checks::assert_conditional_writes(&env);
    // A server-side copy to a fresh key holds the source's bytes; over an
    // existing key it replaces it (`Stores::copy` replaces by design: a
    // commit retried after a lost answer copies again to the same name).
    let stores = env.stores();
    let uri = StoreUri::parse(&env.uri("cas/record.json")).expect("uri");
    let to = StoreUri::parse(&env.uri("cas/copy.json")).expect("uri");
    env.block_on(stores.copy(&uri, &to)).expect("copy");
    assert_eq!(
        env.block_on(stores.get(&to)).expect("read copy"),
        Bytes::from_static(b"2")
    );
    env.block_on(stores.put(&to, Bytes::from_static(b"other")))
        .expect("overwrite the copy");
    env.block_on(stores.copy(&uri, &to)).expect("copy again");
    assert_eq!(
        env.block_on(stores.get(&to)).expect("read copy"),
        Bytes::from_static(b"2")
    );
}

/// Azure's own URI spelling, `abfss://container@account.dfs.core.windows.net/`
/// (what Iceberg tables on Azure are located by), names the same objects
/// as stoke's `az://container/`.
#[test]
fn an_abfss_uri_names_the_objects_of_its_az_uri() {
    let env = TestEnv::new(Backend::Azure);
    let stores = env.stores();
    let az = StoreUri::parse(&env.uri("spelling/a.txt")).expect("az uri");
    let abfss = StoreUri::parse(&env.table_uri("spelling/a.txt")).expect("abfss uri");
    assert_eq!(abfss.scheme(), "abfss");
    env.block_on(stores.put(&abfss, Bytes::from_static(b"written as abfss")))
        .expect("put through abfss");
    assert_eq!(
        env.block_on(stores.get(&az)).expect("read through az"),
        Bytes::from_static(b"written as abfss")
    );
    let folder = StoreUri::parse(&env.table_uri("spelling/")).expect("folder");
    let listed = env.block_on(stores.list(&folder)).expect("list");
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert!(listed[0].uri.as_str().starts_with("abfss://"), "{listed:?}");
    // A container without its account is refused, saying the spelling.
    let err = StoreUri::parse(&format!("abfss://{}/x", az.authority())).expect_err("no account");
    assert!(
        err.to_string().contains("@account.dfs.core.windows.net"),
        "{err}"
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
    let spec = env.write_spec("job.toml", &env.spec("parquet", ""));
    store_checks::assert_one_coordinator_per_root(&env, &spec);
}
