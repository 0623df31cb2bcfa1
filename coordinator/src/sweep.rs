//! Garbage collection of staged objects: what attempts uploaded and never
//! got committed (their holder died, was fenced off, or the job ended
//! first). Staged objects are invisible to readers of the output folder,
//! so sweeping them is about storage, never about correctness; it runs in
//! the background, off the owner loop, a few prefixes at a time.
//!
//! A job's staging folder is swept when the job ends and again at every
//! coordinator start (for ended jobs); an attempt's staging folder is
//! swept when a commit for an ended job is refused (a zombie woke up and
//! uploaded after the end). Workers also delete their own staged objects
//! once a commit is answered, so normally there is little left to sweep.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;

use futures::StreamExt;
use futures::stream::FuturesUnordered;
use stoke_store::{StoreError, StoreUri, Stores};
use tracing::{debug, info, warn};

/// Prefixes swept at once.
const SWEEPS_AT_ONCE: usize = 4;
/// Deletes in flight per sweep.
const DELETES_AT_ONCE: usize = 8;

type Sweeping = Pin<Box<dyn Future<Output = (StoreUri, Result<usize, StoreError>)> + Send>>;

/// The sweeps queued and running.
pub(crate) struct Sweeper {
    stores: Stores,
    queued: VecDeque<StoreUri>,
    pub(crate) running: FuturesUnordered<Sweeping>,
}

impl Sweeper {
    pub(crate) fn new(stores: Stores) -> Self {
        Self {
            stores,
            queued: VecDeque::new(),
            running: FuturesUnordered::new(),
        }
    }

    /// Queues prefixes (folders) to empty, and starts what may start.
    pub(crate) fn add(&mut self, prefixes: Vec<StoreUri>) {
        for prefix in prefixes {
            if !self.queued.contains(&prefix) {
                self.queued.push_back(prefix);
            }
        }
        self.start();
    }

    /// Deletes one object in the background (a pipeline's consumed
    /// intermediate), beside the sweeps.
    pub(crate) fn delete(&mut self, uri: StoreUri) {
        let stores = self.stores.clone();
        self.running.push(Box::pin(async move {
            let result = stores.delete(&uri).await.map(|()| 1);
            (uri, result)
        }));
    }

    /// Notes a finished sweep and starts the next.
    pub(crate) fn finished(&mut self, prefix: &StoreUri, result: Result<usize, StoreError>) {
        match result {
            Ok(0) => debug!(prefix = %prefix, "staging folder already empty"),
            Ok(deleted) => info!(prefix = %prefix, deleted, "objects deleted"),
            // Garbage stays garbage: the next coordinator start sweeps again.
            Err(e) => warn!(prefix = %prefix, error = %e, "deleting objects failed"),
        }
        self.start();
    }

    fn start(&mut self) {
        while self.running.len() < SWEEPS_AT_ONCE {
            let Some(prefix) = self.queued.pop_front() else {
                return;
            };
            let stores = self.stores.clone();
            self.running.push(Box::pin(async move {
                let result = sweep(&stores, &prefix).await;
                (prefix, result)
            }));
        }
    }
}

/// Deletes every object under `prefix`; returns how many.
pub async fn sweep(stores: &Stores, prefix: &StoreUri) -> Result<usize, StoreError> {
    let listed = stores.list(prefix).await?;
    let mut deletes = futures::stream::iter(listed)
        .map(|l| delete(stores.clone(), l.uri))
        .buffer_unordered(DELETES_AT_ONCE);
    let mut deleted = 0;
    while let Some(result) = deletes.next().await {
        result?;
        deleted += 1;
    }
    // A local store keeps the folders its objects were in: remove those
    // left empty (an object store has no folders to leave behind).
    if let Some(dir) = prefix.local_path() {
        let _ = tokio::task::spawn_blocking(move || remove_empty_dirs(&dir)).await;
    }
    Ok(deleted)
}

/// Removes `dir` and the folders under it that hold nothing (bottom-up);
/// true when `dir` itself is gone. Best effort: a folder something was
/// written to meanwhile stays.
fn remove_empty_dirs(dir: &std::path::Path) -> bool {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return false;
    };
    let mut empty = true;
    for entry in entries.flatten() {
        let is_dir = entry.file_type().is_ok_and(|t| t.is_dir());
        if !(is_dir && remove_empty_dirs(&entry.path())) {
            empty = false;
        }
    }
    empty && std::fs::remove_dir(dir).is_ok()
}

async fn delete(stores: Stores, uri: StoreUri) -> Result<(), StoreError> {
    stores.delete(&uri).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_folders_go_and_folders_with_files_stay() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let staging = tmp.path().join("staging");
        std::fs::create_dir_all(staging.join("s00000/a1/_files")).expect("mkdir");
        std::fs::create_dir_all(staging.join("s00001/a2")).expect("mkdir");
        std::fs::write(staging.join("s00001/a2/part.parquet"), b"x").expect("write");
        assert!(!remove_empty_dirs(&staging));
        assert!(!staging.join("s00000").exists());
        assert!(staging.join("s00001/a2/part.parquet").exists());
        std::fs::remove_file(staging.join("s00001/a2/part.parquet")).expect("rm");
        assert!(remove_empty_dirs(&staging));
        assert!(!staging.exists());
    }
}
