//! Adding a job's committed Parquet objects to a Delta Lake table, with
//! Delta's own kernel (`delta_kernel`) and its object_store engine: the
//! log is never written by hand (ADR 012).
//!
//! Every Delta commit carries a `txn` action whose appId is the stoke job
//! id and whose version is the coordinator's commit sequence (the highest
//! progress `seq` the commit covers). Before committing, the table's txn
//! version for the job is read: at or past the sequence, the files are in
//! the table already (a coordinator that crashed after the Delta commit
//! and before recording it), and nothing is added twice. A conflict with
//! another writer (another job appending to the same table) is retried on
//! a fresh snapshot, which reads the txn version again.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, LazyLock, Mutex};

use delta_kernel::arrow::array::{
    Array, ArrayRef, BooleanArray, Int64Array, MapBuilder, MapFieldNames, RecordBatch, StringArray,
    StringBuilder, StructArray,
};
use delta_kernel::arrow::datatypes::{DataType, Field, Schema};
use delta_kernel::committer::FileSystemCommitter;
use delta_kernel::engine::arrow_data::ArrowEngineData;
use delta_kernel::object_store::ObjectStore;
use delta_kernel::schema::{SchemaRef, StructField, StructType};
use delta_kernel::table_features::TableFeature;
use delta_kernel::transaction::create_table::create_table;
use delta_kernel::transaction::{CommitResult, UpdateTableOperation};
use delta_kernel::{Engine, FileMeta, Snapshot};
use delta_kernel_default_engine::executor::tokio::TokioMultiThreadExecutor;
use delta_kernel_default_engine::{DefaultEngine, DefaultEngineBuilder};
use stoke_core::plan::DoneInputs;
use stoke_core::records::OutputObject;
use stoke_store::{StoreError, StoreUri, Stores};
use thiserror::Error;
use tracing::{info, warn};

pub use crate::state::{DoneUpdate, TableAppend};

mod files;
use files::{add_files, check_schema, file_schema, files_in, relative, table_schema};

/// What the commits name as their writer.
const ENGINE_INFO: &str = concat!("stoke/", env!("CARGO_PKG_VERSION"));
/// Conflicts with other writers retried before giving up (the finish or
/// the group is tried again later anyway).
const MAX_CONFLICTS: usize = 50;

#[derive(Debug, Error)]
pub enum DeltaError {
    #[error("Delta table {table}: {source}")]
    Kernel {
        table: String,
        #[source]
        source: Box<delta_kernel::KernelError>,
    },
    #[error(
        "Delta table {table} has schema {table_schema}, but job {job_id} writes {job_schema}: write to another table, or make the processor's output columns match"
    )]
    SchemaClash {
        table: String,
        job_id: String,
        table_schema: String,
        job_schema: String,
    },
    #[error("Delta table {table}: {object} is not under the table's folder")]
    Outside { table: String, object: String },
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("Delta table {table}: gave up after {MAX_CONFLICTS} conflicting commits")]
    Conflicts { table: String },
    #[error("Delta commit task of table {table} failed: {reason}")]
    Task { table: String, reason: String },
    #[error(
        "Delta table {table} does not support domain metadata, where incremental re-runs record which inputs are done: it was made without it (stoke makes it so for incremental jobs). Write to a new table ([output] uri), or leave out dataset.incremental"
    )]
    NoDomainMetadata { table: String },
    #[error("Delta table {table}: the done inputs in domain {domain} cannot be read: {message}")]
    BadDomain {
        table: String,
        domain: String,
        message: String,
    },
}

impl DeltaError {
    /// Errors no retry can fix: the job fails with them.
    pub fn is_permanent(&self) -> bool {
        matches!(
            self,
            Self::SchemaClash { .. }
                | Self::Outside { .. }
                | Self::NoDomainMetadata { .. }
                | Self::BadDomain { .. }
        )
    }
}

/// The Delta domain that keeps the done inputs of the pipeline with
/// `fingerprint` (ADR 013).
pub fn inputs_domain(fingerprint: &str) -> String {
    format!("stoke.inputs.{fingerprint}")
}

