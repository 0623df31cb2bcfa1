//! Coordinator configuration.

use std::time::Duration;

use stoke_core::StoreUri;

#[derive(Debug, Clone)]
pub struct CoordinatorConfig {
    /// The state root: every durable record lives under it.
    pub root: StoreUri,
    /// A lease not renewed for this long is taken back.
    pub lease_timeout: Duration,
    /// How long a worker with nothing to do waits before asking again.
    pub wait_retry: Duration,
    /// Time to live of the lease on a cloud state root (renewed every third
    /// of it): how long a successor waits after a coordinator dies.
    pub root_lock_ttl: Duration,
    /// Who this coordinator is (host, pid, address), shown to a second
    /// coordinator that finds the root held.
    pub description: String,
}

impl CoordinatorConfig {
    pub fn new(root: StoreUri) -> Self {
        Self {
            root,
            lease_timeout: Duration::from_secs(30),
            wait_retry: Duration::from_millis(200),
            root_lock_ttl: Duration::from_secs(15),
            description: format!("pid {}", std::process::id()),
        }
    }

    /// Workers renew three times per lease timeout.
    pub fn heartbeat_interval(&self) -> Duration {
        (self.lease_timeout / 3).max(Duration::from_millis(10))
    }

    fn expiry_check_interval(&self) -> Duration {
        (self.lease_timeout / 4).max(Duration::from_millis(10))
    }

    pub(crate) fn tick(&self) -> Duration {
        self.expiry_check_interval()
    }
}
