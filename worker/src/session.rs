//! Keeping a session with the coordinator open: register (with the leases
//! still held, so a restarted coordinator can adopt them), renew leases on
//! the session, apply the coordinator's events, and register again with
//! backoff whenever the session is lost. Everyone else reads the current
//! session id from a `watch` channel.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use stoke_core::lease::{Heartbeat, JobPhases, LeaseKey, LeaseWork, Registration, SessionEvent};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::attempt::control::ShardControl;
use crate::attempt::phases::PhaseCounters;
use crate::error::LinkErrorKind;
use crate::link::{CoordinatorLink, Session, SessionState};

/// The leases this worker works on, and how to steer each attempt.
pub(crate) type Active = Arc<Mutex<HashMap<LeaseKey, Arc<ShardControl>>>>;

const MAX_BACKOFF: Duration = Duration::from_secs(5);

pub(crate) fn active_keys(active: &Active) -> Vec<LeaseKey> {
    active
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .keys()
        .cloned()
        .collect()
}

/// Each active lease's work since its last committed checkpoint.
fn active_work(active: &Active) -> Vec<LeaseWork> {
    active
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .iter()
        .map(|(key, control)| {
            let (batches, model_ms) = control.uncommitted();
            LeaseWork {
                lease: key.clone(),
                batches,
                model_ms,
                current: control.current(),
                last_words: control.last_words(),
            }
        })
        .collect()
}

/// A brief heartbeat: each lease's batch in progress and last words only
/// (sent as a batch starts, so a death is blamed on the right batch).
fn brief(active: &Active) -> Heartbeat {
    Heartbeat {
        work: active_work(active),
        brief: true,
        ..Default::default()
    }
}

/// Where the session keeper publishes what it learns.
pub(crate) struct Signals {
    /// The current session.
    pub state: watch::Sender<SessionState>,
    /// Bumped on each `Wake` from the coordinator.
    pub wake: watch::Sender<u64>,
}

/// Runs until `stop` is cancelled; reports `phases` with every heartbeat.
pub(crate) async fn maintain<L: CoordinatorLink>(
    link: Arc<L>,
    registration: Registration,
    active: Active,
    phases: Arc<PhaseCounters>,
    signals: Signals,
    stop: CancellationToken,
) {
    let Signals {
        state: state_tx,
        wake,
    } = signals;
    let mut backoff = Duration::from_millis(100);
    while !stop.is_cancelled() {
        let mut reg = registration.clone();
        reg.held = active_keys(&active);
        let opened = tokio::select! {
            _ = stop.cancelled() => break,
            opened = link.open_session(reg) => opened,
        };
        match opened {
            Ok(session) => {
                backoff = Duration::from_millis(100);
                info!(session = %session.grant.session_id, "session open");
                let _ = state_tx.send(SessionState::Open(session.grant.session_id.clone()));
                keep(session, &active, &phases, &wake, &stop).await;
                let _ = state_tx.send(SessionState::Connecting);
                if !stop.is_cancelled() {
                    warn!("session lost; registering again");
                }
            }
            Err(e) if e.kind == LinkErrorKind::Invalid => {
                warn!(error = %e, "the coordinator refused this worker");
                let _ = state_tx.send(SessionState::Fatal(e.to_string()));
                break;
            }
            Err(e) => {
                warn!(error = %e, retry_in = ?backoff, "cannot reach the coordinator");
                tokio::select! {
                    _ = stop.cancelled() => break,
                    _ = tokio::time::sleep(backoff) => {}
                }
                backoff = (backoff * 2).min(MAX_BACKOFF);
            }
        }
    }
}