fn read_done(
    snapshot: &delta_kernel::SnapshotRef,
    engine: &dyn Engine,
    table: &StoreUri,
    domain: &str,
) -> Result<DoneInputs, DeltaError> {
    if !snapshot
        .table_configuration()
        .is_feature_supported(&TableFeature::DomainMetadata)
    {
        return Err(DeltaError::NoDomainMetadata {
            table: table.to_string(),
        });
    }
    match snapshot
        .get_domain_metadata(domain, engine)
        .map_err(kernel(table))?
    {
        None => Ok(DoneInputs::default()),
        Some(config) => serde_json::from_str(&config).map_err(|e| DeltaError::BadDomain {
            table: table.to_string(),
            domain: domain.to_string(),
            message: e.to_string(),
        }),
    }
}

/// A column a job is known to write before it runs, by its Delta type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KnownType {
    String,
    Long,
    /// A list of float32 (a fixed-size list in the files).
    FloatList,
}

impl KnownType {
    fn matches(self, t: &delta_kernel::schema::DataType) -> bool {
        use delta_kernel::schema::DataType;
        match self {
            Self::String => *t == DataType::STRING,
            Self::Long => *t == DataType::LONG,
            Self::FloatList => {
                matches!(t, DataType::Array(a) if *a.element_type() == DataType::FLOAT)
            }
        }
    }

    fn name(self) -> &'static str {
        match self {
            Self::String => "string",
            Self::Long => "long",
            Self::FloatList => "array<float>",
        }
    }

    /// Its type as Iceberg names it.
    pub(crate) fn iceberg_name(self) -> &'static str {
        match self {
            Self::String => "string",
            Self::Long => "long",
            Self::FloatList => "list<float>",
        }
    }
}

/// What submit needs of the table at `table`, from one read of it (none
/// when it has no log yet): a job whose columns are known now (the
/// built-in processor's) is refused if the table has others, said now
/// rather than at its first Delta commit; and with `fingerprint`, the
/// inputs the table records as done for that pipeline.
pub async fn at_submit(
    stores: &Stores,
    table: &StoreUri,
    job: &str,
    columns: Option<Vec<(String, KnownType)>>,
    fingerprint: Option<&str>,
) -> Result<DoneInputs, DeltaError> {
    let (store, _) = stores.resolve(table)?;
    if stores.list(&log_folder(table)).await?.is_empty() {
        return Ok(DoneInputs::default());
    }
    let (t, job, domain) = (
        table.clone(),
        job.to_string(),
        fingerprint.map(inputs_domain),
    );
    tokio::task::spawn_blocking(move || {
        let engine = engine(store, &t)?;
        let snapshot = Snapshot::builder_for(table_url(&t))
            .build(&engine)
            .map_err(kernel(&t))?;
        if let Some(columns) = &columns {
            check_known_columns(&snapshot, &t, &job, columns)?;
        }
        match &domain {
            Some(domain) => read_done(&snapshot, &engine, &t, domain),
            None => Ok(DoneInputs::default()),
        }
    })
    .await
    .map_err(|e| DeltaError::Task {
        table: table.to_string(),
        reason: e.to_string(),
    })?
}

/// The table's columns are `columns`, by name and type.
fn check_known_columns(
    snapshot: &delta_kernel::SnapshotRef,
    table: &StoreUri,
    job: &str,
    columns: &[(String, KnownType)],
) -> Result<(), DeltaError> {
    let have: BTreeMap<String, delta_kernel::schema::DataType> = snapshot
        .schema()
        .fields()
        .map(|f| (f.name().clone(), f.data_type().clone()))
        .collect();
    let fits = have.len() == columns.len()
        && columns
            .iter()
            .all(|(name, kind)| have.get(name).is_some_and(|t| kind.matches(t)));
    if fits {
        return Ok(());
    }
    let mut want: Vec<String> = columns
        .iter()
        .map(|(n, k)| format!("{n}: {}", k.name()))
        .collect();
    want.sort();
    let have: Vec<String> = have.iter().map(|(n, t)| format!("{n}: {t}")).collect();
    Err(DeltaError::SchemaClash {
        table: table.to_string(),
        job_id: job.to_string(),
        table_schema: format!("({})", have.join(", ")),
        job_schema: format!("({})", want.join(", ")),
    })
}

