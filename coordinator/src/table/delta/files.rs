//! A Delta job's files in its table: which of the table's files are the
//! job's, their Parquet schema against the table's, and the add actions
//! that put them in.

use super::*;

/// The paths (relative to the table) of the table's files in the job's
/// folder.
pub(super) fn files_in(
    snapshot: &delta_kernel::SnapshotRef,
    engine: &dyn Engine,
    table: &StoreUri,
    job_id: &str,
) -> delta_kernel::KernelResult<HashSet<String>> {
    let folder = relative(
        table,
        stoke_core::layout::delta_job_folder(table, job_id).as_str(),
    )
    .map(|f| format!("{f}/"))
    .unwrap_or_default();
    let scan = snapshot.clone().scan_builder().build()?;
    let mut found: (String, HashSet<String>) = (folder, HashSet::new());
    for metadata in scan.scan_metadata(engine)? {
        found = metadata?.visit_scan_files(found, |(folder, paths), file| {
            if file.path.starts_with(folder.as_str()) {
                paths.insert(file.path);
            }
        })?;
    }
    Ok(found.1)
}

/// `uri` relative to the table's root, if it is under it.
pub(super) fn relative<'a>(table: &StoreUri, uri: &'a str) -> Option<&'a str> {
    let root = table.as_str().trim_end_matches('/');
    uri.strip_prefix(root)?
        .strip_prefix('/')
        .filter(|p| !p.is_empty())
}

/// The schema a data file was written with, from its Parquet footer.
pub(super) fn file_schema(
    engine: &dyn Engine,
    object: &OutputObject,
) -> delta_kernel::KernelResult<SchemaRef> {
    let location = url::Url::parse(&object.uri)?;
    let meta = FileMeta {
        location,
        last_modified: 0,
        size: object.bytes,
    };
    Ok(engine.parquet_handler().read_parquet_footer(&meta)?.schema)
}

/// A new table's schema: the files' columns, all nullable, so a later
/// job whose files leave a column null still fits.
pub(super) fn table_schema(files: &SchemaRef) -> SchemaRef {
    let fields = files
        .fields()
        .map(|f| StructField::nullable(f.name().clone(), f.data_type().clone()));
    Arc::new(StructType::new_unchecked(fields))
}

/// Columns by name and type: the table's and the files' must be the same
/// set (order and nullability aside).
pub(super) fn check_schema(
    table: &StoreUri,
    job_id: &str,
    table_schema: &SchemaRef,
    files: &SchemaRef,
) -> Result<(), DeltaError> {
    let columns = |s: &SchemaRef| -> BTreeMap<String, String> {
        s.fields()
            .map(|f| (f.name().clone(), f.data_type().to_string()))
            .collect()
    };
    let (want, got) = (columns(table_schema), columns(files));
    if want == got {
        return Ok(());
    }
    let show = |c: &BTreeMap<String, String>| {
        let cols: Vec<String> = c.iter().map(|(n, t)| format!("{n}: {t}")).collect();
        format!("({})", cols.join(", "))
    };
    Err(DeltaError::SchemaClash {
        table: table.to_string(),
        job_id: job_id.to_string(),
        table_schema: show(&want),
        job_schema: show(&got),
    })
}

/// The add actions' data for `objects` (see the kernel's
/// `Transaction::add_files_schema`): paths relative to the table, no
/// partition values, and each file's record count as its stats.
pub(super) fn add_files(
    table: &StoreUri,
    objects: &[OutputObject],
) -> Result<Box<ArrowEngineData>, DeltaError> {
    let mut paths = Vec::with_capacity(objects.len());
    for o in objects {
        let path = relative(table, &o.uri).ok_or_else(|| DeltaError::Outside {
            table: table.to_string(),
            object: o.uri.clone(),
        })?;
        paths.push(path.to_string());
    }
    let now = i64::try_from(stoke_core::records::now_ms()).unwrap_or(i64::MAX);
    let n = objects.len();
    let names = MapFieldNames {
        entry: "key_value".to_string(),
        key: "key".to_string(),
        value: "value".to_string(),
    };
    let mut partitions = MapBuilder::new(Some(names), StringBuilder::new(), StringBuilder::new());
    for _ in 0..n {
        partitions.append(true).map_err(|e| arrow_error(table, e))?;
    }
    let records: Vec<i64> = objects
        .iter()
        .map(|o| i64::try_from(o.records).unwrap_or(i64::MAX))
        .collect();
    let stats = StructArray::from(vec![
        (
            Arc::new(Field::new("numRecords", DataType::Int64, true)),
            Arc::new(Int64Array::from(records)) as ArrayRef,
        ),
        (
            Arc::new(Field::new("tightBounds", DataType::Boolean, true)),
            Arc::new(BooleanArray::from(vec![true; n])) as ArrayRef,
        ),
    ]);
    let sizes: Vec<i64> = objects
        .iter()
        .map(|o| i64::try_from(o.bytes).unwrap_or(i64::MAX))
        .collect();
    let partitions = Arc::new(partitions.finish());
    let schema = Schema::new(vec![
        Field::new("path", DataType::Utf8, false),
        Field::new("partitionValues", partitions.data_type().clone(), false),
        Field::new("size", DataType::Int64, false),
        Field::new("modificationTime", DataType::Int64, false),
        Field::new("stats", stats.data_type().clone(), true),
    ]);
    let batch = RecordBatch::try_new(
        Arc::new(schema),
        vec![
            Arc::new(StringArray::from(paths)),
            partitions,
            Arc::new(Int64Array::from(sizes)),
            Arc::new(Int64Array::from(vec![now; n])),
            Arc::new(stats),
        ],
    )
    .map_err(|e| arrow_error(table, e))?;
    Ok(Box::new(ArrowEngineData::new(batch)))
}

pub(super) fn arrow_error(
    table: &StoreUri,
    e: delta_kernel::arrow::error::ArrowError,
) -> DeltaError {
    DeltaError::Kernel {
        table: table.to_string(),
        source: Box::new(delta_kernel::KernelError::Arrow(e)),
    }
}
