//! The committer: for each checkpoint of an attempt, in order, encode the
//! rows, upload outputs under the attempt's prefix, then ask the coordinator
//! to commit. A refused commit (stale token, job ended) aborts the attempt.
//!
//! The attempt's prefix is a staging folder (`Lease::outputs_staged`): the
//! coordinator copies what an accepted commit lists into the output folder
//! before it stores the commit. Once a commit is answered, accepted or
//! refused, its staged objects are garbage and the committer deletes them.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use stoke_core::layout::{metrics_partial_name, part_name};
use stoke_core::lease::{Commit, LeaseKey};
use stoke_core::records::OutputObject;
use stoke_core::sha256_hex;
use stoke_core::spec::{FieldId, OutputFormat};
use stoke_store::{StoreUri, Stores};
use tokio::sync::{mpsc, oneshot, watch};
use tracing::{debug, warn};

use crate::attempt::control::{Checkpoint, ShardControl};
use crate::attempt::output::encode;
use crate::error::{LinkError, LinkErrorKind, WorkerError};
use crate::link::CoordinatorLink;
use crate::link::{self, SessionState};

pub(crate) struct Committer<L> {
    pub link: Arc<L>,
    pub stores: Stores,
    pub session_rx: watch::Receiver<SessionState>,
    pub key: LeaseKey,
    pub prefix: StoreUri,
    /// `prefix` is a staging folder whose objects the coordinator copies.
    pub outputs_staged: bool,
    pub errors_prefix: StoreUri,
    pub format: OutputFormat,
    /// An Iceberg job's field ids, from its spec (see `encode`).
    pub field_ids: Arc<[FieldId]>,
    pub control: Arc<ShardControl>,
}

/// How long a commit is retried while the coordinator is unreachable (or
/// restarting) before the attempt gives up. The data is safe either way:
/// the outputs are uploaded and the last commit stands.
const COMMIT_RETRY_BUDGET: Duration = Duration::from_secs(60);

/// Deletes staged objects, best effort: what is left is swept by the
/// coordinator when the job ends.
async fn delete_all(stores: &Stores, staged: &[StoreUri]) {
    for uri in staged {
        if let Err(e) = stores.delete(uri).await {
            debug!(object = %uri, error = %e, "deleting a staged object failed; the coordinator sweeps it later");
        }
    }
}

impl<L: CoordinatorLink> Committer<L> {
    /// Runs until the processor closes the channel or a commit is refused.
    pub async fn run(self, mut rx: mpsc::Receiver<Checkpoint>) -> Result<u64, WorkerError> {
        let mut committed = 0u64;
        while let Some(mut checkpoint) = rx.recv().await {
            let (placeholder, _) = oneshot::channel();
            let ack = std::mem::replace(&mut checkpoint.ack, placeholder);
            let (batches, model_us) = (checkpoint.batches, checkpoint.model_us);
            let mut staged = Vec::new();
            let result = self.checkpoint(checkpoint, &mut staged).await;
            if let Err(e) = result {
                self.control.abort();
                let _ = ack.send(false);
                // Deleted aside: the lease goes back now, not after the
                // deletes of a store that may not answer (ADR 020).
                if self.outputs_staged && !staged.is_empty() {
                    let stores = self.stores.clone();
                    tokio::spawn(async move { delete_all(&stores, &staged).await });
                }
                return Err(e);
            }
            self.control.committed(batches, model_us);
            let _ = ack.send(true);
            self.delete_staged(&staged).await;
            committed += 1;
        }
        Ok(committed)
    }

    /// Deletes a checkpoint's staged objects once its commit is answered:
    /// accepted, the coordinator has copied them into the output folder;
    /// refused or abandoned, they will never count. Best effort: what is
    /// left is swept by the coordinator when the job ends.
    async fn delete_staged(&self, staged: &[StoreUri]) {
        if self.outputs_staged {
            delete_all(&self.stores, staged).await;
        }
    }

