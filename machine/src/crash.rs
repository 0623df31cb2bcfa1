//! Crashes: a worker that dies while processing a batch is evidence
//! against that batch's records, not only a lost lease.
//!
//! Workers report each batch as it starts (a brief heartbeat, see
//! `sessions.rs`), and last words when they know they are about to die (a
//! fatal signal, a batch past `batch_timeout`, a sticky device error). A
//! lease lost with a batch in progress (its session broke, or it expired)
//! is a *crash* against that batch; a graceful release, a coordinator
//! restart (leases are adopted) and a worker idle between batches are not.
//!
//! Crashes narrow a [`Suspect`] stored in the shard's progress record, so
//! a restarted coordinator goes on where this one stopped:
//! - deaths on the same batch are counted; at the job's `crash_threshold`
//!   the shard is *isolated*: its next attempt cuts a batch where the
//!   suspect starts, processes it `probe` records (half of it) at a time and
//!   commits after each, so the next death names one probe exactly;
//! - that probe is the new suspect, halved again, down to one record
//!   (about `threshold + log2(batch_size)` deaths for a poison record);
//! - the record whose processing alone killed a worker follows the job's
//!   error policy: `skip` writes it under `errors/` and moves the shard
//!   past it, `fail` fails the job naming it.
//!
//! Records proven innocent are committed as they pass, exactly once; a
//! suspect range that passes whole (a partition, not a poison record) is
//! cleared by the commit that reaches its end (`commit.rs`).

use bytes::Bytes;
use std::time::Instant;
use stoke_core::lease::{BatchSpan, Isolation};
use stoke_core::records::{OutputObject, ProgressRecord, Suspect};
use stoke_core::sha256_hex;
use stoke_core::spec::ErrorPolicy;
use stoke_uri::StoreUri;
use tracing::{error, warn};

use super::{ActiveLease, Io, Job, State, Then, progress_log};

/// How the holder of a lease was lost.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Death {
    /// Its session (connection) ended.
    SessionEnded,
    /// It stopped renewing the lease.
    LeaseExpired,
    /// It lives on, and gave the lease back saying its batch crashed (its
    /// LLM engine, a child process, died).
    Reported,
}

impl Death {
    /// What is said of the death when the worker left no last words.
    fn words(self) -> &'static str {
        match self {
            Death::SessionEnded => "worker process died (its connection closed)",
            Death::LeaseExpired => "worker stopped renewing its lease (hung or cut off)",
            Death::Reported => "the worker reported a crash of its batch",
        }
    }
}

/// The batch a lease's holder reported starting, and when.
#[derive(Debug, Clone)]
pub(super) struct InFlight {
    pub span: BatchSpan,
    pub since: Instant,
}

/// What a crash makes of the shard's suspect.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Still narrowing down: the shard's new suspect.
    Suspect(Suspect),
    /// The record at this offset killed a worker on its own.
    Culprit(u64),
}

/// Half of `len`, rounded up: the next probe size.
fn half(len: u64) -> u64 {
    len.div_ceil(2).max(1)
}

/// The verdict of a death while `span` was in progress, given the shard's
/// suspect so far, the job's `threshold`, and `position` (the record the
/// shard's committed progress reaches, an offset in its origin). Pure, so
/// the bisection is tested on its own.
pub fn judge(prior: Option<Suspect>, span: &BatchSpan, threshold: u32, position: u64) -> Verdict {
    let fresh = |crashes| Suspect {
        batch: span.batch,
        from: span.from,
        until: span.until(),
        crashes,
        probe: None,
    };
    let alone = span.records <= 1 && position == span.from;
    match prior {
        // An isolated probe died: exact (it ran alone, committed before
        // it), so no threshold. One record is the culprit; a longer probe
        // is the new suspect, halved.
        Some(p) if p.isolating() && span.from >= p.from && span.until() <= p.until => {
            if alone {
                return Verdict::Culprit(span.from);
            }
            let s = fresh(1);
            let probe = half(s.len());
            Verdict::Suspect(Suspect {
                probe: Some(probe),
                ..s
            })
        }
        prior => {
            let mut s = match prior {
                Some(p) if !p.isolating() && p.from == span.from => Suspect {
                    crashes: p.crashes + 1,
                    until: p.until.max(span.until()),
                    batch: span.batch,
                    ..p
                },
                // Spans that overlap without starting together (an LLM
                // worker blames the batches whose prompts were in its
                // engine, and which batch was running when it died
                // varies): the same cause lies where both reach.
                Some(p) if !p.isolating() && p.from < span.until() && span.from < p.until => {
                    let (from, batch) = if p.from > span.from {
                        (p.from, p.batch)
                    } else {
                        (span.from, span.batch)
                    };
                    Suspect {
                        crashes: p.crashes + 1,
                        from,
                        until: p.until.min(span.until()),
                        batch,
                        probe: None,
                    }
                }
                _ => fresh(1),
            };
            if s.crashes >= threshold {
                if s.len() <= 1 && alone {
                    return Verdict::Culprit(span.from);
                }
                // Isolate: a one-record batch not committed up to is
                // probed alone first (then it is alone).
                s.probe = Some(half(s.len()));
            }
            Verdict::Suspect(s)
        }
    }
}

