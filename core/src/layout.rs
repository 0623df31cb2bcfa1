//! Where stoke keeps things in object storage. One place names every path:
//!
//! ```text
//! <root>/coordinator/epoch.json          fencing epoch, bumped at every coordinator start
//! <root>/coordinator/lock.json           which coordinator holds the root (cloud roots)
//! <root>/coordinator/lock                OS file lock on the root (file:// roots)
//! <root>/jobs/<job>/spec.json             immutable, written create-only
//! <root>/jobs/<job>/plan.json             shard plan
//! <root>/jobs/<job>/status.json           running | paused | cancelled | succeeded | failed
//! <root>/jobs/<job>/progress/log-<seq>.json  committed progress of the shards in one group commit
//! <root>/jobs/<job>/progress/snapshot-<seq>.json  the latest progress of every shard, replacing older logs
//! <root>/jobs/<job>/manifest.json         written at success
//! <root>/jobs/<job>/errors/<shard>/a<token>/part-<batch>.jsonl   skipped bad records
//! <output>/<shard>/a<token>/part-<batch>.<ext>   outputs of one attempt
//! ```

use crate::store::StoreUri;

/// The paths of a coordinator's state root.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RootLayout {
    root: StoreUri,
}

impl RootLayout {
    pub fn new(root: StoreUri) -> Self {
        Self { root }
    }

    pub fn root(&self) -> &StoreUri {
        &self.root
    }

    pub fn epoch(&self) -> StoreUri {
        self.root.join("coordinator/epoch.json")
    }

    /// The lease object a coordinator renews while it holds the root.
    pub fn lock(&self) -> StoreUri {
        self.root.join("coordinator/lock.json")
    }

    pub fn jobs(&self) -> StoreUri {
        self.root.join("jobs/")
    }

    pub fn job(&self, job_id: &str) -> JobLayout {
        JobLayout {
            dir: self.root.join(&format!("jobs/{job_id}")),
        }
    }
}

/// The paths of one job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobLayout {
    dir: StoreUri,
}

impl JobLayout {
    pub fn spec(&self) -> StoreUri {
        self.dir.join("spec.json")
    }
    pub fn plan(&self) -> StoreUri {
        self.dir.join("plan.json")
    }
    pub fn status(&self) -> StoreUri {
        self.dir.join("status.json")
    }
    pub fn progress_dir(&self) -> StoreUri {
        self.dir.join("progress/")
    }
    /// The records of one group commit; `seq` is its first record's.
    pub fn progress_log(&self, seq: u64) -> StoreUri {
        self.dir.join(&format!("progress/log-{seq:020}.json"))
    }
    /// Every shard's latest record as of `seq`.
    pub fn progress_snapshot(&self, seq: u64) -> StoreUri {
        self.dir.join(&format!("progress/snapshot-{seq:020}.json"))
    }
    pub fn manifest(&self) -> StoreUri {
        self.dir.join("manifest.json")
    }
    /// Where one attempt writes the bad records it skipped.
    pub fn errors_prefix(&self, shard_id: &str, token: u64) -> StoreUri {
        self.dir.join(&format!("errors/{shard_id}/a{token}"))
    }
    pub fn errors_dir(&self, shard_id: &str) -> StoreUri {
        self.dir.join(&format!("errors/{shard_id}/"))
    }
    /// Default output location when the spec names none.
    pub fn default_output(&self) -> StoreUri {
        self.dir.join("outputs")
    }
}

/// Where one attempt of one shard writes its outputs.
pub fn attempt_prefix(output: &StoreUri, shard_id: &str, token: u64) -> StoreUri {
    output.join(&format!("{shard_id}/a{token}"))
}

/// The folder of one shard's outputs, every attempt.
pub fn shard_output_dir(output: &StoreUri, shard_id: &str) -> StoreUri {
    output.join(&format!("{shard_id}/"))
}

/// The name of the output object a checkpoint writes, by its first batch.
pub fn part_name(from_batch: u64, extension: &str) -> String {
    format!("part-{from_batch:08}.{extension}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths() {
        let root = RootLayout::new(StoreUri::parse("file:///r").expect("uri"));
        let job = root.job("j1");
        assert_eq!(job.spec().as_str(), "file:///r/jobs/j1/spec.json");
        assert_eq!(
            job.progress_log(7).as_str(),
            "file:///r/jobs/j1/progress/log-00000000000000000007.json"
        );
        let prefix = attempt_prefix(&job.default_output(), "s00001", 7);
        assert_eq!(prefix.as_str(), "file:///r/jobs/j1/outputs/s00001/a7");
        assert_eq!(
            prefix.join(&part_name(20, "parquet")).as_str(),
            "file:///r/jobs/j1/outputs/s00001/a7/part-00000020.parquet"
        );
    }
}
