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
//! <root>/jobs/<job>/metrics.json          the job's reduced metrics (Python reducers), before success
//! <root>/jobs/<job>/errors/<shard>/a<token>/part-<batch>.jsonl   skipped bad records
//! <root>/jobs/<job>/staging/<shard>/a<token>/part-<batch>.<ext>  what an attempt uploads
//! <output>/<shard>/a<token>/part-<batch>.<ext>   committed outputs only
//! <output>/<shard>/a<token>/_metrics/<batch>.pkl  a checkpoint's metric partial (Python reducers)
//! ```
//!
//! Attempts upload into a staging folder that readers of the output folder
//! never see; an object enters `<output>` only through a commit the
//! coordinator accepted (it copies the staged object there before it
//! stores the progress record). So a reader pointed at the output folder
//! of a succeeded job gets every record once, whatever zombies uploaded.
//! Staging sits under the job's folder when the output is in the same
//! store as the state root (always for the default output, and for every
//! `file://` output), so the copy stays inside one store (a hard link on
//! `file://`, a server-side copy on S3, GCS and Azure); an output in
//! another bucket stages in `<output>/_staging/`, which Spark, Hadoop,
//! pyarrow and pandas skip because of the leading `_`.

use stoke_uri::StoreUri;

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
    /// What `stoke set` changed of the spec's priority, weight and
    /// `max_workers` (absent until the first change).
    pub fn schedule(&self) -> StoreUri {
        self.dir.join("schedule.json")
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
    /// The Delta table versions a `commit = "checkpoint"` job made so far
    /// (a `TableVersions`), for its manifest.
    pub fn delta_versions(&self) -> StoreUri {
        self.dir.join("delta.json")
    }

    /// The table versions (Delta) or snapshots (Iceberg) a table job made
    /// so far, by its output format (`delta.json`, `iceberg.json`).
    pub fn table_versions(&self, format: crate::spec::OutputFormat) -> StoreUri {
        match format {
            crate::spec::OutputFormat::Iceberg => self.dir.join("iceberg.json"),
            _ => self.delta_versions(),
        }
    }
    /// The job's metrics, reduced from its committed metric partials
    /// (JSON: name -> value), stored before the job succeeds.
    pub fn metrics(&self) -> StoreUri {
        self.dir.join("metrics.json")
    }
    /// The job's efficiency report, written when it ends.
    pub fn report(&self) -> StoreUri {
        self.dir.join("report.json")
    }
    /// The report of a running job as the coordinator last saved it, which
    /// a restarted coordinator carries on from.
    pub fn report_so_far(&self) -> StoreUri {
        self.dir.join("report-so-far.json")
    }
    /// A succeeded job's summary once the coordinator let go of its shards
    /// (`EndedRecord`): a restarted coordinator loads it instead of the
    /// plan and every shard's progress.
    pub fn ended(&self) -> StoreUri {
        self.dir.join("ended.json")
    }
    /// Where one attempt writes the bad records it skipped.
    pub fn errors_prefix(&self, shard_id: &str, token: u64) -> StoreUri {
        self.dir.join(&format!("errors/{shard_id}/a{token}"))
    }
    pub fn errors_dir(&self, shard_id: &str) -> StoreUri {
        self.dir.join(&format!("errors/{shard_id}/"))
    }
    /// The folder of every shard's error objects (`errors_dir` of each).
    pub fn errors_root(&self) -> StoreUri {
        self.dir.join("errors/")
    }
    /// Default output location when the spec names none.
    pub fn default_output(&self) -> StoreUri {
        self.dir.join("outputs")
    }
    /// Where attempts upload when the output is in the root's store.
    pub fn staging(&self) -> StoreUri {
        self.dir.join("staging")
    }
    /// Where the attempts of a job writing to `output` upload: see the
    /// module's page.
    pub fn staging_for(&self, output: &StoreUri) -> StoreUri {
        if output.scheme() == "file" || output.same_store(&self.dir) {
            self.staging()
        } else {
            output.join("_staging")
        }
    }
}

/// The folder of a job's data files inside the Delta table at `table`
/// (`<table>/stoke/<job>`): jobs appending to one table never share one.
pub fn delta_job_folder(table: &StoreUri, job_id: &str) -> StoreUri {
    table.join(&format!("stoke/{job_id}"))
}

/// The folder of a job's data files in the Iceberg table located at
/// `location` (`<location>/data/stoke/<job>`, where Iceberg's own writers
/// put data files too).
pub fn iceberg_job_folder(location: &StoreUri, job_id: &str) -> StoreUri {
    location.join(&format!("data/stoke/{job_id}"))
}

/// Where one attempt of one shard writes its outputs.
pub fn attempt_prefix(output: &StoreUri, shard_id: &str, token: u64) -> StoreUri {
    output.join(&format!("{shard_id}/a{token}"))
}

