//! `stoke outputs JOB`: the objects a job has committed so far, from its
//! shards' progress records. Once a job succeeded its output folder holds
//! exactly these (uncommitted attempts are deleted, and the manifest lists
//! the same objects); after a cancel or a failure the folder may also
//! hold what attempts wrote and never committed, and this list is what
//! counts.

use stoke_client::summary::{count, local_path};
use stoke_core::records::{CommittedOutputs, JobState, ManifestEntry, TableVersions};

use crate::source::Source;

/// Prints the job's committed outputs: a table, or JSON with `--json`.
pub async fn print(source: &Source, job_id: &str, json: bool) -> anyhow::Result<i32> {
    let job = source.job(job_id).await?;
    let CommittedOutputs {
        outputs,
        delta,
        iceberg,
    } = source.outputs(job_id).await?;
    let records: u64 = outputs.iter().map(|o| o.object.records).sum();
    let bytes: u64 = outputs.iter().map(|o| o.object.bytes).sum();
    let complete = job.state == JobState::Succeeded;
    if json {
        let objects: Vec<_> = outputs.iter().map(object_json).collect();
        let value = serde_json::json!({
            "job_id": job.job_id,
            "state": job.state.as_str(),
            "complete": complete,
            "output_uri": job.output_uri,
            "manifest_uri": job.manifest_uri,
            "records": records,
            "bytes": bytes,
            "objects": objects,
            "delta": delta.as_ref().map(|d| serde_json::json!({
                "table": d.table,
                "versions": d.versions,
            })),
            "iceberg": iceberg.as_ref().map(|d| serde_json::json!({
                "table": d.table,
                "snapshots": d.versions,
            })),
        });
        println!("{}", serde_json::to_string_pretty(&value)?);
        return Ok(0);
    }
    print!("{}", table(&outputs));
    let shards = {
        let mut ids: Vec<&str> = outputs.iter().map(|o| o.shard_id.as_str()).collect();
        ids.dedup();
        ids.len()
    };
    println!(
        "{} in {} from {shards} of {}; job {} is {}",
        count(records, "record"),
        count(outputs.len() as u64, "object"),
        count(job.shards_total, "shard"),
        job.job_id,
        job.state
    );
    if let Some(d) = &delta {
        println!("{}", delta_line(d, complete));
        return Ok(0);
    }
    if let Some(i) = &iceberg {
        println!("{}", iceberg_line(i, complete));
        return Ok(0);
    }
    if complete {
        println!(
            "every committed object is under {} (read the folder with any Parquet reader)",
            local_path(&job.output_uri)
        );
    } else {
        println!(
            "the job is {}: read these objects, not the whole folder (it may hold uncommitted attempts)",
            job.state
        );
    }
    Ok(0)
}

/// Where a Delta job's rows are, and which table versions hold them.
pub(crate) fn delta_line(d: &TableVersions, complete: bool) -> String {
    let versions: Vec<String> = d.versions.iter().map(u64::to_string).collect();
    let table = local_path(&d.table);
    match (versions.is_empty(), complete) {
        (true, true) => format!("Delta table {table}: the job added no rows"),
        (true, false) => format!(
            "Delta table {table}: no version of it holds this job's rows yet (with commit = \"end\" they land when the job succeeds)"
        ),
        (false, _) => format!(
            "Delta table {table}: the job's rows are in version{} {} (read the table with any Delta reader: deltalake, Polars, Spark, DuckDB)",
            if versions.len() == 1 { "" } else { "s" },
            versions.join(", ")
        ),
    }
}

/// Where an Iceberg job's rows are, and which snapshots hold them.
pub(crate) fn iceberg_line(i: &TableVersions, complete: bool) -> String {
    let snapshots: Vec<String> = i.versions.iter().map(u64::to_string).collect();
    let table = &i.table;
    match (snapshots.is_empty(), complete) {
        (true, true) => format!("Iceberg table {table}: the job added no rows"),
        (true, false) => format!(
            "Iceberg table {table}: no snapshot of it holds this job's rows yet (with commit = \"end\" they land when the job succeeds)"
        ),
        (false, _) => format!(
            "Iceberg table {table}: the job's rows are in snapshot{} {} (read the table through its catalog with any Iceberg reader: pyiceberg, Spark, Trino, DuckDB)",
            if snapshots.len() == 1 { "" } else { "s" },
            snapshots.join(", ")
        ),
    }
}

fn object_json(o: &ManifestEntry) -> serde_json::Value {
    serde_json::json!({
        "shard_id": o.shard_id,
        "uri": o.object.uri,
        "path": o.object.uri.starts_with("file://").then(|| local_path(&o.object.uri)),
        "records": o.object.records,
        "bytes": o.object.bytes,
        "sha256": o.object.sha256,
    })
}

/// One line per object, columns as wide as their longest value.
fn table(outputs: &[ManifestEntry]) -> String {
    let rows: Vec<[String; 4]> = outputs
        .iter()
        .map(|o| {
            [
                o.shard_id.clone(),
                o.object.records.to_string(),
                o.object.bytes.to_string(),
                local_path(&o.object.uri),
            ]
        })
        .collect();
    crate::display::columns(
        &["SHARD", "RECORDS", "BYTES", "OBJECT"],
        &[false, true, true, false],
        &rows,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use stoke_core::records::OutputObject;

    #[test]
    fn the_table_aligns_whatever_the_lengths() {
        let outputs = vec![
            ManifestEntry::new(
                "s00000",
                &OutputObject {
                    uri: "file:///r/jobs/j/outputs/s00000/a1/part-00000000.parquet".into(),
                    records: 400,
                    bytes: 12_345,
                    sha256: "ab".into(),
                },
            ),
            ManifestEntry::new(
                "s00001",
                &OutputObject {
                    uri: "s3://b/o/s00001/a2/part-00000000.parquet".into(),
                    records: 7,
                    bytes: 999,
                    sha256: "cd".into(),
                },
            ),
        ];
        let text = table(&outputs);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 3, "{text}");
        assert!(lines[1].ends_with("/r/jobs/j/outputs/s00000/a1/part-00000000.parquet"));
        assert!(lines[2].ends_with("s3://b/o/s00001/a2/part-00000000.parquet"));
        // The objects start in one column.
        let at = |l: &str, s: &str| l.find(s).expect("column");
        assert_eq!(at(lines[0], "OBJECT"), at(lines[1], "/r/"));
        assert_eq!(at(lines[0], "OBJECT"), at(lines[2], "s3://"));
    }
}
