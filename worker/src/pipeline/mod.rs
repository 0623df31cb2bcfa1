//! The worker's data path: read a shard into batches (`stoke-data`'s
//! readers), run the processor on its own thread, encode and upload
//! outputs, commit.

pub(crate) mod commit;
pub(crate) mod control;
pub(crate) mod output;
pub(crate) mod prep;
pub(crate) mod process;
pub(crate) mod stages;