/// `before` with `update`'s inputs added, as the domain's configuration.
pub(crate) fn merged_done(before: DoneInputs, update: &DoneUpdate) -> String {
    let mut done = before;
    done.pipeline = update.pipeline.clone();
    for (uri, input) in &update.inputs {
        done.inputs.insert(uri.clone(), input.clone());
    }
    // Plain data: serialising cannot fail.
    serde_json::to_string(&done).unwrap_or_default()
}

/// What a commit did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Appended {
    /// The table version it made (none: nothing to add, or the table held
    /// the txn already).
    pub version: Option<u64>,
    /// The version holding the job's txn the table had before, when it
    /// was at or past `seq` or the append reconciled (none when there was
    /// none, or it is no longer in the log).
    pub prior: Option<u64>,
}

/// Commits `append` to its table (creating the table with the objects'
/// schema if it has no log yet). Runs the kernel on a blocking thread.
pub async fn append(stores: &Stores, append: TableAppend) -> Result<Appended, DeltaError> {
    let table = append.table.clone();
    // One commit at a time per table from this coordinator: its jobs do
    // not conflict with each other, and do not rely on the store's
    // create-only write being atomic among themselves.
    let lock = table_lock(&table);
    let mut known = lock.lock().await;
    let job_id = append.job_id.clone();
    let (store, _) = stores.resolve(&table)?;
    // A table once seen does not go away: its log is listed once.
    let exists = known.exists || !stores.list(&log_folder(&table)).await?.is_empty();
    let cached = known.snapshot.take();
    let committed =
        tokio::task::spawn_blocking(move || commit_blocking(store, append, exists, cached))
            .await
            .map_err(|e| DeltaError::Task {
                table: table.to_string(),
                reason: e.to_string(),
            })??;
    known.exists = exists || committed.version.is_some();
    known.snapshot = committed.snapshot;
    let prior = match committed.prior_txn {
        Some(txn) => version_with_txn(stores, &table, &job_id, txn).await?,
        None => None,
    };
    Ok(Appended {
        version: committed.version,
        prior,
    })
}

/// What this coordinator knows of a table between its commits.
#[derive(Default)]
struct Known {
    /// The table has a log.
    exists: bool,
    /// The table as this coordinator's last commit left it: the next
    /// commit reads only the log entries after it, not the whole log.
    snapshot: Option<delta_kernel::SnapshotRef>,
}

type TableLock = Arc<tokio::sync::Mutex<Known>>;

/// The lock of one table's commits, holding what is known of it (one per
/// table URI, for the life of the process: a coordinator writes to a
/// handful of tables).
fn table_lock(table: &StoreUri) -> TableLock {
    static LOCKS: LazyLock<Mutex<HashMap<String, TableLock>>> = LazyLock::new(Default::default);
    let mut locks = LOCKS.lock().unwrap_or_else(|p| p.into_inner());
    locks.entry(table_url(table)).or_default().clone()
}

/// What the blocking part did: the version it made, and the job's txn
/// version the table had, where the caller must find its table version.
struct Committed {
    version: Option<u64>,
    prior_txn: Option<i64>,
    /// The table after it, for the next commit.
    snapshot: Option<delta_kernel::SnapshotRef>,
}

/// The table now: `cached` brought up to date (the log entries after it
/// only), or read whole.
fn current(
    engine: &dyn Engine,
    url: &str,
    cached: Option<delta_kernel::SnapshotRef>,
) -> delta_kernel::KernelResult<delta_kernel::SnapshotRef> {
    match cached {
        Some(snapshot) => Snapshot::builder_from(snapshot).build(engine),
        None => Snapshot::builder_for(url).build(engine),
    }
}

