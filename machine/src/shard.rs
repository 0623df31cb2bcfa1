//! A shard's holder: its lease (`ActiveLease`), and who has the shard
//! now (`ShardSlot`: free, leased, raced by a backup, or being written).

use super::*;

#[derive(Clone)]
pub(super) struct ActiveLease {
    pub(super) session_id: String,
    pub(super) token: u64,
    /// When it expires unless its holder's heartbeat renews it.
    pub(super) expires_at: Instant,
    /// When it was granted (or adopted): a lease younger than the minimum
    /// age is not preempted.
    pub(super) granted: Instant,
    /// Its holder was asked to checkpoint and release it for other work.
    pub(super) preempted: bool,
    /// Batches since its last commit, as its worker last reported them.
    pub(super) work: account::Work,
    /// The batch its worker reported starting, until a commit covers it
    /// or the worker reports none: what a death is blamed on.
    pub(super) current: Option<crash::InFlight>,
    /// Why its worker said it is about to die.
    pub(super) last_words: Option<String>,
}

impl ActiveLease {
    pub(super) fn new(session_id: &str, token: u64, expires_at: Instant, now: Instant) -> Self {
        Self {
            session_id: session_id.to_string(),
            token,
            expires_at,
            granted: now,
            preempted: false,
            work: Default::default(),
            current: None,
            last_words: None,
        }
    }
}

pub(super) struct ShardState {
    /// Shared, so a finishing job hands every record to the writer of its
    /// manifest without copying them.
    pub(super) progress: Arc<ProgressRecord>,
    /// Who has it now: its holder, and a backup racing the holder.
    pub(super) slot: ShardSlot,
}

impl ShardState {
    pub(super) fn new(progress: ProgressRecord) -> Self {
        Self {
            progress: Arc::new(progress),
            slot: ShardSlot::default(),
        }
    }

    /// Its holder's lease.
    pub(super) fn lease(&self) -> Option<&ActiveLease> {
        self.slot.lease()
    }

    pub(super) fn lease_mut(&mut self) -> Option<&mut ActiveLease> {
        self.slot.lease_mut()
    }

    /// The backup racing its holder (`backup.rs`).
    pub(super) fn backup(&self) -> Option<&ActiveLease> {
        match &self.slot {
            ShardSlot::Racing { backup, .. } => Some(backup),
            _ => None,
        }
    }

    /// A record of it is being stored.
    pub(super) fn writing(&self) -> bool {
        matches!(self.slot, ShardSlot::Writing(_))
    }

    /// A backup races its holder.
    pub(super) fn racing(&self) -> bool {
        matches!(self.slot, ShardSlot::Racing { .. })
    }
}

/// Who has a shard now. Whether it is done is its progress's.
pub(super) enum ShardSlot {
    /// No one: it waits for a worker (in `Job::pending` while its job
    /// runs), or it is done. A split's new shard is reserved for the
    /// session it was sized for, until the instant given: other workers
    /// leave it while that session comes for it (see `split.rs`).
    Free { reserved: Option<(String, Instant)> },
    /// A worker holds it.
    Leased(ActiveLease),
    /// A second attempt races the holder for the shard's uncommitted
    /// remainder, at a job's tail (`backup.rs`): the first of the two to
    /// commit keeps the shard. A backup exists only beside a holder, and
    /// no record of the shard is stored while they race (the race is
    /// settled, or the backup dropped, first).
    Racing {
        holder: ActiveLease,
        backup: ActiveLease,
    },
    /// A record of it (a commit's, a failed attempt's, a crash's, a
    /// split's) is being stored: its lease, if it has one, stays put until
    /// it is.
    Writing(Option<ActiveLease>),
}

impl Default for ShardSlot {
    fn default() -> Self {
        Self::Free { reserved: None }
    }
}

impl ShardSlot {
    /// The holder's lease.
    pub(super) fn lease(&self) -> Option<&ActiveLease> {
        match self {
            Self::Leased(lease)
            | Self::Racing { holder: lease, .. }
            | Self::Writing(Some(lease)) => Some(lease),
            Self::Free { .. } | Self::Writing(None) => None,
        }
    }

