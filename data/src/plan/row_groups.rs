//! Planning Parquet: shards of whole row groups, grouped to a target
//! record count, never across files.

use parquet::arrow::async_reader::ParquetRecordBatchStreamBuilder;

use super::{check_columns, shard_id, with_extension};
use crate::error::PlanError;
use crate::parquet_source::ParquetSource;
use stoke_core::plan::{Plan, Shard, ShardSource};
use stoke_core::spec::JobSpec;
use stoke_store::{Listed, Stores};

/// Groups each file's consecutive row groups until a group holds at least
/// `target` rows. `files` holds (uri, rows of each row group).
pub fn group_row_groups(files: &[(String, Vec<u64>)], target: u64) -> Vec<(ShardSource, u64)> {
    let mut out = Vec::new();
    for (uri, groups) in files {
        let mut start = 0usize;
        let mut rows = 0u64;
        for (i, &n) in groups.iter().enumerate() {
            rows += n;
            if rows >= target || i + 1 == groups.len() {
                if rows > 0 {
                    out.push((
                        ShardSource::Parquet {
                            uri: uri.clone(),
                            row_group_start: start as u64,
                            row_group_end: i as u64 + 1,
                        },
                        rows,
                    ));
                }
                start = i + 1;
                rows = 0;
            }
        }
    }
    out
}

pub(super) async fn plan_parquet(
    spec: &JobSpec,
    stores: &Stores,
    dataset: &str,
    listed: Vec<Listed>,
) -> Result<Plan, PlanError> {
    let files = if listed.len() == 1 {
        listed.iter().collect()
    } else {
        with_extension(&listed, &[".parquet", ".parq"])
    };
    if files.is_empty() {
        return Err(PlanError::Empty {
            dataset: dataset.to_string(),
            format: "parquet",
        });
    }
    let mut groups = Vec::with_capacity(files.len());
    for file in files {
        let reader = ParquetSource::open(stores, &file.uri, Some(file.size))
            .await
            .map_err(|source| PlanError::Store {
                dataset: dataset.to_string(),
                source: Box::new(source),
            })?;
        let builder = ParquetRecordBatchStreamBuilder::new(reader)
            .await
            .map_err(|source| PlanError::Parquet {
                dataset: dataset.to_string(),
                object: file.uri.to_string(),
                source: Box::new(source),
            })?;
        check_columns(spec, dataset, file.uri.as_str(), builder.schema())?;
        let rows = builder
            .metadata()
            .row_groups()
            .iter()
            .map(|rg| rg.num_rows().max(0) as u64)
            .collect();
        groups.push((file.uri.to_string(), rows));
    }
    let grouped = group_row_groups(&groups, spec.sharding.records);
    let records_total = grouped.iter().map(|(_, n)| n).sum();
    let shards = grouped
        .into_iter()
        .enumerate()
        .map(|(i, (source, rows))| Shard {
            id: shard_id(i),
            records: Some(rows),
            source,
            cut: None,
        })
        .collect();
    Ok(Plan {
        shards,
        records_total: Some(records_total),
        jsonl_schema: None,
        incremental: None,
    })
}
