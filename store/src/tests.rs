//! Stores: URIs, the memory and file stores, copies and writes in bulk.

use super::*;

#[test]
fn parse_and_join() {
    let u = StoreUri::parse("file:///tmp/root/").expect("uri");
    assert_eq!(
        u.join("jobs/j1/spec.json").as_str(),
        "file:///tmp/root/jobs/j1/spec.json"
    );
    assert_eq!(u.join("x").file_name(), "x");
    assert!(StoreUri::parse("ftp://x/y").is_err());
    assert!(StoreUri::parse("relative/path").is_err());
    let s = StoreUri::parse("s3://bucket/a/b").expect("s3");
    assert_eq!(crate::object_path(&s).expect("path").as_ref(), "a/b");
}

#[tokio::test]
async fn memory_store_is_shared_by_clones_and_create_only_holds() {
    let stores = Stores::new();
    let other = stores.clone();
    let uri = StoreUri::parse("memory:///a/b.json").expect("uri");
    stores
        .put_json_new(&uri, &serde_json::json!({"x": 1}))
        .await
        .expect("put");
    let back: Option<serde_json::Value> = other.get_json(&uri).await.expect("get");
    assert_eq!(back, Some(serde_json::json!({"x": 1})));
    let again = stores
        .put_json_new(&uri, &serde_json::json!({"x": 2}))
        .await;
    assert!(
        matches!(again, Err(StoreError::AlreadyExists { .. })),
        "{again:?}"
    );
    let listed = stores
        .list(&StoreUri::parse("memory:///a/").expect("uri"))
        .await
        .expect("list");
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].uri, uri);
}

#[tokio::test]
async fn copy_within_and_across_stores() {
    let dir = tempfile::tempdir().expect("tempdir");
    let root = StoreUri::from_local_path(dir.path()).expect("uri");
    let stores = Stores::new();
    let from = root.join("staging/s1/a1/part-0.parquet");
    stores
        .put(&from, Bytes::from_static(b"rows"))
        .await
        .expect("put");
    let to = root.join("outputs/s1/a1/part-0.parquet");
    stores.copy(&from, &to).await.expect("copy");
    // Again (a retried commit): same result.
    stores.copy(&from, &to).await.expect("copy again");
    stores.delete(&from).await.expect("delete staged");
    assert_eq!(
        stores.get(&to).await.expect("get"),
        Bytes::from_static(b"rows")
    );
    let mem = StoreUri::parse("memory:///o/part-0.parquet").expect("uri");
    stores.copy(&to, &mem).await.expect("copy to another store");
    assert_eq!(
        stores.get(&mem).await.expect("get"),
        Bytes::from_static(b"rows")
    );
    let missing = stores.copy(&root.join("staging/none"), &to).await;
    assert!(
        matches!(missing, Err(StoreError::NotFound { .. })),
        "{missing:?}"
    );
}

#[tokio::test]
async fn copy_all_links_local_pairs_replaces_others_and_reports_each() {
    let dir = tempfile::tempdir().expect("tempdir");
    let root = StoreUri::from_local_path(dir.path()).expect("uri");
    let stores = Stores::new();
    let staged = |i: usize| root.join(&format!("staging/s{i}/a1/part-0.parquet"));
    let out = |i: usize| root.join(&format!("outputs/s{i}/a1/part-0.parquet"));
    for i in 0..3 {
        stores
            .put(&staged(i), Bytes::from(format!("rows {i}")))
            .await
            .expect("put");
    }
    // s1's output already holds other bytes (a copy to be replaced).
    stores
        .put(&out(1), Bytes::from_static(b"stale"))
        .await
        .expect("put");
    let mem = StoreUri::parse("memory:///o/part-2.parquet").expect("uri");
    let pairs = vec![
        (staged(0), out(0)),
        (staged(1), out(1)),
        (root.join("staging/none/a1/part-0.parquet"), out(9)),
        (staged(2), mem.clone()),
    ];
    let results = stores.copy_all(&pairs, 4).await;
    assert!(
        results[0].is_ok() && results[1].is_ok() && results[3].is_ok(),
        "{results:?}"
    );
    assert!(
        matches!(results[2], Err(StoreError::NotFound { .. })),
        "{results:?}"
    );
    // Again (a retried group): the same, and nothing left beside them.
    let again = stores.copy_all(&pairs[..2], 4).await;
    assert!(again.iter().all(Result::is_ok), "{again:?}");
    for i in 0..3 {
        stores.delete(&staged(i)).await.expect("delete staged");
    }
    assert_eq!(
        stores.get(&out(0)).await.expect("get"),
        Bytes::from_static(b"rows 0")
    );
    assert_eq!(
        stores.get(&out(1)).await.expect("get"),
        Bytes::from_static(b"rows 1")
    );
    assert_eq!(
        stores.get(&mem).await.expect("get"),
        Bytes::from_static(b"rows 2")
    );
    let listed = stores.list(&root.join("outputs/")).await.expect("list");
    assert_eq!(listed.len(), 2, "{listed:?}");
    // A fenced store refuses every pair before touching anything.
    let fenced = stores.fenced(WriteFence::new("the test root"));
    let refused = fenced.copy_all(&pairs[..1], 4).await;
    assert!(
        matches!(refused[0], Err(StoreError::Fenced { .. })),
        "{refused:?}"
    );
}