/// The kernel's engine on `store`. Its tasks run on one multi-threaded
/// runtime for every table: writing a checkpoint blocks on reads from
/// inside the engine, which the default one-thread background executor
/// cannot serve (it hung).
fn engine(
    store: Arc<dyn ObjectStore>,
    table: &StoreUri,
) -> Result<DefaultEngine<TokioMultiThreadExecutor>, DeltaError> {
    static EXECUTOR: LazyLock<Result<Arc<TokioMultiThreadExecutor>, String>> =
        LazyLock::new(|| {
            TokioMultiThreadExecutor::new_owned_runtime(Some(2), None)
                .map(Arc::new)
                .map_err(|e| e.to_string())
        });
    let executor = EXECUTOR.as_ref().map_err(|reason| DeltaError::Task {
        table: table.to_string(),
        reason: reason.clone(),
    })?;
    Ok(DefaultEngineBuilder::new(store)
        .with_task_executor(Arc::clone(executor))
        .build())
}

/// Delta's checkpoint interval when the table sets none.
const CHECKPOINT_INTERVAL: u64 = 10;

/// After a commit: a checkpoint of the table every `delta.checkpointInterval`
/// commits (10 by default, as other Delta writers), so that reading the
/// table (each later commit, every reader) replays at most that many JSON
/// commits. A failed checkpoint costs only speed: logged, not returned.
/// The table after it, when known.
fn after_commit(
    engine: &dyn Engine,
    table: &StoreUri,
    done: &delta_kernel::transaction::CommittedTransaction,
) -> Option<delta_kernel::SnapshotRef> {
    let snapshot = done.post_commit_snapshot().cloned();
    let since = done.post_commit_stats().commits_since_checkpoint;
    let interval = snapshot
        .as_ref()
        .and_then(|s| s.table_properties().checkpoint_interval)
        .map_or(CHECKPOINT_INTERVAL, |n| n.get());
    if since < interval {
        return snapshot;
    }
    let snapshot = match snapshot {
        Some(s) => s,
        None => match Snapshot::builder_for(table_url(table)).build(engine) {
            Ok(s) => s,
            Err(e) => {
                warn!(table = %table, error = %e, "reading the table for its checkpoint failed");
                return None;
            }
        },
    };
    match snapshot.checkpoint(engine, None) {
        Ok((_, checkpointed)) => {
            info!(table = %table, version = checkpointed.version(), "Delta checkpoint written");
            Some(checkpointed)
        }
        Err(e) => {
            warn!(table = %table, error = %e, "writing a Delta checkpoint failed; the next commit tries again");
            Some(snapshot)
        }
    }
}

fn log_folder(table: &StoreUri) -> StoreUri {
    table.join("_delta_log/")
}

/// The table's root as the kernel names it (a folder URL).
fn table_url(table: &StoreUri) -> String {
    let s = table.as_str();
    if s.ends_with('/') {
        s.to_string()
    } else {
        format!("{s}/")
    }
}

fn kernel(table: &StoreUri) -> impl Fn(delta_kernel::KernelError) -> DeltaError + Copy + '_ {
    move |e| DeltaError::Kernel {
        table: table.to_string(),
        source: Box::new(e),
    }
}

fn commit_blocking(
    store: Arc<dyn ObjectStore>,
    append: TableAppend,
    mut exists: bool,
    mut cached: Option<delta_kernel::SnapshotRef>,
) -> Result<Committed, DeltaError> {
    let TableAppend {
        table,
        kind: _,
        job_id,
        seq,
        objects,
        reconcile,
        done,
    } = append;
    let url = table_url(&table);
    let engine = engine(store, &table)?;
    // Objects without rows are scratch files (a processor's uploads), not
    // data files.
    let objects: Vec<OutputObject> = objects.into_iter().filter(|o| o.records > 0).collect();
    let txn = Txn {
        engine: &engine,
        table: &table,
        url: &url,
        job_id: &job_id,
        version: i64::try_from(seq).unwrap_or(i64::MAX),
        objects: &objects,
        reconcile,
        done: done.as_ref(),
    };
    let mut schema = FilesSchema::default();
    for _ in 0..MAX_CONFLICTS {
        let tried = if !exists {
            txn.create(&mut schema, &mut exists)?
        } else {
            txn.append(&mut schema, &mut cached)?
        };
        match tried {
            Tried::Committed(committed) => return Ok(committed),
            Tried::Conflict => {
                warn!(table = %table, job = %job_id, "Delta commit conflicted with another writer; retrying");
            }
        }
    }
    Err(DeltaError::Conflicts {
        table: table.to_string(),
    })
}