/// A crash whose progress record is being stored.
pub(super) struct Crashed {
    pub job_id: String,
    pub idx: usize,
    /// The dead holder's lease, for log lines.
    pub token: u64,
    pub worker: String,
    pub progress: ProgressRecord,
    pub log_uri: StoreUri,
    /// The culprit was skipped: why (for the job's reason past
    /// `max_skipped`).
    pub skipped: Option<String>,
    /// The culprit fails the job: why.
    pub fail: Option<String>,
}

impl Job {
    /// Shard `idx`'s holder `lease` (of `worker`) died processing the
    /// batch it last reported (`None` when it reported none: no crash).
    /// Judges the death by this job's rules (its crash threshold, the
    /// shard's suspect, its error policy), marks the shard written and
    /// returns the crash to store as record `seq`, with the objects to
    /// put (its progress log, and a skipped record's error line).
    fn crash(
        &mut self,
        idx: usize,
        lease: &ActiveLease,
        worker: &str,
        death: Death,
        seq: u64,
        now: Instant,
    ) -> Option<(Crashed, Vec<(StoreUri, Bytes)>)> {
        let in_flight = lease.current.clone()?;
        let job = self;
        let job_id = job.id.clone();
        let span = in_flight.span;
        let dying = now.saturating_duration_since(in_flight.since);
        job.account.crashed(lease.work, dying);
        let words = lease
            .last_words
            .clone()
            .unwrap_or_else(|| death.words().to_string());
        let plan_shard = &job.plan.shards[idx];
        let shard_id = plan_shard.id.clone();
        let origin = plan_shard.origin().to_string();
        let mut progress = (*job.shards[idx].progress).clone();
        let position = plan_shard.from_record() + progress.records;
        progress.crashes += 1;
        progress.last_crash = Some(format!(
            "{words} while processing batch {} (records {}..{}) on {worker}",
            span.batch,
            span.from,
            span.until()
        ));
        progress.seq = seq;
        let threshold = job.spec.errors.crash_threshold;
        let verdict = judge(progress.suspect.take(), &span, threshold, position);
        let log_uri = job.layout.progress_log(seq);
        let mut puts = Vec::new();
        let mut skipped = None;
        let mut fail = None;
        match verdict {
            Verdict::Suspect(s) => {
                warn!(job = %job_id, shard = %shard_id, token = lease.token, batch = span.batch, from = s.from, until = s.until, crashes = s.crashes, isolating = s.isolating(), worker = %worker, %words, "worker crashed processing a batch");
                progress.suspect = Some(s);
            }
            Verdict::Culprit(offset) => {
                let id = span
                    .ids
                    .first()
                    .cloned()
                    .unwrap_or_else(|| format!("{origin}:{offset}"));
                let why = format!("{words} while processing this record alone");
                error!(job = %job_id, shard = %shard_id, token = lease.token, record = %id, worker = %worker, %why, "record isolated: it kills its worker");
                match job.spec.errors.policy {
                    ErrorPolicy::Skip => {
                        let line = serde_json::json!({ "id": id, "reason": why });
                        let mut bytes = line.to_string().into_bytes();
                        bytes.push(b'\n');
                        let uri = job
                            .layout
                            .errors_prefix(&shard_id, lease.token)
                            .join(&format!("crash-{offset:012}.jsonl"));
                        progress.errors.push(OutputObject {
                            uri: uri.to_string(),
                            records: 1,
                            bytes: bytes.len() as u64,
                            sha256: sha256_hex(&bytes),
                        });
                        puts.push((uri, Bytes::from(bytes)));
                        progress.records += 1;
                        progress.next_batch += 1;
                        progress.skipped += 1;
                        skipped = Some(format!("record {id}: {why}"));
                    }
                    ErrorPolicy::Fail => {
                        fail = Some(format!(
                            "record {id} (shard {shard_id}, batch {}): {why}",
                            span.batch
                        ));
                    }
                }
            }
        }
        puts.push((log_uri.clone(), progress_log(std::iter::once(&progress))));
        job.begin_write(idx);
        let crashed = Crashed {
            job_id,
            idx,
            token: lease.token,
            worker: worker.to_string(),
            progress,
            log_uri,
            skipped,
            fail,
        };
        Some((crashed, puts))
    }
}

