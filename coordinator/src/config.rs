//! Coordinator configuration: what the machine decides by
//! ([`MachineConfig`], which this derefs to, so `config.lease_timeout`
//! reads and sets it) and what serving needs (security, request limits,
//! the root's lock).

use std::ops::{Deref, DerefMut};
use std::time::Duration;

use stoke_store::StoreUri;

pub use stoke_machine::config::{
    DEFAULT_MAX_JOBS, DEFAULT_PREEMPT_MIN_AGE, DEFAULT_PREEMPT_PER_S, DEFAULT_STARTUP_MARGIN,
    MachineConfig,
};

use crate::security::ServerSecurity;

#[derive(Debug, Clone)]
pub struct CoordinatorConfig {
    /// What the machine decides by: the state root, lease timeout, queues,
    /// pools, prices, preemption.
    pub machine: MachineConfig,
    /// Time to live of the lease on a cloud state root (renewed every third
    /// of it): how long a successor waits after a coordinator dies.
    pub root_lock_ttl: Duration,
    /// Who this coordinator is (host, pid, address), shown to a second
    /// coordinator that finds the root held.
    pub description: String,
    /// Tokens and TLS (default: none, for loopback and tests).
    pub security: ServerSecurity,
    /// Largest gRPC request accepted, in bytes.
    pub max_request_bytes: usize,
    /// Largest job spec accepted at submit, in bytes.
    pub max_spec_bytes: usize,
}

/// Defaults for the limits.
pub const DEFAULT_MAX_REQUEST_BYTES: usize = 16 * 1024 * 1024;
pub const DEFAULT_MAX_SPEC_BYTES: usize = 1024 * 1024;

impl CoordinatorConfig {
    pub fn new(root: StoreUri) -> Self {
        Self {
            machine: MachineConfig::new(root),
            root_lock_ttl: Duration::from_secs(15),
            description: format!("pid {}", std::process::id()),
            security: ServerSecurity::default(),
            max_request_bytes: DEFAULT_MAX_REQUEST_BYTES,
            max_spec_bytes: DEFAULT_MAX_SPEC_BYTES,
        }
    }
}

impl Deref for CoordinatorConfig {
    type Target = MachineConfig;

    fn deref(&self) -> &MachineConfig {
        &self.machine
    }
}

impl DerefMut for CoordinatorConfig {
    fn deref_mut(&mut self) -> &mut MachineConfig {
        &mut self.machine
    }
}
