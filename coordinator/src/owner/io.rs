//! Every store write the coordinator makes once it runs: the state
//! machine decides them (`state::Io`, group commits, snapshots) and the
//! owner runs them here, off its loop.

use std::collections::HashMap;

use bytes::Bytes;
use futures::StreamExt;
use stoke_core::records::{JobState, Manifest, StatusRecord, TableVersions, now_ms};
use stoke_core::spec::{DeltaCommit, JobSpec};
use stoke_store::{StoreError, StoreUri, Stores};
use tracing::{info, warn};

use crate::error::{CoordinatorError, Result, for_machine, write_fault};
use crate::state::error::MachineError;
use crate::state::{
    CreateJob, FinishJob, GroupWrite, GroupWritten, Io, Outcome, SnapshotWrite, Stamped, TableKind,
    TableTarget, TableWrite, folder, plan_finish, progress_log,
};
use crate::table::delta::{self, DoneUpdate, TableAppend};
use crate::table::iceberg;
use stoke_core::plan::{DoneInput, ShardSource};

/// How many objects one group commit copies into the output folder at once.
const COPY_CONCURRENCY: usize = 16;
/// How many orphans one finishing job deletes at once.
const DELETE_CONCURRENCY: usize = 16;

/// Runs one write the state machine asked for.
pub async fn perform(io: Io, stores: &Stores) -> Outcome {
    match io {
        Io::Group(write) => {
            let mut done = write_groups(vec![write], stores).await;
            match done.pop() {
                Some((write, written)) => Outcome::Group { write, written },
                None => Outcome::Done(Err(MachineError::Recovery(
                    "a group commit came back empty".to_string(),
                ))),
            }
        }
        Io::Snapshot(snapshot) => {
            let (written, deleted) = write_snapshot(&snapshot, stores).await;
            Outcome::Snapshot {
                written: written.map_err(write_fault),
                deleted,
            }
        }
        io => Outcome::Done(perform_one(io, stores).await.map_err(for_machine)),
    }
}

/// A write with a plain result: stored, or why not.
async fn perform_one(io: Io, stores: &Stores) -> Result<()> {
    match io {
        Io::CreateJob(create) => {
            let CreateJob {
                job_id,
                spec_uri,
                spec,
                plan_uri,
                plan,
                status_uri,
                status,
            } = *create;
            match stores.put_json_new(&spec_uri, &*spec).await {
                Ok(()) => {}
                Err(StoreError::AlreadyExists { .. }) => {
                    // A job with this id was stored before (perhaps by a
                    // crashed submit); accept only the same spec.
                    let stored: Option<JobSpec> = stores.get_json(&spec_uri).await?;
                    if stored.as_ref() != Some(&*spec) {
                        return Err(MachineError::JobExists { job_id }.into());
                    }
                }
                Err(e) => return Err(e.into()),
            }
            stores.put_json(&plan_uri, &*plan).await?;
            let status = Stamped::Status(status).at(now_ms());
            stores.put(&status_uri, status).await?;
            Ok(())
        }
        Io::Put { uri, bytes } => Ok(stores.put(&uri, bytes).await?),
        Io::Stamped { uri, record } => Ok(stores.put(&uri, record.at(now_ms())).await?),
        Io::Puts(objects) => {
            for (uri, bytes) in objects {
                stores.put(&uri, bytes).await?;
            }
            Ok(())
        }
        Io::Finish(finish) => finish_job(*finish, stores).await,
        Io::Table(write) => table_write(*write, stores).await,
        Io::Group(_) | Io::Snapshot(_) => Err(CoordinatorError::Recovery(
            "a group or snapshot write has its own result".to_string(),
        )),
    }
}