/// Where a staged object of an attempt goes once its commit is accepted:
/// the same name under `output` instead of `staging`. `None` for a URI
/// outside the attempt's staging prefix.
pub fn committed_uri(
    staged: &str,
    staging: &StoreUri,
    output: &StoreUri,
    shard_id: &str,
    token: u64,
) -> Option<StoreUri> {
    let from = attempt_prefix(staging, shard_id, token);
    let name = staged.strip_prefix(from.as_str())?.strip_prefix('/')?;
    if name.is_empty()
        || name
            .split('/')
            .any(|s| s.is_empty() || s == "." || s == "..")
    {
        return None;
    }
    Some(attempt_prefix(output, shard_id, token).join(name))
}

/// The folder of one shard's outputs, every attempt.
pub fn shard_output_dir(output: &StoreUri, shard_id: &str) -> StoreUri {
    output.join(&format!("{shard_id}/"))
}

/// The name of the output object a checkpoint writes, by its first batch.
pub fn part_name(from_batch: u64, extension: &str) -> String {
    format!("part-{from_batch:08}.{extension}")
}

/// The folder, inside an attempt's prefix, of its checkpoints' metric
/// partials (the leading `_` keeps Parquet readers of the output folder
/// from seeing them, as `_files/`).
pub const METRICS_FOLDER: &str = "_metrics";

/// The name of a checkpoint's metric partial, by its first batch.
pub fn metrics_partial_name(from_batch: u64) -> String {
    format!("{METRICS_FOLDER}/{from_batch:08}.pkl")
}

/// Whether a committed output object is a checkpoint's metric partial.
pub fn is_metrics_partial(uri: &str) -> bool {
    uri.rsplit_once('/').is_some_and(|(folder, name)| {
        folder.ends_with(&format!("/{METRICS_FOLDER}")) && name.ends_with(".pkl")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metric_partials_are_told_from_outputs() {
        let prefix = attempt_prefix(&StoreUri::parse("file:///r/out").expect("uri"), "s00001", 7);
        let partial = prefix.join(&metrics_partial_name(12));
        assert_eq!(
            partial.as_str(),
            "file:///r/out/s00001/a7/_metrics/00000012.pkl"
        );
        assert!(is_metrics_partial(partial.as_str()));
        assert!(!is_metrics_partial(
            prefix.join(&part_name(12, "parquet")).as_str()
        ));
        assert!(!is_metrics_partial(
            prefix.join("_files/00000012-_metrics.pkl").as_str()
        ));
    }

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

    #[test]
    fn staging_stays_in_the_outputs_store() {
        let root = RootLayout::new(StoreUri::parse("s3://state/stoke").expect("uri"));
        let job = root.job("j1");
        assert_eq!(
            job.staging_for(&job.default_output()).as_str(),
            "s3://state/stoke/jobs/j1/staging"
        );
        let same_bucket = StoreUri::parse("s3://state/results").expect("uri");
        assert_eq!(
            job.staging_for(&same_bucket).as_str(),
            "s3://state/stoke/jobs/j1/staging"
        );
        let other_bucket = StoreUri::parse("s3://results/run1").expect("uri");
        assert_eq!(
            job.staging_for(&other_bucket).as_str(),
            "s3://results/run1/_staging"
        );
        let local = RootLayout::new(StoreUri::parse("file:///r").expect("uri")).job("j1");
        let elsewhere = StoreUri::parse("file:///data/out").expect("uri");
        assert_eq!(
            local.staging_for(&elsewhere).as_str(),
            "file:///r/jobs/j1/staging"
        );
    }

    #[test]
    fn committed_uri_maps_staging_to_output_and_refuses_the_rest() {
        let staging = StoreUri::parse("s3://b/r/jobs/j1/staging").expect("uri");
        let output = StoreUri::parse("s3://b/out").expect("uri");
        let staged = "s3://b/r/jobs/j1/staging/s00001/a7/part-00000020.parquet";
        assert_eq!(
            committed_uri(staged, &staging, &output, "s00001", 7)
                .expect("mapped")
                .as_str(),
            "s3://b/out/s00001/a7/part-00000020.parquet"
        );
        let file = "s3://b/r/jobs/j1/staging/s00001/a7/files/00000000-x.pt";
        assert_eq!(
            committed_uri(file, &staging, &output, "s00001", 7)
                .expect("mapped")
                .as_str(),
            "s3://b/out/s00001/a7/files/00000000-x.pt"
        );
        // Another attempt's, another shard's, or a path that climbs out.
        for bad in [
            "s3://b/r/jobs/j1/staging/s00001/a8/part-00000020.parquet",
            "s3://b/r/jobs/j1/staging/s00002/a7/part-00000020.parquet",
            "s3://b/r/jobs/j1/staging/s00001/a70/part-00000020.parquet",
            "s3://b/r/jobs/j1/staging/s00001/a7/../a8/part.parquet",
            "s3://b/r/jobs/j1/staging/s00001/a7/",
            "s3://b/out/s00001/a7/part-00000020.parquet",
        ] {
            assert!(
                committed_uri(bad, &staging, &output, "s00001", 7).is_none(),
                "{bad}"
            );
        }
    }
}