impl State {
    /// Shard `idx` of `job_id`'s id, for log lines.
    pub(super) fn shard_name(&self, job_id: &str, idx: usize) -> String {
        self.jobs
            .by_id
            .get(job_id)
            .and_then(|j| j.plan.shards.get(idx))
            .map(|s| s.id.clone())
            .unwrap_or_default()
    }

    /// `lease` of shard `idx` of `job_id` was lost with its holder
    /// (`worker`). With a batch in progress this is a crash: it is stored
    /// (the shard is requeued once it is) and true is returned; otherwise
    /// false, and the caller requeues the shard as for any lost lease.
    pub(super) fn lease_lost(
        &mut self,
        job_id: &str,
        idx: usize,
        lease: &ActiveLease,
        worker: &str,
        death: Death,
        now: Instant,
    ) -> bool {
        if lease.current.is_none() {
            return false;
        }
        let seq = self.next_seq();
        let Some(job) = self.jobs.by_id.get_mut(job_id) else {
            return false;
        };
        let Some((crashed, puts)) = job.crash(idx, lease, worker, death, seq, now) else {
            return false;
        };
        self.meters.counters.worker_crashes += 1;
        self.start_io(Io::Puts(puts), Then::Crashed(Box::new(crashed)));
        true
    }

    /// A lease given back by a worker whose batch crashed while the
    /// worker lives on (a [`Release`] with `crashed`): judged as if the
    /// worker had died processing the batch it last reported, with the
    /// release's error as its last words. Without a batch in progress it
    /// is a clean release.
    ///
    /// [`Release`]: stoke_core::lease::Release
    pub(super) fn crash_released(
        &mut self,
        req: super::ReqId,
        release: &stoke_core::lease::Release,
        idx: usize,
        now: Instant,
    ) -> crate::error::Result<()> {
        let key = &release.key;
        if let Some(session) = self.fleet.sessions.get_mut(&release.session_id) {
            session.leases.remove(&(key.job_id.clone(), idx));
        }
        let worker = self.fleet.worker_of(&release.session_id);
        let job = self.job_mut(&key.job_id)?;
        if let Some(mut lease) = job.take_lease(idx) {
            if let Some(words) = &release.error {
                lease.last_words = Some(words.clone());
            }
            if !self.lease_lost(&key.job_id, idx, &lease, &worker, Death::Reported, now) {
                let job = self.job_mut(&key.job_id)?;
                if job.life.running() {
                    job.pending.push_front(idx);
                    self.wake(1);
                }
            }
        }
        self.reply(Some(req), super::Answer::Done(Ok(())));
        Ok(())
    }

    /// A crash's progress record is stored (or not): apply it, requeue
    /// the shard, and fail or check the job as its policy says.
    pub(super) fn crash_stored(&mut self, crashed: Crashed, result: crate::error::Result<()>) {
        let Crashed {
            job_id,
            idx,
            token,
            worker,
            progress,
            log_uri,
            skipped,
            fail,
        } = crashed;
        let Some(job) = self.jobs.by_id.get_mut(&job_id) else {
            return;
        };
        job.shards[idx].slot.end_write();
        let stored = result.is_ok();
        if let Err(e) = result {
            // Nothing changed: the shard goes on as after any lost lease
            // (the next death on it counts again).
            warn!(job = %job_id, shard = %job.plan.shards[idx].id, token, worker = %worker, error = %e, "storing a crash failed");
        } else {
            job.progress_objects.push(log_uri);
            job.totals.logged += 1;
            job.set_progress(idx, progress);
        }
        let running = job.life.running();
        if running && !job.shards[idx].progress.done {
            job.pending.push_front(idx);
            self.wake(1);
        }
        if !stored {
            return;
        }
        if let Some(reason) = fail {
            self.fail_job(&job_id, reason);
        } else if let Some(reason) = skipped {
            self.check_skip_limit(&job_id, Some(&reason));
        }
    }
}