/// Writes group commits (each of another job) at once: all their copies
/// in one go, then all their progress objects in one go, so on the local
/// file system a whole batch of groups costs two blocking tasks. For each
/// group: every commit's staged objects are copied into the output folder,
/// then the records of the commits whose copies all succeeded are stored.
/// Copying again is harmless, so a retried commit simply copies again.
/// Each write comes back (its copies spent) with what it did, in order.
pub async fn write_groups(
    mut writes: Vec<GroupWrite>,
    stores: &Stores,
) -> Vec<(GroupWrite, GroupWritten)> {
    // (group, commit) of each copy.
    let mut owners: Vec<(usize, usize)> = Vec::new();
    let mut pairs: Vec<(StoreUri, StoreUri)> = Vec::new();
    for (g, write) in writes.iter_mut().enumerate() {
        for (i, commit_copies) in std::mem::take(&mut write.copies).into_iter().enumerate() {
            for pair in commit_copies {
                owners.push((g, i));
                pairs.push(pair);
            }
        }
    }
    let copied = stores.copy_all(&pairs, COPY_CONCURRENCY).await;
    let mut results: Vec<Vec<std::result::Result<(), StoreError>>> = writes
        .iter()
        .map(|w| w.records.iter().map(|_| Ok(())).collect())
        .collect();
    for (((g, i), (from, _)), result) in owners.into_iter().zip(&pairs).zip(copied) {
        if let Err(e) = result
            && results[g][i].is_ok()
        {
            warn!(object = %from, error = %e, "copying a staged output into the output folder failed");
            results[g][i] = Err(e);
        }
    }
    // The groups with a record to store, and their objects.
    let mut logged: Vec<usize> = Vec::new();
    let mut objects: Vec<(StoreUri, Bytes)> = Vec::new();
    for (g, write) in writes.iter().enumerate() {
        let mut records = write
            .records
            .iter()
            .zip(&results[g])
            .filter(|(_, r)| r.is_ok())
            .map(|(p, _)| p)
            .peekable();
        if records.peek().is_some() {
            logged.push(g);
            objects.push((write.uri.clone(), progress_log(records)));
        }
    }
    let mut stored = vec![false; writes.len()];
    let put = stores.put_all(objects, COPY_CONCURRENCY).await;
    for (g, result) in logged.into_iter().zip(put) {
        match result {
            Ok(()) => {
                stored[g] = true;
                fail::fail_point!("coordinator::after_progress_stored", |_| {
                    // Fault injection for tests: die as kill -9 would, after
                    // a progress record is stored and before anyone hears
                    // of it.
                    std::process::abort()
                });
            }
            Err(e) => {
                results[g] = writes[g].records.iter().map(|_| Err(e.share())).collect();
            }
        }
    }
    writes
        .into_iter()
        .zip(results.into_iter().zip(stored))
        .map(|(write, (results, stored))| {
            let results = results
                .into_iter()
                .map(|r| r.map_err(write_fault))
                .collect();
            (write, GroupWritten { stored, results })
        })
        .collect()
}

/// Stores the snapshot, then deletes what it replaces; returns the objects
/// deleted (a failed delete is tried again at the next one).
pub async fn write_snapshot(
    snapshot: &SnapshotWrite,
    stores: &Stores,
) -> (std::result::Result<(), StoreError>, Vec<StoreUri>) {
    if let Err(e) = stores.put(&snapshot.uri, snapshot.bytes.clone()).await {
        return (Err(e), Vec::new());
    }
    let mut deleted = Vec::with_capacity(snapshot.replaces.len());
    for uri in &snapshot.replaces {
        match stores.delete(uri).await {
            Ok(()) | Err(StoreError::NotFound { .. }) => deleted.push(uri.clone()),
            Err(e) => {
                warn!(object = %uri, error = %e, "deleting a progress object a snapshot replaced failed; will retry");
            }
        }
    }
    (Ok(()), deleted)
}

/// A table job's committed objects, added to its table: in one commit
/// (`commit = "end"`), or those the groups' commits left out (a crash
/// between a group and its table commit; `"checkpoint"`). Run again after
/// a crash, the job's txn (Delta) or snapshot summary (Iceberg) in the
/// table shows what is there already.
async fn commit_to_table(
    finish: &FinishJob,
    target: &TableTarget,
    stores: &Stores,
) -> Result<TableVersions> {
    let checkpoint = target.commit == DeltaCommit::Checkpoint;
    let append = TableAppend {
        table: target.table.clone(),
        kind: target.kind.clone(),
        job_id: finish.job_id.clone(),
        seq: finish.progress.iter().map(|p| p.seq).max().unwrap_or(0),
        objects: finish
            .progress
            .iter()
            .flat_map(|p| p.outputs.iter().cloned())
            .collect(),
        // Some objects may be in the table: the groups' appends
        // (`"checkpoint"`), or a pause's at its cap (`"end"`, budget.rs).
        reconcile: true,
        done: done_update(finish),
    };
    let record = finish.layout.table_versions(target.kind.format());
    let name = table_name(&append);
    let appended = append_to_table(stores, append).await?;
    if appended.version.is_some() {
        fail::fail_point!("coordinator::after_delta_commit", |_| std::process::abort());
    }
    let ordered = matches!(target.kind, TableKind::Delta);
    let versions = if checkpoint {
        let made = appended.prior.into_iter().chain(appended.version);
        record_versions(stores, &record, &name, made, ordered).await?
    } else {
        // A pause at its cap committed what it had then (`budget.rs`).
        let paused: Option<TableVersions> = stores.get_json(&record).await?;
        let mut versions = paused.map(|p| p.versions).unwrap_or_default();
        add_versions(
            &mut versions,
            appended.version.or(appended.prior).into_iter(),
            ordered,
        );
        versions
    };
    Ok(TableVersions {
        table: name,
        versions,
    })
}

