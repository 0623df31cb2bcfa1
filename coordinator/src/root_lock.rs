//! One coordinator per state root.
//!
//! Two coordinators on one root would hand out the same shards and
//! overwrite each other's progress. A coordinator therefore holds its root
//! while it runs:
//!
//! - `file://` roots: an OS file lock on `<root>/coordinator/lock`, which
//!   the kernel drops the moment the process dies (even by `kill -9`), so a
//!   restart takes the root at once;
//! - cloud roots (`s3://`, `gs://`, `az://`, `memory://`): a lease object,
//!   `coordinator/lock.json`, created create-only and renewed with
//!   compare-and-swap writes every third of its time to live. A contender
//!   that finds a live lease waits: if the lease is renewed it is refused
//!   with an error naming the holder; if the lease stays unchanged for a
//!   whole time to live (the holder died), it takes the root over with a
//!   compare-and-swap write, so of two contenders only one wins.
//!
//! The holder's writes go through a [`WriteFence`] that closes when a renewal
//! is overdue, so a coordinator cut off from the store (or paused) stops
//! writing before anyone else may take over; one that finds its lease taken
//! stops.

use std::time::Duration;

use bytes::Bytes;
use stoke_core::layout::RootLayout;
use stoke_core::records::{LockRecord, now_ms};
use stoke_store::{ObjectVersion, WriteFence, to_json_bytes};
use stoke_store::{StoreError, StoreUri, Stores};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use crate::error::{CoordinatorError, Result};

/// The hold on a state root; release it with [`RootLock::release`].
#[derive(Debug)]
pub struct RootLock {
    fence: WriteFence,
    kind: Kind,
}

#[derive(Debug)]
enum Kind {
    /// Held while the file stays open.
    File(#[allow(dead_code)] std::fs::File),
    Object {
        stop: CancellationToken,
        renewer: tokio::task::JoinHandle<()>,
        lost: CancellationToken,
    },
}

impl RootLock {
    /// The fence the holder's writes must pass.
    pub fn fence(&self) -> WriteFence {
        self.fence.clone()
    }

    /// True when another coordinator took the root over from this one.
    pub fn was_lost(&self) -> bool {
        match &self.kind {
            Kind::File(_) => false,
            Kind::Object { lost, .. } => lost.is_cancelled(),
        }
    }