/// What an isolated attempt is told: the shard's suspect, while isolating.
pub(super) fn isolation(progress: &ProgressRecord) -> Option<Isolation> {
    let s = progress.suspect.as_ref()?;
    Some(Isolation {
        from: s.from,
        until: s.until,
        probe: s.probe?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn span(batch: u64, from: u64, records: u64) -> BatchSpan {
        BatchSpan {
            batch,
            from,
            records,
            ..Default::default()
        }
    }

    fn suspect(v: Verdict) -> Suspect {
        match v {
            Verdict::Suspect(s) => s,
            Verdict::Culprit(o) => panic!("culprit {o} too early"),
        }
    }

    #[test]
    fn a_poison_record_in_a_batch_of_64_costs_eight_deaths() {
        // Batch 7 holds records 448..512; record 470 kills every worker.
        let poison = 470;
        let mut s = None;
        let mut position = 448;
        let mut deaths = 0;
        // Normal mode: the whole batch, twice (the threshold).
        for _ in 0..2 {
            deaths += 1;
            s = Some(suspect(judge(s, &span(7, 448, 64), 2, position)));
        }
        let mut cur = s.clone().expect("suspect");
        assert_eq!((cur.from, cur.until, cur.probe), (448, 512, Some(32)));
        // Isolated: probes run in order, each committed; the one holding
        // the poison record dies.
        let verdict = loop {
            let probe = cur.probe.expect("isolating");
            let mut from = cur.from;
            let dead = loop {
                let until = (from + probe).min(cur.until);
                if (from..until).contains(&poison) {
                    break span(7, from, until - from);
                }
                from = until; // survived: committed
                position = until;
            };
            deaths += 1;
            match judge(Some(cur.clone()), &dead, 2, position) {
                Verdict::Suspect(next) => {
                    assert_eq!((next.from, next.until), (dead.from, dead.until()));
                    cur = next;
                }
                culprit => break culprit,
            }
        };
        assert_eq!(verdict, Verdict::Culprit(poison));
        assert_eq!(deaths, 8, "2 + log2(64)");
    }

    #[test]
    fn deaths_on_different_batches_start_the_count_again() {
        let s = suspect(judge(None, &span(3, 30, 10), 2, 30));
        assert_eq!((s.crashes, s.probe), (1, None));
        let s = suspect(judge(Some(s), &span(4, 40, 10), 2, 30));
        assert_eq!((s.from, s.crashes, s.probe), (40, 1, None));
        let s = suspect(judge(Some(s), &span(4, 40, 10), 2, 30));
        assert_eq!((s.from, s.until, s.crashes, s.probe), (40, 50, 2, Some(5)));
    }

    #[test]
    fn overlapping_spans_count_together_and_narrow_to_where_both_reach() {
        // Batches 3..6 had prompts in the engine at the first death, 4..6
        // at the second (batch 3 had committed meanwhile).
        let s = suspect(judge(None, &span(3, 30, 30), 2, 30));
        let s = suspect(judge(Some(s), &span(4, 40, 20), 2, 40));
        assert_eq!(
            (s.batch, s.from, s.until, s.crashes, s.probe),
            (4, 40, 60, 2, Some(10))
        );
        // A later span inside the first: narrowed to it.
        let s = suspect(judge(None, &span(3, 30, 30), 3, 30));
        let s = suspect(judge(Some(s), &span(3, 30, 10), 3, 30));
        assert_eq!((s.from, s.until, s.crashes), (30, 60, 2));
        let s = suspect(judge(Some(s), &span(5, 50, 20), 3, 50));
        assert_eq!((s.batch, s.from, s.until, s.crashes), (5, 50, 60, 3));
    }

    #[test]
    fn a_threshold_of_one_isolates_at_the_first_death() {
        let s = suspect(judge(None, &span(0, 0, 5), 1, 0));
        assert_eq!(s.probe, Some(3));
    }

    #[test]
    fn a_one_record_batch_not_committed_up_to_is_probed_before_it_is_blamed() {
        // batch_size 1, checkpoint every 4: the dead batch's record is not
        // where the committed progress ends, so skipping it would skip
        // the records before it too.
        let s = suspect(judge(None, &span(9, 9, 1), 1, 6));
        assert_eq!((s.from, s.until, s.probe), (9, 10, Some(1)));
        assert_eq!(judge(Some(s), &span(9, 9, 1), 1, 9), Verdict::Culprit(9));
    }

    #[test]
    fn a_death_outside_the_isolated_range_is_a_new_suspect() {
        let isolating = Suspect {
            batch: 2,
            from: 20,
            until: 30,
            crashes: 1,
            probe: Some(5),
        };
        let s = suspect(judge(Some(isolating), &span(5, 50, 10), 2, 50));
        assert_eq!((s.from, s.crashes, s.probe), (50, 1, None));
    }
}