/// The table as its versions' record names it: a Delta table's URI, an
/// Iceberg table's `namespace.table`.
fn table_name(append: &TableAppend) -> String {
    match &append.kind {
        TableKind::Delta => append.table.to_string(),
        TableKind::Iceberg { name, .. } => name.clone(),
    }
}

/// One commit to a job's table, by its format.
async fn append_to_table(stores: &Stores, append: TableAppend) -> Result<delta::Appended> {
    Ok(match append.kind {
        TableKind::Delta => delta::append(stores, append).await?,
        TableKind::Iceberg { .. } => iceberg::append(stores, append).await?,
    })
}

/// An incremental job's inputs as done: each with the records its shards
/// read (a Parquet or JSON Lines object's shards, split ones included;
/// one record per object of a `files` dataset).
fn done_update(finish: &FinishJob) -> Option<DoneUpdate> {
    let incremental = finish
        .plan
        .incremental
        .as_ref()
        .filter(|i| !i.inputs.is_empty())?;
    let sources: HashMap<&str, &ShardSource> = finish
        .plan
        .shards
        .iter()
        .map(|s| (s.id.as_str(), &s.source))
        .collect();
    let mut records: HashMap<&str, u64> = HashMap::new();
    for p in &finish.progress {
        match sources.get(p.shard_id.as_str()) {
            Some(ShardSource::Parquet { uri, .. } | ShardSource::Jsonl { uri, .. }) => {
                *records.entry(uri.as_str()).or_default() += p.records;
            }
            Some(ShardSource::Files { uris }) => {
                for uri in uris {
                    records.insert(uri.as_str(), 1);
                }
            }
            Some(ShardSource::Range { .. }) | None => {}
        }
    }
    let inputs = incremental
        .inputs
        .iter()
        .map(|i| {
            let done = DoneInput {
                size: i.size,
                e_tag: i.e_tag.clone(),
                version: i.version.clone(),
                records: records.get(i.uri.as_str()).copied().unwrap_or(0),
                job: finish.job_id.clone(),
            };
            (i.uri.clone(), done)
        })
        .collect();
    Some(DoneUpdate {
        fingerprint: incremental.fingerprint.clone(),
        pipeline: incremental.pipeline.clone(),
        inputs,
    })
}

/// A `commit = "checkpoint"` job's table commit: its objects added, then
/// the version made (or found) recorded in the job's `delta.json` or
/// `iceberg.json`.
async fn table_write(write: TableWrite, stores: &Stores) -> Result<()> {
    let TableWrite { append, record } = write;
    let name = table_name(&append);
    let kind = append.kind.clone();
    fail::fail_point!("coordinator::before_delta_commit", |_| Err(
        CoordinatorError::Recovery("fault point: a table commit failed".into())
    ));
    let appended = append_to_table(stores, append).await?;
    if appended.version.is_some() {
        fail::fail_point!("coordinator::after_delta_commit", |_| std::process::abort());
        // Fault injection: the commit landed, but the answer is lost (a
        // connection broken after the store took the write).
        fail::fail_point!("coordinator::delta_answer_lost", |_| Err(
            CoordinatorError::Recovery("fault point: a table commit's answer was lost".into())
        ));
    }
    let made = appended.prior.into_iter().chain(appended.version);
    let ordered = matches!(kind, TableKind::Delta);
    record_versions(stores, &record, &name, made, ordered).await?;
    Ok(())
}