    /// Stops renewing and marks the lease released, so the next
    /// coordinator need not wait for it to expire.
    pub async fn release(self) {
        self.fence.close();
        match self.kind {
            Kind::File(file) => drop(file),
            Kind::Object { stop, renewer, .. } => {
                stop.cancel();
                let _ = renewer.await;
            }
        }
    }
}

/// Takes the state root for this process. `on_lost` is cancelled if
/// another coordinator takes the root over later.
pub async fn acquire(
    stores: &Stores,
    root: &StoreUri,
    ttl: Duration,
    description: &str,
    on_lost: CancellationToken,
) -> Result<RootLock> {
    let fence = WriteFence::new(&format!("state root {root}"));
    if root.scheme() == "file" {
        let file = lock_file(root, description)?;
        // The OS lock holds until the process ends.
        fence.extend_until(Instant::now() + Duration::from_secs(100 * 365 * 24 * 3600));
        return Ok(RootLock {
            fence,
            kind: Kind::File(file),
        });
    }
    let uri = RootLayout::new(root.clone()).lock();
    let holder = Holder {
        id: format!("{}-{}", std::process::id(), now_ms()),
        description: description.to_string(),
        ttl,
    };
    let (version, sent_at) = take(stores, root, &uri, &holder).await?;
    fence.extend_until(sent_at + ttl);
    info!(root = %root, ttl = ?ttl, "state root taken");
    let stop = CancellationToken::new();
    let lost = CancellationToken::new();
    let renewer = tokio::spawn(renew(
        stores.clone(),
        uri,
        version,
        holder,
        fence.clone(),
        stop.clone(),
        lost.clone(),
        on_lost,
    ));
    Ok(RootLock {
        fence,
        kind: Kind::Object {
            stop,
            renewer,
            lost,
        },
    })
}

/// This process as a lease holder.
struct Holder {
    id: String,
    description: String,
    ttl: Duration,
}

impl Holder {
    fn record(&self, released: bool) -> Bytes {
        Bytes::from(to_json_bytes(&LockRecord {
            holder: self.id.clone(),
            description: self.description.clone(),
            renewed_at_ms: now_ms(),
            ttl_ms: self.ttl.as_millis() as u64,
            released,
        }))
    }
}

fn held_error(root: &StoreUri, holder: &str) -> CoordinatorError {
    CoordinatorError::RootHeld {
        root: root.to_string(),
        holder: holder.to_string(),
    }
}

fn lock_file(root: &StoreUri, description: &str) -> Result<std::fs::File> {
    use std::io::{Read, Seek, Write};
    let dir = root
        .local_path()
        .ok_or_else(|| CoordinatorError::Recovery(format!("{root} is not a local folder")))?
        .join("coordinator");
    let io = |e: std::io::Error| {
        CoordinatorError::Recovery(format!("locking {}: {e}", dir.join("lock").display()))
    };
    std::fs::create_dir_all(&dir).map_err(io)?;
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(dir.join("lock"))
        .map_err(io)?;
    match file.try_lock() {
        Ok(()) => {}
        Err(std::fs::TryLockError::WouldBlock) => {
            let mut holder = String::new();
            let _ = file.read_to_string(&mut holder);
            return Err(held_error(root, holder.trim()));
        }
        Err(std::fs::TryLockError::Error(e)) => return Err(io(e)),
    }
    file.set_len(0).map_err(io)?;
    file.rewind().map_err(io)?;
    file.write_all(description.as_bytes()).map_err(io)?;
    file.flush().map_err(io)?;
    Ok(file)
}

/// Creates or takes over the lease object; returns its version and when
/// the winning write was sent (the lease runs from then).
async fn take(
    stores: &Stores,
    root: &StoreUri,
    uri: &StoreUri,
    holder: &Holder,
) -> Result<(ObjectVersion, Instant)> {
    let ttl = holder.ttl;
    // The live lease seen first, and when: a holder that renews it within
    // its time to live is alive.
    let mut watched: Option<(ObjectVersion, Instant, Duration)> = None;
    loop {
        let Some((bytes, version)) = stores.get_versioned(uri).await? else {
            let sent_at = Instant::now();
            match stores.put_new_versioned(uri, holder.record(false)).await {
                Ok(v) => return Ok((v, sent_at)),
                Err(StoreError::AlreadyExists { .. }) => continue,
                Err(e) => return Err(e.into()),
            }
        };
        let current: Option<LockRecord> = serde_json::from_slice(&bytes).ok();
        let takeover = match &current {
            // Unreadable: written by something else; take it only once it
            // stays unchanged for a whole time to live.
            None => false,
            Some(rec) if rec.released => true,
            // Long past its expiry even allowing for clock skew of a whole
            // time to live between hosts.
            Some(rec) => now_ms() > rec.renewed_at_ms + 2 * rec.ttl_ms,
        };
        let expired = match &watched {
            Some((seen, since, wait)) if *seen == version => since.elapsed() >= *wait,
            Some(_) => {
                let holder = current.map_or_else(String::new, |r| r.description);
                return Err(held_error(root, &holder));
            }
            None => false,
        };
        if takeover || expired {
            let sent_at = Instant::now();
            match stores.put_if(uri, holder.record(false), &version).await {
                Ok(v) => {
                    if let Some(rec) = &current
                        && !rec.released
                    {
                        warn!(previous = %rec.description, "took over the state root from a coordinator that stopped renewing it");
                    }
                    return Ok((v, sent_at));
                }
                // Someone else wrote it first: look again.
                Err(StoreError::Conflict { .. } | StoreError::AlreadyExists { .. }) => {
                    watched = None;
                    continue;
                }
                Err(e) => return Err(e.into()),
            }
        }
        if watched.is_none() {
            let holder_ttl = current
                .as_ref()
                .map_or(ttl, |r| Duration::from_millis(r.ttl_ms));
            let holder = current.as_ref().map_or("", |r| r.description.as_str());
            info!(holder, wait = ?holder_ttl, "the state root is held; waiting to see whether its holder renews it");
            watched = Some((version, Instant::now(), holder_ttl));
        }
        let poll = watched
            .as_ref()
            .map_or(ttl, |(_, _, wait)| *wait)
            .div_f64(10.0)
            .clamp(Duration::from_millis(50), Duration::from_secs(1));
        tokio::time::sleep(poll).await;
    }
}

#[allow(clippy::too_many_arguments)]
async fn renew(
    stores: Stores,
    uri: StoreUri,
    mut version: ObjectVersion,
    holder: Holder,
    fence: WriteFence,
    stop: CancellationToken,
    lost: CancellationToken,
    on_lost: CancellationToken,
) {
    let ttl = holder.ttl;
    let every = ttl / 3;
    let mut next = Instant::now() + every;
    loop {
        tokio::select! {
            _ = stop.cancelled() => break,
            _ = tokio::time::sleep_until(next) => {}
        }
        let started = Instant::now();
        match stores.put_if(&uri, holder.record(false), &version).await {
            Ok(v) => {
                version = v;
                fence.extend_until(started + ttl);
                next = started + every;
            }
            Err(StoreError::Conflict { .. }) => {
                // A retried write of ours that had landed also conflicts:
                // the lease is still ours if it names us.
                if let Ok(Some((bytes, current))) = stores.get_versioned(&uri).await
                    && serde_json::from_slice::<LockRecord>(&bytes)
                        .is_ok_and(|r| r.holder == holder.id && !r.released)
                {
                    version = current;
                    next = Instant::now();
                    continue;
                }
                fence.close();
                error!(root_lock = %uri, "another coordinator took over the state root; stopping");
                lost.cancel();
                on_lost.cancel();
                return;
            }
            Err(e) => {
                // Keep trying; the fence closes by itself once the lease
                // would have expired.
                warn!(error = %e, "renewing the state root's lease failed; retrying");
                next = Instant::now() + (every / 4).max(Duration::from_millis(50));
            }
        }
    }
    // Stopped cleanly: mark the lease released for the next coordinator.
    if let Err(e) = stores.put_if(&uri, holder.record(true), &version).await {
        warn!(error = %e, "could not mark the state root released; the next coordinator waits for it to expire");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn memory_root(name: &str) -> StoreUri {
        StoreUri::parse(&format!("memory:///{name}/")).expect("uri")
    }

    #[tokio::test(start_paused = true)]
    async fn a_live_holder_refuses_a_second_coordinator() {
        let stores = Stores::new();
        let root = memory_root("live");
        let ttl = Duration::from_secs(3);
        let first = acquire(
            &stores,
            &root,
            ttl,
            "first on :7070",
            CancellationToken::new(),
        )
        .await
        .expect("first takes the root");
        let err = acquire(&stores, &root, ttl, "second", CancellationToken::new())
            .await
            .expect_err("second refused");
        let text = err.to_string();
        assert!(
            text.contains("first on :7070") && text.contains("memory:///live/"),
            "{text}"
        );
        assert!(first.fence().is_open());
        // Released cleanly: the next one takes it at once.
        first.release().await;
        let third = acquire(&stores, &root, ttl, "third", CancellationToken::new())
            .await
            .expect("released root is free");
        third.release().await;
    }

    #[tokio::test(start_paused = true)]
    async fn a_dead_holder_is_taken_over_and_the_old_one_learns_it_lost() {
        let stores = Stores::new();
        let root = memory_root("dead");
        let ttl = Duration::from_secs(3);
        let lost = CancellationToken::new();
        let first = acquire(&stores, &root, ttl, "first", lost.clone())
            .await
            .expect("first");
        // The first stops renewing without releasing (as if paused).
        if let Kind::Object { renewer, .. } = &first.kind {
            renewer.abort();
        }
        let fence = first.fence();
        let second = acquire(&stores, &root, ttl, "second", CancellationToken::new())
            .await
            .expect("second takes over after the time to live");
        assert!(
            !fence.is_open(),
            "the first one's fence closed when its lease lapsed"
        );
        second.release().await;
        assert!(!lost.is_cancelled());
    }

    #[tokio::test]
    async fn file_roots_use_an_os_lock() {
        let dir = tempfile::tempdir().expect("tempdir");
        let root = StoreUri::from_local_path(dir.path()).expect("uri");
        let stores = Stores::new();
        let ttl = Duration::from_secs(3);
        let first = acquire(
            &stores,
            &root,
            ttl,
            "pid 1 on :7070",
            CancellationToken::new(),
        )
        .await
        .expect("first");
        let err = acquire(&stores, &root, ttl, "second", CancellationToken::new())
            .await
            .expect_err("held");
        assert!(err.to_string().contains("pid 1 on :7070"), "{err}");
        first.release().await;
        acquire(&stores, &root, ttl, "third", CancellationToken::new())
            .await
            .expect("free again")
            .release()
            .await;
    }
}