/// One try at a job's Delta commit.
enum Tried {
    /// Made, or found made already, or nothing to make.
    Committed(Committed),
    /// Another writer committed first: try again on the table as it is.
    Conflict,
}

/// The files' schema, from the first one's footer: read only to create
/// the table or for the job's first commit to it (later ones passed the
/// check already), and once.
#[derive(Default)]
struct FilesSchema(Option<SchemaRef>);

impl FilesSchema {
    fn get(
        &mut self,
        engine: &dyn Engine,
        table: &StoreUri,
        objects: &[OutputObject],
    ) -> Result<Option<SchemaRef>, DeltaError> {
        if self.0.is_none()
            && let Some(first) = objects.first()
        {
            self.0 = Some(file_schema(engine, first).map_err(kernel(table))?);
        }
        Ok(self.0.clone())
    }
}

/// One job's Delta commit: what each try works with.
struct Txn<'a> {
    engine: &'a DefaultEngine<TokioMultiThreadExecutor>,
    table: &'a StoreUri,
    url: &'a str,
    job_id: &'a str,
    /// The txn version, the commit's sequence number.
    version: i64,
    /// Data files only (objects with rows).
    objects: &'a [OutputObject],
    reconcile: bool,
    done: Option<&'a DoneUpdate>,
}

