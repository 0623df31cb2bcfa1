//! stoke's shared, tensor-free layer, used by the coordinator (which never
//! links libtorch), the worker and the SDK.
//!
//! - [`spec`]: the job spec (TOML/JSON), strict parsing and validation;
//! - [`column_type`]: the column types a spec states, and JSON floats'
//!   width in Python;
//! - [`plan`]: the shard plan a job stores and leases carry (cutting a
//!   dataset into shards is `stoke-data`'s, ADR 011);
//! - [`layout`]: where every durable object lives under the state root;
//! - [`records`]: the durable JSON records (status, progress, manifest);
//! - [`lease`]: leases, commits and releases as domain values;
//! - [`security`]: tokens and TLS settings, and the client side of both;
//! - [`conv`]: conversions to and from the wire types of `stoke-proto`;
//! - [`schedule`]: a job's priority, weight, lease cap and queue;
//! - [`report`]: a job's efficiency report (processor time by cause);
//! - [`refusal`]: refusals a peer matches on, carried on gRPC statuses.
//!
//! Store URIs and stores are `stoke-store`'s (ADR 010); the planners and
//! the readers are `stoke-data`'s (ADR 011). Tested by unit tests
//! next to the code, against `memory://` and temporary `file://` stores.

pub mod column_type;
#[cfg(feature = "io")]
pub mod conv;
pub mod error;
pub mod field_ids;
pub mod hints;
pub mod layout;
pub mod lease;
#[cfg(feature = "io")]
pub mod logging;
pub mod plan;
pub mod progress;
pub mod records;
#[cfg(feature = "io")]
pub mod refusal;
pub mod report;
pub mod schedule;
#[cfg(feature = "io")]
pub mod security;
pub mod spec;

pub use error::{ConvError, SpecError};

/// The protocol version every conversation starts with. A peer with another
/// version is refused with an error that names both. 2: a lease carries
/// its job's spec only as a session's first lease of the job. 3: a job's
/// metrics reduce task (`ReduceMetrics`, `CommitMetrics`), which a worker
/// of version 2 could not take.
pub const PROTOCOL_VERSION: u32 = 3;

/// The Python for Python processors that a pip install's launcher
/// (`stoke/_launch.py`) names for the binaries it starts: its own
/// interpreter. The worker takes it after `--python` / `STOKE_PYTHON`, in
/// place of the venv it was built against.
pub const DEFAULT_PYTHON_VAR: &str = "STOKE_DEFAULT_PYTHON";

/// `STOKE_*` variables that the project's own scripts export (cache and
/// venv locations), `STOKE_DEBUG` (errors in full, see
/// [`logging::DEBUG_VAR`]), the LLM engine's python (read by the `llm`
/// processor, see [`spec::llm::LLM_PYTHON_ENV`]), the pip install's
/// launcher's Python ([`DEFAULT_PYTHON_VAR`]) and the engine host's
/// fault points for tests, not flags: the binaries' check for unknown
/// variables passes them over.
#[cfg(feature = "io")]
pub const TOOLING_ENV_VARS: [&str; 10] = [
    "STOKE_CACHE",
    "STOKE_VENV",
    "STOKE_BIN_DIR",
    "STOKE_REPO",
    logging::DEBUG_VAR,
    spec::llm::LLM_PYTHON_ENV,
    DEFAULT_PYTHON_VAR,
    "STOKE_LLM_VENV",
    "STOKE_LLM_FAULT_ABORT_ON",
    "STOKE_LLM_FAULT_HANG_ON",
];

/// `STOKE_*` variables in the environment that a binary does not read,
/// given the ones its flags read (`flag_vars`); the store's, security's
/// and tooling's variables are known to every binary. Most often a typo,
/// or one binary's setting given to another.
#[cfg(feature = "io")]
pub fn unknown_env_vars(flag_vars: impl IntoIterator<Item = String>) -> Vec<String> {
    let known: Vec<String> = flag_vars
        .into_iter()
        .chain(stoke_store::STORE_ENV_VARS.iter().map(|s| s.to_string()))
        .chain(TOOLING_ENV_VARS.iter().map(|s| s.to_string()))
        .chain(security::SECURITY_ENV_VARS.iter().map(|s| s.to_string()))
        .collect();
    std::env::vars()
        .map(|(k, _)| k)
        .filter(|k| k.starts_with("STOKE_") && !known.contains(k))
        .collect()
}

/// How libtorch's OpenMP threads wait between parallel regions, for every
/// libtorch process stoke starts. By default libgomp spins for about 3 ms
/// after each region, taking the cores that reading and decoding need (a
/// W1 run with two busy processes beside it: 6.5 s, against 3.1 s like
/// this); waiting passively at once makes every region wake its threads
/// through the kernel, which costs small batches dearly (the ragged
/// benchmark: 15.3k records/s, against 24.3k like this). So: spin about
/// 0.1 ms (`GOMP_SPINCOUNT`, which libgomp honours over the policy), then
/// sleep; `PASSIVE` for OpenMP runtimes that do not read `GOMP_SPINCOUNT`.
pub const OPENMP_WAIT: [(&str, &str); 2] =
    [("OMP_WAIT_POLICY", "PASSIVE"), ("GOMP_SPINCOUNT", "10000")];

/// The variables of [`OPENMP_WAIT`] a libtorch process should get: none
/// when the user set either of them (their choice stands), else both.
/// OpenMP reads them when it loads, before `main`.
#[cfg(feature = "io")]
pub fn openmp_wait_env() -> &'static [(&'static str, &'static str)] {
    if OPENMP_WAIT
        .iter()
        .any(|(name, _)| std::env::var_os(name).is_some())
    {
        &[]
    } else {
        &OPENMP_WAIT
    }
}

/// The checksum stoke records for every output object: SHA-256, hex.
pub fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest;
    hex::encode(sha2::Sha256::digest(bytes))
}
