//! One attempt at a leased shard, the worker's data path: read the shard
//! into batches (`stoke-data`'s readers), run the processor on its own
//! thread, encode and upload outputs, commit; and where the processor
//! threads' time goes, phase by phase (`phases`). (Pipelines of jobs are
//! `stoke_core::spec::pipeline`'s, not this.)

pub(crate) mod commit;
pub(crate) mod control;
pub(crate) mod output;
pub(crate) mod phases;
pub(crate) mod prep;
pub(crate) mod process;