/// Renews the session's leases and applies coordinator events until the
/// session is lost or `stop` is cancelled. Dropping the session closes it.
async fn keep(
    session: Session,
    active: &Active,
    phases: &PhaseCounters,
    wake: &watch::Sender<u64>,
    stop: &CancellationToken,
) {
    let Session {
        grant,
        mut events,
        heartbeats,
        lost,
    } = session;
    let mut ticker = tokio::time::interval(grant.heartbeat_interval.max(Duration::from_millis(10)));
    // Per-job times are reported from this session's start: a coordinator
    // that restarted (or a session opened again) counts only what it saw.
    let base = phases.jobs_snapshot();
    loop {
        tokio::select! {
            _ = stop.cancelled() => {
                // The last times (a job's last checkpoint, say), so the
                // job's report counts them: best effort.
                let _ = heartbeats.send(heartbeat(active, phases, &base)).await;
                break;
            }
            _ = lost.cancelled() => break,
            // An attempt ended: its times now, not a heartbeat interval
            // later (when its job may have ended).
            _ = phases.flush_requested() => {
                if heartbeats.send(heartbeat(active, phases, &base)).await.is_err() {
                    break;
                }
            }
            _ = phases.brief_requested() => {
                if heartbeats.send(brief(active)).await.is_err() {
                    break;
                }
                phases.brief_sent();
            }
            _ = ticker.tick() => {
                if heartbeats.send(heartbeat(active, phases, &base)).await.is_err() {
                    break;
                }
            }
            event = events.recv() => match event {
                Some(SessionEvent::Wake) => wake.send_modify(|n| *n = n.wrapping_add(1)),
                Some(event) => apply(event, active),
                None => break,
            },
        }
    }
}

/// What the worker tells the coordinator on its session now: its per-job
/// times since `base` (the session's start).
fn heartbeat(active: &Active, phases: &PhaseCounters, base: &[JobPhases]) -> Heartbeat {
    let jobs = phases
        .jobs_snapshot()
        .into_iter()
        .map(|now| match base.iter().find(|b| b.job_id == now.job_id) {
            Some(b) => JobPhases {
                startup_ms: now.startup_ms.saturating_sub(b.startup_ms),
                model_ms: now.model_ms.saturating_sub(b.model_ms),
                input_wait_ms: now.input_wait_ms.saturating_sub(b.input_wait_ms),
                checkpoint_ms: now.checkpoint_ms.saturating_sub(b.checkpoint_ms),
                llm: now.llm.as_ref().map(|l| l.since(b.llm.as_ref())),
                job_id: now.job_id,
            },
            None => now,
        })
        .collect();
    let heartbeat = Heartbeat {
        leases: active_keys(active),
        stages: phases.snapshot(),
        jobs,
        work: active_work(active),
        brief: false,
    };
    for w in &heartbeat.work {
        debug!(shard = %w.lease.shard_id, batches = w.batches, "heartbeat: uncommitted work");
    }
    heartbeat
}

fn apply(event: SessionEvent, active: &Active) {
    let active = active.lock().unwrap_or_else(|p| p.into_inner());
    match event {
        SessionEvent::Revoke { leases, reason } => {
            for key in leases {
                if let Some(control) = active.get(&key) {
                    // Its first line: the whole reason (a job's failure,
                    // with the traceback) is the coordinator's to tell.
                    let reason = reason.lines().next().unwrap_or_default();
                    warn!(job = %key.job_id, shard = %key.shard_id, %reason, "lease revoked");
                    control.abort();
                }
            }
        }
        SessionEvent::Drain { leases, reason } => {
            for key in leases {
                if let Some(control) = active.get(&key) {
                    info!(job = %key.job_id, shard = %key.shard_id, %reason, "checkpointing and releasing lease");
                    control.stop();
                }
            }
        }
        SessionEvent::Split {
            lease,
            until_record,
        } => {
            if let Some(control) = active.get(&lease) {
                info!(job = %lease.job_id, shard = %lease.shard_id, until_record, "shard split; stopping at its new end");
                control.set_until(until_record);
            }
        }
        SessionEvent::Noted { lease, from_record } => {
            if let Some(control) = active.get(&lease) {
                control.noted(from_record);
            }
        }
        SessionEvent::Wake => {}
    }
}