    pub(super) fn lease_mut(&mut self) -> Option<&mut ActiveLease> {
        match self {
            Self::Leased(lease)
            | Self::Racing { holder: lease, .. }
            | Self::Writing(Some(lease)) => Some(lease),
            Self::Free { .. } | Self::Writing(None) => None,
        }
    }

    /// Every attempt at it: its holder, then its backup.
    pub(super) fn attempts(&self) -> impl Iterator<Item = &ActiveLease> {
        let (holder, backup) = match self {
            Self::Racing { holder, backup } => (Some(holder), Some(backup)),
            other => (other.lease(), None),
        };
        holder.into_iter().chain(backup)
    }

    pub(super) fn attempts_mut(&mut self) -> impl Iterator<Item = &mut ActiveLease> {
        let (holder, backup) = match self {
            Self::Racing { holder, backup } => (Some(holder), Some(backup)),
            other => (other.lease_mut(), None),
        };
        holder.into_iter().chain(backup)
    }

    /// A record of the shard starts being stored; its lease stays. Called
    /// once a race is settled: a backup still racing is ended and given
    /// back, so no lease is dropped unseen.
    pub(super) fn begin_write(&mut self) -> Option<ActiveLease> {
        let (slot, ended) = match std::mem::take(self) {
            Self::Leased(lease) => (Self::Writing(Some(lease)), None),
            Self::Racing { holder, backup } => (Self::Writing(Some(holder)), Some(backup)),
            Self::Free { .. } => (Self::Writing(None), None),
            writing @ Self::Writing(_) => (writing, None),
        };
        *self = slot;
        ended
    }

    /// The record is stored (or not): the lease, if any, is held again.
    pub(super) fn end_write(&mut self) {
        *self = match std::mem::take(self) {
            Self::Writing(Some(lease)) => Self::Leased(lease),
            Self::Writing(None) => Self::default(),
            other => other,
        };
    }

    /// Gives it `lease` as its holder; whether it had none.
    pub(super) fn put_lease(&mut self, lease: ActiveLease) -> bool {
        match self {
            Self::Free { .. } => {
                *self = Self::Leased(lease);
                true
            }
            Self::Leased(held) | Self::Racing { holder: held, .. } => {
                *held = lease;
                false
            }
            Self::Writing(held) => held.replace(lease).is_none(),
        }
    }

    /// Takes its holder's lease away (a record being stored stays so); a
    /// racing backup holds it from then on.
    pub(super) fn take_lease(&mut self) -> Option<ActiveLease> {
        match std::mem::take(self) {
            Self::Leased(lease) => Some(lease),
            Self::Racing { holder, backup } => {
                *self = Self::Leased(backup);
                Some(holder)
            }
            Self::Writing(lease) => {
                *self = Self::Writing(None);
                lease
            }
            free @ Self::Free { .. } => {
                *self = free;
                None
            }
        }
    }

    /// Starts a race: `backup` beside its holder. Whether it could: not
    /// when the shard has no plain holder (free, raced already, or being
    /// written), and then `backup` is dropped.
    pub(super) fn race(&mut self, backup: ActiveLease) -> bool {
        match std::mem::take(self) {
            Self::Leased(holder) => {
                *self = Self::Racing { holder, backup };
                true
            }
            other => {
                *self = other;
                false
            }
        }
    }

    /// Ends the race for the holder: the backup, taken away.
    pub(super) fn take_backup(&mut self) -> Option<ActiveLease> {
        match std::mem::take(self) {
            Self::Racing { holder, backup } => {
                *self = Self::Leased(holder);
                Some(backup)
            }
            other => {
                *self = other;
                None
            }
        }
    }

