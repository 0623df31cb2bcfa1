//! stoke's shared, tensor-free layer, used by the coordinator (which never
//! links libtorch), the worker and the SDK.
//!
//! - [`spec`]: the job spec (TOML/JSON), strict parsing and validation;
//! - [`plan`]: cutting a dataset into shards (Parquet row groups, JSON Lines
//!   byte ranges, `files` objects, synthetic `range`);
//! - [`store`]: store URIs and the one place that opens an `object_store`;
//! - [`layout`]: where every durable object lives under the state root;
//! - [`records`]: the durable JSON records (status, progress, manifest);
//! - [`lease`]: leases, commits and releases as domain values;
//! - [`security`]: tokens and TLS settings, and the client side of both;
//! - [`conv`]: conversions to and from the wire types of `stoke-proto`.
//!
//! Tested by unit tests next to the code, against `memory://` and temporary
//! `file://` stores.

pub mod conv;
pub mod error;
pub mod layout;
pub mod lease;
pub mod logging;
pub mod parquet_source;
pub mod plan;
pub mod progress;
pub mod records;
pub mod security;
pub mod spec;
pub mod store;

pub use error::{ConfigError, ConvError, PlanError, SpecError, StoreError, UriError};
pub use store::{StoreConfig, StoreUri, Stores};

/// The protocol version every conversation starts with. A peer with another
/// version is refused with an error that names both.
pub const PROTOCOL_VERSION: u32 = 1;

/// `STOKE_*` variables that the project's own scripts export (cache and
/// venv locations), not configuration: the binaries' check for unknown
/// variables passes them over.
pub const TOOLING_ENV_VARS: [&str; 4] =
    ["STOKE_CACHE", "STOKE_VENV", "STOKE_BIN_DIR", "STOKE_REPO"];

/// The checksum stoke records for every output object: SHA-256, hex.
pub fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest;
    hex::encode(sha2::Sha256::digest(bytes))
}