    /// Uploads a checkpoint's objects (naming each output in `staged` as it
    /// is uploaded) and commits them.
    async fn checkpoint(
        &self,
        cp: Checkpoint,
        staged: &mut Vec<StoreUri>,
    ) -> Result<(), WorkerError> {
        // Fault injection for tests: freeze here, with the checkpoint's
        // rows ready and nothing uploaded, until a SIGCONT (a zombie).
        fail::eval("worker::stop_before_upload", |_| {
            crate::signals::stop_self();
        });
        let mut outputs = Vec::new();
        if !cp.rows.is_empty() {
            let records: u64 = cp.rows.iter().map(|r| r.num_rows() as u64).sum();
            let format = self.format;
            let shard = self.key.shard_id.clone();
            let rows = cp.rows;
            let field_ids = Arc::clone(&self.field_ids);
            let bytes = tokio::task::spawn_blocking(move || encode(&rows, format, &field_ids))
                .await
                .map_err(|e| WorkerError::Encode {
                    shard: shard.clone(),
                    message: e.to_string(),
                })?
                .map_err(|message| WorkerError::Encode { shard, message })?;
            let uri = self
                .prefix
                .join(&part_name(cp.from_batch, format.extension()));
            staged.push(uri.clone());
            outputs.push(self.upload(uri, bytes, records).await?);
        }
        for file in &cp.files {
            let name = file
                .file_name()
                .map(|n| n.to_string_lossy().to_string())
                .unwrap_or_default();
            let bytes = tokio::fs::read(file)
                .await
                .map_err(|e| WorkerError::Encode {
                    shard: self.key.shard_id.clone(),
                    message: format!("reading scratch file {}: {e}", file.display()),
                })?;
            let uri = self
                .prefix
                .join(&format!("_files/{:08}-{name}", cp.from_batch));
            staged.push(uri.clone());
            outputs.push(self.upload(uri, Bytes::from(bytes), 0).await?);
            let _ = tokio::fs::remove_file(file).await;
        }
        if let Some(partial) = cp.metrics {
            // Committed with the checkpoint's batches, or never.
            let uri = self.prefix.join(&metrics_partial_name(cp.from_batch));
            staged.push(uri.clone());
            outputs.push(self.upload(uri, partial, 0).await?);
        }
        let mut error_objects = Vec::new();
        let skipped = cp.skipped.len() as u64;
        let last_skip_reason = cp
            .skipped
            .last()
            .map(|s| format!("record {}: {}", s.id, s.reason));
        if !cp.skipped.is_empty() {
            let mut lines = Vec::new();
            for s in &cp.skipped {
                let line = serde_json::json!({ "id": s.id, "reason": s.reason });
                lines.extend_from_slice(line.to_string().as_bytes());
                lines.push(b'\n');
            }
            let uri = self.errors_prefix.join(&part_name(cp.from_batch, "jsonl"));
            error_objects.push(self.upload(uri, Bytes::from(lines), skipped).await?);
        }
        fail::fail_point!("worker::after_upload_before_commit", |_| {
            // Fault injection for tests: die as kill -9 would, with the
            // outputs uploaded and the commit not sent.
            std::process::abort()
        });
        let commit = Commit {
            session_id: String::new(),
            key: self.key.clone(),
            from_batch: cp.from_batch,
            next_batch: cp.next_batch,
            records: cp.records,
            outputs,
            shard_done: cp.done,
            skipped,
            error_objects,
            last_skip_reason,
        };
        self.commit_with_retry(commit).await?;
        debug!(shard = %self.key.shard_id, next_batch = cp.next_batch, done = cp.done, "checkpoint committed");
        Ok(())
    }

    async fn upload(
        &self,
        uri: StoreUri,
        bytes: Bytes,
        records: u64,
    ) -> Result<OutputObject, WorkerError> {
        let sha256 = sha256_hex(&bytes);
        let size = bytes.len() as u64;
        self.stores.put(&uri, bytes).await?;
        Ok(OutputObject {
            uri: uri.to_string(),
            records,
            bytes: size,
            sha256,
        })
    }

    /// Sends the commit on the current session, retrying while the
    /// coordinator is unreachable or restarting (commits are idempotent).
    async fn commit_with_retry(&self, mut commit: Commit) -> Result<(), WorkerError> {
        let started = Instant::now();
        let mut delay = Duration::from_millis(50);
        let mut attempt = 0u32;
        loop {
            let mut rx = self.session_rx.clone();
            let left = COMMIT_RETRY_BUDGET.saturating_sub(started.elapsed());
            let result = match link::current(&mut rx, left).await {
                Ok(id) => {
                    commit.session_id = id;
                    self.link.commit(commit.clone()).await.map(|_| ())
                }
                Err(e) => Err(e),
            };
            let e: LinkError = match result {
                Ok(()) => return Ok(()),
                Err(e) => e,
            };
            let retry = matches!(
                e.kind,
                LinkErrorKind::Transient | LinkErrorKind::UnknownSession
            );
            if !retry || started.elapsed() >= COMMIT_RETRY_BUDGET {
                return Err(WorkerError::Link(e));
            }
            attempt += 1;
            warn!(shard = %self.key.shard_id, attempt, error = %e, "commit failed; retrying");
            tokio::time::sleep(delay).await;
            delay = (delay * 2).min(Duration::from_secs(2));
        }
    }
}
