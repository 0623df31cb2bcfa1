//! Results as a Delta Lake table (ADR 012) and incremental re-runs'
//! bookkeeping in it (ADR 013): the Delta kernel's I/O, which the owner
//! runs for the state machine's `Io::Table` writes and at submit. The
//! state machine never calls it; what it asks for is plain data
//! ([`crate::state::effects::TableAppend`]).

pub(crate) mod delta;
pub mod iceberg;
pub(crate) mod incremental;