    /// Takes every attempt away, holder's and backup's (the job ended).
    pub(super) fn take_all(&mut self) -> impl Iterator<Item = ActiveLease> + use<> {
        let (holder, backup) = match std::mem::take(self) {
            Self::Racing { holder, backup } => (Some(holder), Some(backup)),
            Self::Leased(lease) => (Some(lease), None),
            Self::Writing(lease) => {
                *self = Self::Writing(None);
                (lease, None)
            }
            free @ Self::Free { .. } => {
                *self = free;
                (None, None)
            }
        };
        holder.into_iter().chain(backup)
    }
}

#[cfg(test)]
#[allow(
    clippy::disallowed_methods,
    reason = "a unit test makes its own `Instant`"
)]
mod tests {
    use super::*;

    fn lease(token: u64) -> ActiveLease {
        let now = Instant::now();
        ActiveLease::new("s", token, now, now)
    }

    #[test]
    fn a_shard_slot_keeps_its_lease_through_a_write_and_loses_it_only_when_taken() {
        let mut slot = ShardSlot::default();
        assert!(slot.put_lease(lease(1)), "a free slot had no lease");
        assert!(!slot.put_lease(lease(2)), "a leased slot had one");
        assert!(slot.begin_write().is_none());
        assert!(matches!(slot, ShardSlot::Writing(Some(_))));
        assert_eq!(slot.lease().map(|l| l.token), Some(2));
        // Taken while its record is stored: still writing, now without it.
        assert_eq!(slot.take_lease().map(|l| l.token), Some(2));
        assert!(matches!(slot, ShardSlot::Writing(None)));
        slot.end_write();
        assert!(matches!(slot, ShardSlot::Free { reserved: None }));
        // A write that ends with the lease still there gives it back.
        slot.put_lease(lease(3));
        assert!(slot.begin_write().is_none());
        slot.end_write();
        assert!(matches!(&slot, ShardSlot::Leased(l) if l.token == 3));
        // Taking the lease of a free slot keeps its reservation.
        let mut reserved = ShardSlot::Free {
            reserved: Some(("asker".to_string(), Instant::now())),
        };
        assert!(reserved.take_lease().is_none());
        assert!(matches!(reserved, ShardSlot::Free { reserved: Some(_) }));
    }

    #[test]
    fn a_backup_races_only_beside_a_holder_and_stands_in_when_the_holder_goes() {
        // No holder, or a record being stored: no race.
        let mut free = ShardSlot::default();
        assert!(!free.race(lease(9)));
        assert!(matches!(free, ShardSlot::Free { reserved: None }));
        let mut writing = ShardSlot::Leased(lease(1));
        assert!(writing.begin_write().is_none());
        assert!(!writing.race(lease(9)));
        assert!(matches!(&writing, ShardSlot::Writing(Some(l)) if l.token == 1));

        let mut slot = ShardSlot::Leased(lease(1));
        assert!(slot.race(lease(2)));
        assert!(!slot.race(lease(3)), "one backup at a time");
        let tokens: Vec<u64> = slot.attempts().map(|l| l.token).collect();
        assert_eq!(tokens, [1, 2]);
        assert_eq!(slot.lease().map(|l| l.token), Some(1));
        // The holder goes: its backup holds the shard.
        assert_eq!(slot.take_lease().map(|l| l.token), Some(1));
        assert!(matches!(&slot, ShardSlot::Leased(l) if l.token == 2));
        // The holder wins: the backup is taken, the holder stays.
        assert!(slot.race(lease(3)));
        assert_eq!(slot.take_backup().map(|l| l.token), Some(3));
        assert!(matches!(&slot, ShardSlot::Leased(l) if l.token == 2));
        assert!(slot.take_backup().is_none());
        // A record begun while racing ends the backup, and says so.
        assert!(slot.race(lease(4)));
        assert_eq!(slot.begin_write().map(|l| l.token), Some(4));
        assert!(matches!(&slot, ShardSlot::Writing(Some(l)) if l.token == 2));
        slot.end_write();
        // The job ends: every attempt is taken.
        assert!(slot.race(lease(5)));
        let all: Vec<u64> = slot.take_all().map(|l| l.token).collect();
        assert_eq!(all, [2, 5]);
        assert!(matches!(slot, ShardSlot::Free { reserved: None }));
    }
}