impl Txn<'_> {
    /// No log yet: create the table, with these files. `exists` is set
    /// once a creation was tried.
    fn create(&self, schema: &mut FilesSchema, exists: &mut bool) -> Result<Tried, DeltaError> {
        let (engine, table, job_id) = (self.engine, self.table, self.job_id);
        let err = kernel(table);
        let Some(schema) = schema.get(engine, table, self.objects)? else {
            return Ok(Tried::Committed(Committed {
                version: None,
                prior_txn: None,
                snapshot: None,
            }));
        };
        *exists = true;
        let adds = add_files(table, self.objects)?;
        let mut builder = create_table(self.url, table_schema(&schema), ENGINE_INFO, true)
            .with_transaction_id(job_id.to_string(), self.version);
        if let Some(update) = self.done {
            // Incremental jobs record their inputs in domain metadata,
            // a writer feature a table has from its creation.
            builder = builder
                .with_table_properties([("delta.feature.domainMetadata", "supported")])
                .with_domain_metadata(
                    inputs_domain(&update.fingerprint),
                    merged_done(DoneInputs::default(), update),
                );
        }
        let created = builder
            .build(engine, Box::new(FileSystemCommitter::new()))
            .and_then(|mut txn| {
                txn.add_files(adds);
                txn.commit(engine)
            });
        match created {
            Ok(CommitResult::Committed(done)) => {
                let version = done.commit_version();
                let snapshot = after_commit(engine, table, &done);
                info!(table = %table, job = %job_id, version, files = self.objects.len(), "Delta table created");
                Ok(Tried::Committed(Committed {
                    version: Some(version),
                    prior_txn: None,
                    snapshot,
                }))
            }
            // Another writer created it first: append to it.
            Ok(_)
            | Err(
                delta_kernel::KernelError::TableAlreadyExistsAtPath(_)
                | delta_kernel::KernelError::FileAlreadyExists(_),
            ) => Ok(Tried::Conflict),
            Err(e) => Err(err(e)),
        }
    }

    /// Appends to the table as it is now (`cached`, brought up to date):
    /// what it lacks of these files, once per txn version.
    fn append(
        &self,
        schema: &mut FilesSchema,
        cached: &mut Option<delta_kernel::SnapshotRef>,
    ) -> Result<Tried, DeltaError> {
        let (engine, table, job_id) = (self.engine, self.table, self.job_id);
        let err = kernel(table);
        let snapshot = current(engine, self.url, cached.take()).map_err(err)?;
        // A conflict's retry brings this one up to date.
        *cached = Some(snapshot.clone());
        let prior_txn = snapshot.get_app_id_version(job_id, engine).map_err(err)?;
        if prior_txn.is_some_and(|v| v >= self.version) {
            return Ok(Tried::Committed(Committed {
                version: None,
                prior_txn,
                snapshot: Some(snapshot),
            }));
        }
        let first_of_job = prior_txn.is_none();
        // Some objects may be in the table already (the machine says so:
        // after a restart or a failed commit, and at every finish): only
        // what the table lacks. Without a commit of the job's txn in the
        // table, none of its files is there.
        let reconcile = self.reconcile && prior_txn.is_some();
        let prior_txn = prior_txn.filter(|_| reconcile);
        let adding: Vec<OutputObject> = if reconcile {
            let present = files_in(&snapshot, engine, table, job_id).map_err(err)?;
            self.objects
                .iter()
                .filter(|o| !present.contains(relative(table, &o.uri).unwrap_or("")))
                .cloned()
                .collect()
        } else {
            self.objects.to_vec()
        };
        if adding.is_empty() && self.done.is_none() {
            return Ok(Tried::Committed(Committed {
                version: None,
                prior_txn,
                snapshot: Some(snapshot),
            }));
        }
        if first_of_job && let Some(files) = schema.get(engine, table, self.objects)? {
            check_schema(table, job_id, &snapshot.schema(), &files)?;
        }
        let mut builder = snapshot
            .clone()
            .update_table(UpdateTableOperation::Write, ENGINE_INFO, true)
            .with_transaction_id(job_id.to_string(), self.version);
        if let Some(update) = self.done {
            // Read again on each try: another job of the pipeline may
            // have recorded inputs since.
            let domain = inputs_domain(&update.fingerprint);
            let before = read_done(&snapshot, engine, table, &domain)?;
            builder = builder.with_domain_metadata(domain, merged_done(before, update));
        }
        let mut txn = builder
            .build(engine, Box::new(FileSystemCommitter::new()))
            .map_err(err)?;
        txn.add_files(add_files(table, &adding)?);
        match txn.commit(engine) {
            Ok(CommitResult::Committed(done)) => {
                let version = done.commit_version();
                info!(table = %table, job = %job_id, version, files = adding.len(), "Delta commit");
                Ok(Tried::Committed(Committed {
                    version: Some(version),
                    prior_txn,
                    snapshot: after_commit(engine, table, &done),
                }))
            }
            Ok(_) => Ok(Tried::Conflict),
            Err(e) => Err(err(e)),
        }
    }
}

/// The table version whose commit carries the txn `(job_id, seq)`: the
/// log is read from its newest commit back (a recovery only: a
/// coordinator that crashed between its Delta commit and its record).
async fn version_with_txn(
    stores: &Stores,
    table: &StoreUri,
    job_id: &str,
    txn_version: i64,
) -> Result<Option<u64>, DeltaError> {
    let mut commits: Vec<(u64, StoreUri)> = stores
        .list(&log_folder(table))
        .await?
        .into_iter()
        .filter_map(|listed| {
            let name = listed.uri.file_name().to_string();
            let version = name.strip_suffix(".json")?.parse::<u64>().ok()?;
            Some((version, listed.uri))
        })
        .collect();
    commits.sort_unstable_by_key(|c| std::cmp::Reverse(c.0));
    for (version, uri) in commits {
        let bytes = stores.get(&uri).await?;
        let found = bytes
            .split(|b| *b == b'\n')
            .filter_map(|line| serde_json::from_slice::<serde_json::Value>(line).ok())
            .any(|action| {
                let txn = &action["txn"];
                txn["appId"].as_str() == Some(job_id)
                    && txn["version"].as_i64() == Some(txn_version)
            });
        if found {
            return Ok(Some(version));
        }
    }
    warn!(table = %table, job = %job_id, "the Delta commit of this job is no longer in the table's log");
    Ok(None)
}
