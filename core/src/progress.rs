//! Reading a job's committed progress back from its state root.
//!
//! The coordinator stores progress records in groups: each group commit
//! writes one `progress/log-<seq>.json` with the records of every commit in
//! it, and from time to time a `progress/snapshot-<seq>.json` with the
//! latest record of every shard, after which the logs it covers are
//! deleted. A shard's current progress is its record with the highest
//! `seq`, wherever it is: a crash between writing a snapshot and deleting
//! the logs it replaces leaves both, and nothing changes.

use std::collections::HashMap;

#[cfg(feature = "io")]
use futures::StreamExt;

#[cfg(feature = "io")]
use crate::layout::JobLayout;
#[cfg(feature = "io")]
use crate::records::ProgressLog;
use crate::records::ProgressRecord;
#[cfg(feature = "io")]
use stoke_store::{StoreError, Stores};
use stoke_uri::StoreUri;

/// How many progress objects are read at once.
#[cfg(feature = "io")]
const READ_CONCURRENCY: usize = 32;

/// What a job's `progress/` folder holds.
#[derive(Debug, Default)]
pub struct StoredProgress {
    /// Each shard's latest record, by shard id.
    pub records: HashMap<String, ProgressRecord>,
    /// Every progress object read, oldest first by name: what the next
    /// snapshot replaces.
    pub objects: Vec<StoreUri>,
}

/// Decodes one progress object: a log or snapshot, or a single record (as
/// written per shard before group commits, with no `seq`: it gets 1, older
/// than any record written since, which all have an epoch in their high
/// bits; a stored record always has a `seq` above 0, which is how the
/// coordinator tells shards with a record from those without).
#[cfg(feature = "io")]
pub fn decode(uri: &StoreUri, bytes: &[u8]) -> Result<Vec<ProgressRecord>, StoreError> {
    let records = match serde_json::from_slice::<ProgressLog>(bytes) {
        Ok(log) => log.records,
        Err(log_error) => match serde_json::from_slice::<ProgressRecord>(bytes) {
            Ok(record) => vec![record],
            Err(_) => {
                return Err(StoreError::Decode {
                    uri: uri.to_string(),
                    source: log_error,
                });
            }
        },
    };
    Ok(records
        .into_iter()
        .map(|r| ProgressRecord {
            seq: r.seq.max(1),
            ..r
        })
        .collect())
}

/// Keeps `record` if it is newer than what `records` has for its shard.
pub fn merge(records: &mut HashMap<String, ProgressRecord>, record: ProgressRecord) {
    match records.get(&record.shard_id) {
        Some(existing) if existing.seq > record.seq => {}
        _ => {
            records.insert(record.shard_id.clone(), record);
        }
    }
}

/// Reads every progress object of a job (concurrently) and keeps each
/// shard's latest record.
#[cfg(feature = "io")]
pub async fn load(stores: &Stores, layout: &JobLayout) -> Result<StoredProgress, StoreError> {
    let listed = stores.list(&layout.progress_dir()).await?;
    let mut reads = futures::stream::iter(listed.into_iter().map(|l| {
        let stores = stores.clone();
        async move {
            let bytes = stores.get(&l.uri).await?;
            let records = decode(&l.uri, &bytes)?;
            Ok::<_, StoreError>((l.uri, records))
        }
    }))
    .buffered(READ_CONCURRENCY);
    let mut stored = StoredProgress::default();
    while let Some(read) = reads.next().await {
        let (uri, records) = match read {
            Ok(read) => read,
            // Deleted by a snapshot between the listing and the read: what
            // it held is in that snapshot, which is listed too or newer.
            Err(StoreError::NotFound { .. }) => continue,
            Err(e) => return Err(e),
        };
        for record in records {
            merge(&mut stored.records, record);
        }
        stored.objects.push(uri);
    }
    Ok(stored)
}

#[cfg(all(test, feature = "io"))]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::layout::RootLayout;
    use crate::records::ProgressLogRef;
    use stoke_store::to_json_bytes;

    fn record(shard: &str, seq: u64, next_batch: u64) -> ProgressRecord {
        ProgressRecord {
            shard_id: shard.to_string(),
            seq,
            next_batch,
            ..ProgressRecord::default()
        }
    }

    #[tokio::test]
    async fn the_record_with_the_highest_seq_wins_across_logs_and_snapshots() {
        let stores = Stores::new();
        let layout = RootLayout::new(StoreUri::parse("memory:///r").unwrap()).job("j");
        let put = |uri: StoreUri, records: Vec<ProgressRecord>| {
            let stores = stores.clone();
            async move {
                let log = ProgressLogRef {
                    records: records.iter().collect(),
                };
                stores
                    .put(&uri, bytes::Bytes::from(to_json_bytes(&log)))
                    .await
                    .unwrap();
            }
        };
        // A snapshot newer than one log and older than another, and a
        // single record as written before group commits.
        put(
            layout.progress_log(1),
            vec![record("a", 1, 1), record("b", 2, 1)],
        )
        .await;
        put(
            layout.progress_snapshot(3),
            vec![record("a", 3, 2), record("b", 2, 1)],
        )
        .await;
        put(layout.progress_log(4), vec![record("b", 4, 5)]).await;
        stores
            .put_json(&layout.progress_dir().join("c.json"), &record("c", 0, 9))
            .await
            .unwrap();
        let stored = load(&stores, &layout).await.unwrap();
        assert_eq!(stored.records.len(), 3);
        assert_eq!(stored.records["a"].next_batch, 2);
        assert_eq!(stored.records["b"].next_batch, 5);
        assert_eq!(stored.records["c"].next_batch, 9);
        // A record from before group commits counts as stored (so the next
        // snapshot keeps it), older than anything written since.
        assert_eq!(stored.records["c"].seq, 1);
        assert_eq!(stored.objects.len(), 4);
    }

    #[test]
    fn garbage_is_a_decode_error_naming_the_object() {
        let uri = StoreUri::parse("memory:///r/jobs/j/progress/log-1.json").unwrap();
        let err = decode(&uri, b"{\"records\": 3}").unwrap_err();
        assert!(err.to_string().contains("log-1.json"), "{err}");
    }
}