/// Adds to `versions` those of `made` it lacks: in commit order, which
/// is number order for Delta's versions (`ordered`) and the order made
/// for Iceberg's snapshot ids.
fn add_versions(versions: &mut Vec<u64>, made: impl Iterator<Item = u64>, ordered: bool) {
    for v in made {
        if !versions.contains(&v) {
            versions.push(v);
        }
    }
    if ordered {
        versions.sort_unstable();
    }
}

/// Adds `made` to the versions `record` lists (written only if it
/// changes); returns them all, in commit order.
async fn record_versions(
    stores: &Stores,
    record: &StoreUri,
    table: &str,
    made: impl Iterator<Item = u64>,
    ordered: bool,
) -> Result<Vec<u64>> {
    let mut versions: TableVersions =
        stores
            .get_json(record)
            .await?
            .unwrap_or_else(|| TableVersions {
                table: table.to_string(),
                versions: Vec::new(),
            });
    let before = versions.versions.len();
    add_versions(&mut versions.versions, made, ordered);
    if versions.versions.len() != before {
        stores.put_json(record, &versions).await?;
    }
    Ok(versions.versions)
}

/// Every shard is committed: remove what uncommitted attempts wrote (so
/// the output folder holds exactly what the manifest lists when the job
/// says it succeeded), write the manifest, then the `succeeded` status.
/// The CPU-heavy part (a big job's sets of committed objects and its
/// manifest) runs on a blocking thread, off the runtime's workers.
async fn finish_job(finish: FinishJob, stores: &Stores) -> Result<()> {
    let outputs_listed = stores.list(&folder(&finish.output)).await?;
    let errors_listed = stores.list(&finish.layout.errors_root()).await?;
    let delta = match &finish.delta {
        Some(target) => Some(commit_to_table(&finish, target, stores).await?),
        None => None,
    };
    let (job_id, layout) = (finish.job_id.clone(), finish.layout.clone());
    let (manifest, bytes, orphans) = tokio::task::spawn_blocking(move || {
        let (manifest, orphans) =
            plan_finish(&finish, outputs_listed, errors_listed, delta, now_ms());
        let bytes = Bytes::from(serde_json::to_vec_pretty(&manifest).unwrap_or_default());
        (manifest, bytes, orphans)
    })
    .await
    .map_err(|e| {
        CoordinatorError::Recovery(format!("building the manifest of job {job_id}: {e}"))
    })?;
    let n = orphans.len();
    let mut deletes = futures::stream::iter(orphans)
        .map(|uri| {
            let stores = stores.clone();
            async move {
                match stores.delete(&uri).await {
                    Ok(()) | Err(StoreError::NotFound { .. }) => Ok(()),
                    Err(e) => Err(e),
                }
            }
        })
        .buffer_unordered(DELETE_CONCURRENCY);
    while let Some(deleted) = deletes.next().await {
        deleted?;
    }
    if n > 0 {
        info!(job = %job_id, orphans = n, "deleted objects no commit names");
    }
    fail::fail_point!("coordinator::before_manifest", |_| std::process::abort());
    // Create-only: a manifest is never overwritten. One already there was
    // written by a coordinator that stopped before marking the job done;
    // it must list the same objects.
    match stores.put_new(&layout.manifest(), bytes).await {
        Ok(()) => {}
        Err(StoreError::AlreadyExists { .. }) => {
            let existing: Option<Manifest> = stores.get_json(&layout.manifest()).await?;
            let same = existing.is_some_and(|m| {
                Manifest {
                    created_ms: manifest.created_ms,
                    ..m
                } == manifest
            });
            if !same {
                return Err(CoordinatorError::Recovery(format!(
                    "{} exists and lists other objects than the committed progress; not overwriting it",
                    layout.manifest()
                )));
            }
        }
        Err(e) => return Err(e.into()),
    }
    fail::fail_point!("coordinator::after_manifest", |_| std::process::abort());
    let status = StatusRecord {
        state: JobState::Succeeded,
        reason: None,
        budget_pause: None,
        updated_ms: now_ms(),
        // The job's report (`report.json`) holds its whole spend.
        held_ms: None,
    };
    stores.put_json(&layout.status(), &status).await?;
    Ok(())
}
