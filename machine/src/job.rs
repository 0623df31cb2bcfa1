//! A job: its plan and shards, its life, its features' components and
//! its own rules' bookkeeping (the running totals, the leases it holds).
//! The rules themselves live with what they are about (`commit.rs`,
//! `split.rs`, `crash.rs`, `finish.rs`...), as `impl Job` methods.

use super::*;

pub(super) struct Job {
    pub(super) id: String,
    /// Its place in submission order (`State::order`), the last tie-break
    /// among equals: the hot paths walk `jobs` without looking ids up.
    pub(super) seq: usize,
    pub(super) spec: Arc<JobSpec>,
    pub(super) plan: Arc<Plan>,
    pub(super) layout: JobLayout,
    pub(super) output: StoreUri,
    /// `format = "delta"`: the table the job's objects are added to (its
    /// `output` is the job's folder inside it).
    pub(super) delta: Option<TableTarget>,
    /// `commit = "checkpoint"`: the committed objects not yet in the table.
    pub(super) delta_log: Option<table_log::TableLog>,
    /// Where attempts upload (see `stoke_core::layout`).
    pub(super) staging: StoreUri,
    pub(super) shards: Vec<ShardState>,
    /// Indices of shards waiting for a worker.
    pub(super) pending: VecDeque<usize>,
    pub(super) shard_index: HashMap<String, usize>,
    /// Running totals over the shards' progress, kept by `set_progress`
    /// so status calls and commits never walk every shard.
    pub(super) totals: Totals,
    /// Committed records sampled over time, for the status page's rate.
    pub(super) rate: RateWindow,
    /// The job's progress objects (logs, snapshots) the next snapshot
    /// replaces, oldest first.
    pub(super) progress_objects: Vec<StoreUri>,
    /// Its commits on their way to the store (see `commit.rs`).
    pub(super) commits: commit::CommitQueue,
    /// Where it is in its life (see [`Life`]).
    pub(super) life: Life,
    /// Changes of its status waiting for the one being stored.
    pub(super) deferred: VecDeque<(Option<ReqId>, jobs::JobCmd)>,
    /// Priority, weight and lease cap as they apply now (the spec's, or
    /// what `stoke set` stored since).
    pub(super) schedule: Schedule,
    /// Shards leased now (kept by `put_lease`/`take_lease`), for fair
    /// share and caps without walking the shards.
    pub(super) leased: u64,
    /// Stride scheduling's pass: grows by 1/weight with every lease, so
    /// among jobs holding equal shares the one served least goes next.
    pub(super) pass: f64,
    /// Its processor time by cause.
    pub(super) account: account::Account,
    /// Its failed attempts' errors so far (see `repeats.rs`).
    pub(super) repeats: repeats::Repeats,
    /// Its features' components: its budget, its deadline, its metrics'
    /// reduce task.
    pub(super) features: component::Features,
    /// What happened to it that its user should know, oldest first.
    pub(super) events: deadline::Events,
    /// Workers whose attempts at it failed on the store, said once in its
    /// events until they commit again (`leases.rs`, `commit.rs`).
    pub(super) store_trouble: BTreeSet<String>,
    /// Waits between tries of its finish (the manifest, a table commit at
    /// the end) after a failure that is not permanent.
    pub(super) finish_backoff: crate::backoff::Backoff,
    /// Its link in its pipeline: the commits it holds for the next
    /// stage, whether it knows every input shard (`pipeline.rs`).
    pub(super) link: pipeline::Link,
}

#[derive(Debug, Default, Clone, Copy)]
pub(super) struct Totals {
    pub(super) shards_done: u64,
    pub(super) records: u64,
    pub(super) skipped: u64,
    pub(super) failed_attempts: u64,
    pub(super) store_failures: u64,
    /// Shards not done that had a failed attempt or a store failure.
    pub(super) failed_unfinished: u64,
    /// Shards with a stored record (what a snapshot writes).
    pub(super) recorded: u64,
    /// Records written to progress logs since the last snapshot.
    pub(super) logged: u64,
    /// Workers that died processing the job's batches.
    pub(super) crashes: u64,
    /// Shards with a suspect (see `crash.rs`).
    pub(super) suspects: u64,
}

/// A shard with a failed attempt, a store failure or a skipped record:
/// what `stoke errors` lists.
pub(super) fn has_errors(p: &ProgressRecord) -> bool {
    p.failed_attempts > 0 || p.store_failures > 0 || p.skipped > 0 || p.crashes > 0
}

/// A shard not done yet whose earlier attempts failed.
pub(super) fn failed_unfinished(p: &ProgressRecord) -> bool {
    !p.done && (p.failed_attempts > 0 || p.store_failures > 0)
}

/// Whether a job's inputs are all known at submit: not for a pipeline
/// stage that reads the stage before.
pub(super) fn inputs_known_at_submit(spec: &JobSpec) -> bool {
    spec.dataset.format != stoke_core::spec::DatasetFormat::Stage
}

/// A table job's format and commit mode (`None`: not a table job).
fn table_kind(spec: &JobSpec) -> Option<(TableKind, DeltaCommit)> {
    let commit = spec.output.table_commit()?;
    let kind = match spec.output.iceberg() {
        Some((name, catalog)) => TableKind::Iceberg {
            name: name.to_string(),
            catalog: catalog.clone(),
        },
        None => TableKind::Delta,
    };
    Some((kind, commit))
}