#[tokio::test]
async fn put_all_writes_local_and_other_objects_and_leaves_no_temporaries() {
    let dir = tempfile::tempdir().expect("tempdir");
    let root = StoreUri::from_local_path(dir.path()).expect("uri");
    let stores = Stores::new();
    let a = root.join("jobs/j/progress/log-1.json");
    let b = root.join("jobs/k/progress/log-2.json");
    let m = StoreUri::parse("memory:///p/log-3.json").expect("uri");
    stores
        .put(&b, Bytes::from_static(b"old"))
        .await
        .expect("put");
    let items = vec![
        (a.clone(), Bytes::from_static(b"one")),
        (b.clone(), Bytes::from_static(b"two")),
        (m.clone(), Bytes::from_static(b"three")),
    ];
    let results = stores.put_all(items.clone(), 4).await;
    assert!(results.iter().all(Result::is_ok), "{results:?}");
    assert_eq!(
        stores.get(&a).await.expect("get"),
        Bytes::from_static(b"one")
    );
    assert_eq!(
        stores.get(&b).await.expect("get"),
        Bytes::from_static(b"two")
    );
    assert_eq!(
        stores.get(&m).await.expect("get"),
        Bytes::from_static(b"three")
    );
    // Only the objects themselves are on disk: no temporary left.
    let mut files = Vec::new();
    for entry in walk(dir.path()) {
        files.push(entry);
    }
    files.sort();
    assert_eq!(files.len(), 2, "{files:?}");
    let fenced = stores.fenced(WriteFence::new("the test root"));
    let refused = fenced.put_all(items[..1].to_vec(), 4).await;
    assert!(
        matches!(refused[0], Err(StoreError::Fenced { .. })),
        "{refused:?}"
    );
}

/// Every file under `dir`.
fn walk(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).expect("read_dir").flatten() {
        let path = entry.path();
        if path.is_dir() {
            out.extend(walk(&path));
        } else {
            out.push(path);
        }
    }
    out
}

#[tokio::test]
async fn file_store_lists_a_single_object_and_create_only_holds() {
    let dir = tempfile::tempdir().expect("tempdir");
    let root = StoreUri::from_local_path(dir.path()).expect("uri");
    let stores = Stores::new();
    let obj = root.join("x/1.bin");
    stores
        .put_new(&obj, Bytes::from_static(b"abc"))
        .await
        .expect("put");
    assert!(matches!(
        stores.put_new(&obj, Bytes::from_static(b"def")).await,
        Err(StoreError::AlreadyExists { .. })
    ));
    assert_eq!(stores.list(&obj).await.expect("list").len(), 1);
    assert_eq!(
        stores.list(&root.join("x/")).await.expect("list")[0].uri,
        obj
    );
    assert!(
        stores
            .list(&root.join("nothing"))
            .await
            .expect("list")
            .is_empty()
    );
    assert_eq!(
        stores.get(&obj).await.expect("get"),
        Bytes::from_static(b"abc")
    );
}

#[tokio::test]
async fn get_all_reads_local_and_other_objects_in_order_and_names_a_missing_one() {
    let dir = tempfile::tempdir().expect("tempdir");
    let root = StoreUri::from_local_path(dir.path()).expect("uri");
    let stores = Stores::new();
    let a = root.join("data/a.png");
    let b = root.join("data/b.png");
    stores
        .put(&a, Bytes::from_static(b"alpha"))
        .await
        .expect("put");
    stores
        .put(&b, Bytes::from_static(b"beta"))
        .await
        .expect("put");
    // All local: the fast path, in the order asked for.
    let bodies = stores
        .get_all(&[b.clone(), a.clone(), b.clone()])
        .await
        .expect("get_all");
    assert_eq!(bodies, vec![&b"beta"[..], &b"alpha"[..], &b"beta"[..]]);
    // A folder is no object: the general path says so, as `get` does.
    let folder = root.join("data");
    let err = stores.get_all(&[a.clone(), folder.clone()]).await;
    assert!(err.is_err(), "{err:?}");
    // A missing object is named, as `get` names it.
    let missing = root.join("data/missing.png");
    match stores.get_all(&[a.clone(), missing.clone()]).await {
        Err(StoreError::NotFound { uri }) => assert_eq!(uri, missing.as_str()),
        other => panic!("expected NotFound for {missing:?}, got {other:?}"),
    }
    // Another store: the general path.
    let m = StoreUri::parse("memory:///d/c.png").expect("uri");
    stores
        .put(&m, Bytes::from_static(b"gamma"))
        .await
        .expect("put");
    let bodies = stores
        .get_all(&[m.clone(), a.clone()])
        .await
        .expect("get_all");
    assert_eq!(bodies, vec![&b"gamma"[..], &b"alpha"[..]]);
}