impl Job {
    pub(super) fn new(
        id: String,
        spec: Arc<JobSpec>,
        plan: Arc<Plan>,
        layout: JobLayout,
        now: Instant,
    ) -> Self {
        let location = spec
            .output
            .uri
            .as_deref()
            .and_then(|u| StoreUri::parse(u).ok())
            .unwrap_or_else(|| layout.default_output());
        // Checked at submit; a stored one that no longer parses has none.
        let deadline = spec
            .limits
            .finish_by_ms()
            .ok()
            .flatten()
            .map(deadline::Deadline::new);
        // A table job's objects go into its own folder in the table.
        let (output, delta) = match table_kind(&spec) {
            Some((kind, commit)) => (
                kind.job_folder(&location, &id),
                Some(TableTarget {
                    table: location,
                    commit,
                    kind,
                }),
            ),
            None => (location, None),
        };
        let staging = layout.staging_for(&output);
        let link = pipeline::Link::new(&spec);
        let shards: Vec<ShardState> = plan
            .shards
            .iter()
            .map(|s| {
                ShardState::new(ProgressRecord {
                    shard_id: s.id.clone(),
                    ..Default::default()
                })
            })
            .collect();
        let shard_index = plan
            .shards
            .iter()
            .enumerate()
            .map(|(i, s)| (s.id.clone(), i))
            .collect();
        Self {
            id,
            seq: 0,
            pending: (0..shards.len()).collect(),
            plan,
            layout,
            output,
            delta_log: delta
                .as_ref()
                .filter(|d| d.commit == DeltaCommit::Checkpoint)
                .map(|_| table_log::TableLog::default()),
            delta,
            staging,
            life: Life::Running(Change::Idle),
            shards,
            shard_index,
            totals: Totals::default(),
            rate: RateWindow::default(),
            progress_objects: Vec::new(),
            commits: Default::default(),
            deferred: VecDeque::new(),
            schedule: spec.schedule(),
            leased: 0,
            pass: 0.0,
            spec,
            account: account::Account::new(now),
            repeats: Default::default(),
            link,
            features: component::Features {
                budget: Default::default(),
                deadline,
                reduce: Default::default(),
            },
            events: Default::default(),
            store_trouble: BTreeSet::new(),
            finish_backoff: Default::default(),
        }
    }

    /// Gives shard `idx` a lease, keeping the count of leases held.
    pub(super) fn put_lease(&mut self, idx: usize, lease: ActiveLease) {
        if self.shards[idx].slot.put_lease(lease) {
            self.leased += 1;
        }
    }

    /// Takes shard `idx`'s lease away, keeping the count of leases held.
    pub(super) fn take_lease(&mut self, idx: usize) -> Option<ActiveLease> {
        let lease = self.shards[idx].slot.take_lease();
        if lease.is_some() {
            self.leased = self.leased.saturating_sub(1);
        }
        lease
    }

    /// A record of shard `idx` starts being stored. Every caller ends a
    /// race first (a commit settles it, a failed or crashed batch drops
    /// the backup, a raced shard is not split); a backup found racing is
    /// ended here all the same, its lease no longer counted.
    pub(super) fn begin_write(&mut self, idx: usize) {
        if let Some(backup) = self.shards[idx].slot.begin_write() {
            debug_assert!(
                false,
                "a backup raced a shard whose record began to be stored"
            );
            self.leased = self.leased.saturating_sub(1);
            warn!(job = %self.id, shard = %self.plan.shards[idx].id, token = backup.token, "a backup still raced as its shard's record began to be stored; it is ended");
        }
    }

    /// Replaces a shard's progress, keeping the totals.
    pub(super) fn set_progress(&mut self, idx: usize, progress: ProgressRecord) {
        let old = &self.shards[idx].progress;
        if let Some(log) = self.delta_log.as_mut() {
            log.note(&old.outputs, &progress);
        }
        let t = &mut self.totals;
        // `old` is part of the totals, so the subtractions cannot go below 0.
        t.shards_done =
            t.shards_done.saturating_sub(u64::from(old.done)) + u64::from(progress.done);
        t.records = t.records.saturating_sub(old.records) + progress.records;
        t.skipped = t.skipped.saturating_sub(old.skipped) + progress.skipped;
        t.failed_attempts = t
            .failed_attempts
            .saturating_sub(u64::from(old.failed_attempts))
            + u64::from(progress.failed_attempts);
        t.store_failures = t
            .store_failures
            .saturating_sub(u64::from(old.store_failures))
            + u64::from(progress.store_failures);
        t.failed_unfinished = t
            .failed_unfinished
            .saturating_sub(u64::from(failed_unfinished(old)))
            + u64::from(failed_unfinished(&progress));
        t.crashes = t.crashes.saturating_sub(u64::from(old.crashes)) + u64::from(progress.crashes);
        t.suspects = t.suspects.saturating_sub(u64::from(old.suspect.is_some()))
            + u64::from(progress.suspect.is_some());
        if old.seq == 0 && progress.seq > 0 {
            t.recorded += 1;
        }
        self.shards[idx].progress = Arc::new(progress);
    }

    /// The folder every attempt of this job uploads under.
    pub(super) fn staging_dir(&self) -> StoreUri {
        folder(&self.staging)
    }

    pub(super) fn all_done(&self) -> bool {
        self.link.inputs_complete && self.totals.shards_done == self.shards_total()
    }

    pub(super) fn shards_total(&self) -> u64 {
        self.life
            .kept()
            .map_or(self.shards.len() as u64, |k| k.shards_total)
    }

    pub(super) fn shard(&self, shard_id: &str) -> Result<usize> {
        if self.life.kept().is_some() {
            return Err(MachineError::JobNotRunning {
                job_id: self.id.clone(),
                state: self.life.state().to_string(),
            });
        }
        self.shard_index
            .get(shard_id)
            .copied()
            .ok_or_else(|| MachineError::ShardNotFound {
                job_id: self.id.clone(),
                shard_id: shard_id.to_string(),
            })
    }
}
