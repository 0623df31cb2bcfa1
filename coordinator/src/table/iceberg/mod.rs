//! Adding a job's committed Parquet objects to an Iceberg table with the
//! table format's own crate (`iceberg`) and its catalogs (ADR 024). The
//! workers write Parquet with stoke's writer, as for Delta; the
//! coordinator registers the files as data files in a fast append.
//!
//! Every append carries its identity in the snapshot summary:
//! `stoke.job-id` and `stoke.seq`, the highest progress `seq` the commit
//! covers. Before committing, and again after any failed commit (whose
//! answer may have been lost after the catalog took it), the table's
//! snapshots (the current one and its ancestors) are read: a snapshot of
//! the job at or past the sequence means the files are in the table
//! already, and nothing is added twice. Another writer's commit between
//! our read and ours makes the catalog refuse ours (its compare-and-swap
//! on the table's metadata location); the crate retries such a refusal
//! on the table as it is then, and stoke's own loop re-reads the
//! snapshots before any other retry.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, LazyLock, Mutex};

use iceberg::spec::{
    DEFAULT_SCHEMA_NAME_MAPPING, ManifestList, ManifestStatus, Schema, TableProperties,
};
use iceberg::table::Table;
use iceberg::transaction::{ApplyTransactionAction, Transaction};
use iceberg::{Catalog, ErrorKind, NamespaceIdent, TableCreation, TableIdent};
use parquet::file::metadata::ParquetMetaData;
use stoke_core::plan::DoneInputs;
use stoke_core::records::OutputObject;
use stoke_core::spec::{CatalogSpec, FieldId, OutputSpec};
use stoke_store::{StoreError, Stores};
use thiserror::Error;
use tracing::{info, warn};

use crate::state::{TableAppend, TableKind};
use crate::table::delta::{Appended, KnownType, merged_done};

pub mod catalog;
pub mod files;

/// The snapshot summary's key for the job that made it.
pub const JOB_ID_KEY: &str = "stoke.job-id";
/// The snapshot summary's key for the commit's sequence number.
pub const SEQ_KEY: &str = "stoke.seq";
/// What the snapshots name as their writer.
const ENGINE_KEY: &str = "stoke.engine";
const ENGINE_INFO: &str = concat!("stoke/", env!("CARGO_PKG_VERSION"));
/// Failed commits retried before giving up (the finish or the group is
/// tried again later anyway).
const MAX_CONFLICTS: usize = 20;

#[derive(Debug, Error)]
pub enum IcebergError {
    #[error("opening the {catalog}: {source}")]
    Open {
        catalog: String,
        #[source]
        source: Box<iceberg::Error>,
    },
    #[error("Iceberg table {table}: {source}")]
    Catalog {
        table: String,
        #[source]
        source: Box<iceberg::Error>,
        /// A REST catalog refused the request itself (an HTTP 4xx other
        /// than a conflict, a timeout, rate limiting or sign-in): asking
        /// again will not help.
        refused: bool,
    },
    #[error("{catalog}: {what} are not built in")]
    Unsupported { catalog: String, what: String },
    #[error(
        "{catalog}: its {what} is read from environment variable {var}, which the coordinator does not have: set it where the coordinator runs"
    )]
    Secret {
        catalog: String,
        what: String,
        var: String,
    },
    #[error(
        "the {catalog} has no table {table}, and the server places a new one: give [output] uri, a folder for the job's data files (the table is created at the job's first append), or create the table first"
    )]
    NoLocation { catalog: String, table: String },
    #[error(
        "Iceberg table {table} has schema {table_schema}, but job {job_id} writes {job_schema}: write to another table, or make the processor's output columns match"
    )]
    SchemaClash {
        table: String,
        job_id: String,
        table_schema: String,
        job_schema: String,
    },
    #[error(
        "Iceberg table {}: the data file {} of job {} carries field id {} for column {}, and the table {}: the table was made or changed after the job's submit (submit it again)",
        .0.table, .0.object, .0.job_id, .0.file_id, .0.column, .0.table_has
    )]
    FieldIds(Box<FieldIdClash>),
    #[error(
        "Iceberg table {table}: column {column} is of type {data_type}, which Iceberg has no type for (cast it in the processor: timestamps in microseconds, no unsigned 64-bit integers, no float16)"
    )]
    ColumnType {
        table: String,
        column: String,
        data_type: String,
    },
    #[error("Iceberg table {table}: {message}")]
    Schema { table: String, message: String },
    #[error("reading the Parquet footer of {object}: {message}")]
    Footer { object: String, message: String },
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("Iceberg table {table}: gave up after {MAX_CONFLICTS} failed commits")]
    Conflicts { table: String },
}

impl IcebergError {
    /// Errors no retry can fix: the job fails with them.
    pub fn is_permanent(&self) -> bool {
        matches!(
            self,
            Self::SchemaClash { .. }
                | Self::FieldIds(_)
                | Self::ColumnType { .. }
                | Self::Unsupported { .. }
                | Self::Secret { .. }
                | Self::NoLocation { .. }
                | Self::Footer { .. }
                | Self::Catalog { refused: true, .. }
        )
    }
}

/// A data file whose field id is not the table's.
#[derive(Debug)]
pub struct FieldIdClash {
    pub table: String,
    pub job_id: String,
    pub object: String,
    pub column: String,
    pub file_id: i32,
    /// "has N", or "has no such field".
    pub table_has: String,
}

/// The identifier of `namespace.table`.
fn ident(table: &str) -> Result<TableIdent, IcebergError> {
    let bad = |message: String| IcebergError::Schema {
        table: table.to_string(),
        message,
    };
    let (namespace, name) =
        stoke_core::spec::split_table_name(table).map_err(|e| bad(e.to_string()))?;
    let namespace = NamespaceIdent::from_vec(namespace).map_err(|e| bad(e.to_string()))?;
    Ok(TableIdent::new(namespace, name))
}

fn catalog_error(table: &str) -> impl Fn(iceberg::Error) -> IcebergError + '_ {
    move |e| IcebergError::Catalog {
        table: table.to_string(),
        refused: http_status(&e).is_some_and(refuses),
        source: Box::new(e),
    }
}

/// The HTTP status a REST catalog answered an unexpected request with:
/// the REST crate keeps it, as text, in the error's context
/// (`status: 422 Unprocessable Entity`).
fn http_status(e: &iceberg::Error) -> Option<u16> {
    let text = e.to_string();
    let at = text.find("status: ")? + "status: ".len();
    text.get(at..at + 3)?.parse().ok()
}

/// Whether an HTTP status refuses the request for good: a 4xx, but a
/// conflict (409), a timeout (408), rate limiting (419, 429) or a
/// sign-in that may be renewed (401, 403).
fn refuses(status: u16) -> bool {
    (400..500).contains(&status) && !matches!(status, 401 | 403 | 408 | 409 | 419 | 429)
}

/// The table, or `None` if its catalog has no such table (or namespace).
async fn load(catalog: &dyn Catalog, table: &str) -> Result<Option<Table>, IcebergError> {
    match catalog.load_table(&ident(table)?).await {
        Ok(t) => Ok(Some(t)),
        Err(e)
            if matches!(
                e.kind(),
                ErrorKind::TableNotFound | ErrorKind::NamespaceNotFound
            ) =>
        {
            Ok(None)
        }
        Err(e) => Err(catalog_error(table)(e)),
    }
}

/// What submit needs of an Iceberg job's table, from one read of it:
/// where its data files go (`output.uri` if given, else the table's
/// location, or the location a new table will have), and with
/// `fingerprint`, the inputs the table records as done for that
/// pipeline. A job whose columns are known now (the built-in
/// processor's) is refused if the table has others.
pub async fn at_submit(
    stores: &Stores,
    output: &OutputSpec,
    job: &str,
    columns: Option<Vec<(String, KnownType)>>,
    fingerprint: Option<&str>,
) -> Result<AtSubmit, IcebergError> {
    let Some((table, spec)) = output.iceberg() else {
        return Err(IcebergError::Schema {
            table: output.table.clone().unwrap_or_default(),
            message: "no table and catalog in [output]".to_string(),
        });
    };
    let catalog = catalog::open(spec, stores).await?;
    let found = load(catalog.as_ref(), table).await?;
    if let (Some(t), Some(columns)) = (&found, &columns) {
        check_known_columns(t.metadata().current_schema(), table, job, columns)?;
    }
    let done = match (&found, fingerprint) {
        (Some(t), Some(fingerprint)) => read_done(t, table, fingerprint)?,
        _ => DoneInputs::default(),
    };
    let field_ids = found
        .as_ref()
        .map(|t| files::field_ids(t.metadata().current_schema()))
        .unwrap_or_default();
    let location = match (&output.uri, found) {
        (Some(uri), _) => uri.clone(),
        (None, Some(t)) => t.metadata().location().to_string(),
        (None, None) => new_table_location(catalog.as_ref(), spec, table).await?,
    };
    Ok(AtSubmit {
        location,
        done,
        field_ids,
    })
}

/// What submit learns from an Iceberg job's table.
pub struct AtSubmit {
    /// Where the job's data files go.
    pub location: String,
    /// The inputs the table records as done for the job's pipeline.
    pub done: DoneInputs,
    /// The field ids of the table's columns (none for a new table).
    pub field_ids: Vec<FieldId>,
}

/// Where a new table goes: its namespace's `location` property, else
/// the warehouse's folder for the namespace, then the table's name (the
/// SQL catalog's and pyiceberg's own choice).
async fn new_table_location(
    catalog: &dyn Catalog,
    spec: &CatalogSpec,
    table: &str,
) -> Result<String, IcebergError> {
    let ident = ident(table)?;
    let namespace_location = match catalog.get_namespace(ident.namespace()).await {
        Ok(ns) => ns.properties().get("location").cloned(),
        Err(e) if e.kind() == ErrorKind::NamespaceNotFound => None,
        Err(e) => return Err(catalog_error(table)(e)),
    };
    let base = match (namespace_location, spec) {
        (Some(location), _) => location,
        (None, CatalogSpec::Sql { warehouse, .. }) => format!(
            "{}/{}",
            warehouse.trim_end_matches('/'),
            ident.namespace().join("/")
        ),
        (None, CatalogSpec::Rest { .. }) => {
            return Err(IcebergError::NoLocation {
                catalog: catalog::describe(spec),
                table: table.to_string(),
            });
        }
    };
    Ok(format!("{}/{}", base.trim_end_matches('/'), ident.name()))
}

/// The table property that keeps the done inputs of the pipeline with
/// `fingerprint` (ADR 013; Delta keeps them in a domain of its log).
pub fn inputs_property(fingerprint: &str) -> String {
    format!("stoke.inputs.{fingerprint}")
}

/// The inputs `table` records as done for the pipeline with
/// `fingerprint`.
fn read_done(table: &Table, name: &str, fingerprint: &str) -> Result<DoneInputs, IcebergError> {
    let key = inputs_property(fingerprint);
    match table.metadata().properties().get(&key) {
        None => Ok(DoneInputs::default()),
        Some(json) => serde_json::from_str(json).map_err(|e| IcebergError::Schema {
            table: name.to_string(),
            message: format!("the done inputs in table property {key} cannot be read: {e}"),
        }),
    }
}

/// The table's columns are `columns`, by name and type.
fn check_known_columns(
    schema: &Schema,
    table: &str,
    job: &str,
    columns: &[(String, KnownType)],
) -> Result<(), IcebergError> {
    let want: Vec<(String, &str)> = columns
        .iter()
        .map(|(n, k)| (n.clone(), k.iceberg_name()))
        .collect();
    let have = files::columns(schema);
    let fits = have.len() == want.len()
        && want
            .iter()
            .all(|(n, t)| have.get(n).is_some_and(|h| h == t));
    if fits {
        return Ok(());
    }
    let mut want: Vec<String> = want.iter().map(|(n, t)| format!("{n}: {t}")).collect();
    want.sort();
    Err(IcebergError::SchemaClash {
        table: table.to_string(),
        job_id: job.to_string(),
        table_schema: files::show(&have),
        job_schema: format!("({})", want.join(", ")),
    })
}

type TableLock = Arc<tokio::sync::Mutex<()>>;

/// One commit at a time per table from this coordinator: its jobs do not
/// conflict with each other.
fn table_lock(key: &str) -> TableLock {
    static LOCKS: LazyLock<Mutex<HashMap<String, TableLock>>> = LazyLock::new(Default::default);
    let mut locks = LOCKS.lock().unwrap_or_else(|p| p.into_inner());
    locks.entry(key.to_string()).or_default().clone()
}

/// The job's appends in the table's current state (its current snapshot
/// and that one's ancestors): (snapshot id, seq), newest first.
fn appends_of(table: &Table, job_id: &str) -> Vec<(i64, u64)> {
    let metadata = table.metadata();
    let mut found = Vec::new();
    let mut next = metadata.current_snapshot_id();
    let mut seen = HashSet::new();
    while let Some(id) = next {
        if !seen.insert(id) {
            break;
        }
        let Some(snapshot) = metadata.snapshot_by_id(id) else {
            break;
        };
        let props = &snapshot.summary().additional_properties;
        if props.get(JOB_ID_KEY).map(String::as_str) == Some(job_id)
            && let Some(seq) = props.get(SEQ_KEY).and_then(|s| s.parse::<u64>().ok())
        {
            found.push((id, seq));
        }
        next = snapshot.parent_snapshot_id();
    }
    found
}

/// The paths of the live data files of the table under `folder`, the
/// job's, whose snapshots are `ours`. Only the manifests that may hold
/// them are read: those its snapshots added, and any with existing
/// entries (a rewrite or merge of older manifests, by any writer). A
/// manifest another snapshot added with no existing entries holds only
/// what that snapshot added or removed. So what a reconcile reads grows
/// with the job's appends, not with the table's.
async fn files_under(
    table: &Table,
    folder: &str,
    ours: &HashSet<i64>,
) -> Result<HashSet<String>, iceberg::Error> {
    let metadata = table.metadata();
    let mut paths = HashSet::new();
    let Some(snapshot) = metadata.current_snapshot() else {
        return Ok(paths);
    };
    let file_io = table.file_io();
    let bytes = file_io.new_input(snapshot.manifest_list())?.read().await?;
    let list = ManifestList::parse_with_version(&bytes, metadata.format_version())?;
    for manifest in list.entries() {
        let may_hold_ours = ours.contains(&manifest.added_snapshot_id)
            || manifest.existing_files_count.is_none_or(|n| n > 0);
        if !may_hold_ours {
            continue;
        }
        for entry in manifest.load_manifest(file_io).await?.entries() {
            let path = entry.file_path();
            if entry.status() != ManifestStatus::Deleted && path.starts_with(folder) {
                paths.insert(path.to_string());
            }
        }
    }
    Ok(paths)
}

/// Commits `append` to its Iceberg table (creating the namespace and the
/// table with the objects' schema if the catalog lacks them).
pub async fn append(stores: &Stores, append: TableAppend) -> Result<Appended, IcebergError> {
    let TableKind::Iceberg {
        name,
        catalog: spec,
    } = &append.kind
    else {
        return Err(IcebergError::Schema {
            table: append.table.to_string(),
            message: "not an Iceberg table".to_string(),
        });
    };
    let lock = table_lock(&format!("{}\n{name}", catalog::describe(spec)));
    let _held = lock.lock().await;
    let catalog = catalog::open(spec, stores).await?;
    let mut commit = Commit {
        stores,
        catalog: catalog.as_ref(),
        name,
        append: &append,
        // Objects without rows are scratch files (a processor's
        // uploads), not data files.
        objects: append
            .objects
            .iter()
            .filter(|o| o.records > 0)
            .cloned()
            .collect(),
        footers: HashMap::new(),
    };
    for _ in 0..MAX_CONFLICTS {
        match commit.try_once().await? {
            Tried::Done(appended) => return Ok(appended),
            Tried::Again => {}
        }
    }
    Err(IcebergError::Conflicts {
        table: name.clone(),
    })
}

enum Tried {
    /// Made, or found made already, or nothing to make.
    Done(Appended),
    /// The table changed under us, or a commit failed without landing:
    /// read it again.
    Again,
}

/// One job's append: what each try works with.
struct Commit<'a> {
    stores: &'a Stores,
    catalog: &'a dyn Catalog,
    name: &'a str,
    append: &'a TableAppend,
    /// Data files only (objects with rows).
    objects: Vec<OutputObject>,
    /// Footers read so far, by URI: each is read once.
    footers: HashMap<String, Arc<ParquetMetaData>>,
}

/// Footers read at once: a job's append reads one per data file (two
/// ranged reads each), and a large job has thousands of files.
const FOOTER_READS_AT_ONCE: usize = 32;

impl Commit<'_> {
    async fn footer(
        &mut self,
        object: &OutputObject,
    ) -> Result<Arc<ParquetMetaData>, IcebergError> {
        if let Some(f) = self.footers.get(&object.uri) {
            return Ok(Arc::clone(f));
        }
        let f = Arc::new(files::footer(self.stores, object).await?);
        self.footers.insert(object.uri.clone(), Arc::clone(&f));
        Ok(f)
    }

    /// Reads the footers of `objects` not read yet, many at once.
    async fn read_footers(&mut self, objects: &[OutputObject]) -> Result<(), IcebergError> {
        use futures::{StreamExt, TryStreamExt};
        // Owned values in the reads: a stream of borrowing futures is not
        // `Send` for every lifetime, as the owner's task needs.
        let missing: Vec<OutputObject> = objects
            .iter()
            .filter(|o| !self.footers.contains_key(&o.uri))
            .cloned()
            .collect();
        let stores = self.stores.clone();
        let read: Vec<(String, ParquetMetaData)> = futures::stream::iter(missing)
            .map(move |o| {
                let stores = stores.clone();
                async move {
                    let footer = files::footer(&stores, &o).await?;
                    Ok::<_, IcebergError>((o.uri, footer))
                }
            })
            .buffer_unordered(FOOTER_READS_AT_ONCE)
            .try_collect()
            .await?;
        for (uri, footer) in read {
            self.footers.insert(uri, Arc::new(footer));
        }
        Ok(())
    }

    /// The table, created if the catalog lacks it (`None`: it lacks it
    /// and there is nothing to create it with).
    async fn table(&mut self) -> Result<Option<Table>, IcebergError> {
        if let Some(t) = load(self.catalog, self.name).await? {
            return Ok(Some(t));
        }
        let Some(first) = self.objects.first().cloned() else {
            return Ok(None);
        };
        let footer = self.footer(&first).await?;
        let schema = files::table_schema(self.name, &files::arrow_schema(&first, &footer)?)?;
        let ident = ident(self.name)?;
        // A nested namespace's parents first (catalogs may want them).
        let levels = ident.namespace().clone().inner();
        for depth in 1..=levels.len() {
            let namespace = NamespaceIdent::from_vec(levels[..depth].to_vec())
                .map_err(catalog_error(self.name))?;
            match self
                .catalog
                .create_namespace(&namespace, HashMap::new())
                .await
            {
                Ok(_) => {}
                Err(e) if e.kind() == ErrorKind::NamespaceAlreadyExists => {}
                Err(e) => return Err(catalog_error(self.name)(e)),
            }
        }
        // A SQL catalog's table goes where submit said; a REST server
        // places its tables itself (the job's files stay in its folder).
        let location = match self.append.kind {
            TableKind::Iceberg {
                catalog: CatalogSpec::Sql { .. },
                ..
            } => Some(self.append.table.as_str().trim_end_matches('/').to_string()),
            _ => None,
        };
        let creation = TableCreation::builder()
            .name(ident.name().to_string())
            .schema(schema)
            .location_opt(location)
            .properties([(ENGINE_KEY.to_string(), ENGINE_INFO.to_string())])
            .build();
        match self.catalog.create_table(ident.namespace(), creation).await {
            Ok(t) => {
                info!(table = %self.name, location = %t.metadata().location(), "Iceberg table created");
                Ok(Some(t))
            }
            // Another writer created it first: append to theirs.
            Err(e) if e.kind() == ErrorKind::TableAlreadyExists => {
                load(self.catalog, self.name).await
            }
            Err(e) => Err(catalog_error(self.name)(e)),
        }
    }

    async fn try_once(&mut self) -> Result<Tried, IcebergError> {
        let (append, name) = (self.append, self.name);
        let job_id = append.job_id.as_str();
        let Some(table) = self.table().await? else {
            return Ok(Tried::Done(Appended::default()));
        };
        let ours = appends_of(&table, job_id);
        let newest = ours.iter().max_by_key(|(_, seq)| *seq).copied();
        if let Some((id, seq)) = newest
            && seq >= append.seq
        {
            return Ok(Tried::Done(Appended {
                version: None,
                prior: u64::try_from(id).ok(),
            }));
        }
        // Some objects may be in the table already (the machine says so:
        // after a restart or a failed append, and at every finish): only
        // what the table lacks. Without an append of the job in the
        // table, none of its files is there.
        let reconcile = append.reconcile && newest.is_some();
        let prior = newest
            .filter(|_| reconcile)
            .and_then(|(id, _)| u64::try_from(id).ok());
        let adding: Vec<OutputObject> = if reconcile {
            let folder = append.kind.job_folder(&append.table, job_id);
            let folder = format!("{}/", folder.as_str().trim_end_matches('/'));
            let ids: HashSet<i64> = ours.iter().map(|(id, _)| *id).collect();
            let present = files_under(&table, &folder, &ids)
                .await
                .map_err(catalog_error(name))?;
            self.objects
                .iter()
                .filter(|o| !present.contains(&o.uri))
                .cloned()
                .collect()
        } else {
            self.objects.clone()
        };
        if adding.is_empty() && append.done.is_none() {
            return Ok(Tried::Done(Appended {
                version: None,
                prior,
            }));
        }
        let schema = table.metadata().current_schema().clone();
        let spec_id = table.metadata().default_partition_spec_id();
        self.read_footers(&adding).await?;
        let mut data_files = Vec::with_capacity(adding.len());
        let table_ids = files::ids_by_path(&schema);
        for (i, object) in adding.iter().enumerate() {
            let footer = self.footer(object).await?;
            let files = files::arrow_schema(object, &footer)?;
            if i == 0
                && newest.is_none()
                && let Some((have, want)) = files::misfit(name, &schema, &files)
            {
                return Err(IcebergError::SchemaClash {
                    table: name.to_string(),
                    job_id: job_id.to_string(),
                    table_schema: have,
                    job_schema: want,
                });
            }
            // Readers find a file's columns by these ids: a file whose ids
            // are not the table's would be read wrong.
            if let Some((column, file_id, theirs)) = files::id_clash(&table_ids, &files) {
                return Err(IcebergError::FieldIds(Box::new(FieldIdClash {
                    table: name.to_string(),
                    job_id: job_id.to_string(),
                    object: object.uri.clone(),
                    column,
                    file_id,
                    table_has: match theirs {
                        Some(id) => format!("has {id}"),
                        None => "has no such field".to_string(),
                    },
                })));
            }
            data_files.push(files::data_file(object, &footer, &schema, spec_id)?);
        }
        let summary = HashMap::from([
            (JOB_ID_KEY.to_string(), job_id.to_string()),
            (SEQ_KEY.to_string(), append.seq.to_string()),
            (ENGINE_KEY.to_string(), ENGINE_INFO.to_string()),
        ]);
        let err = catalog_error(name);
        let mut tx = Transaction::new(&tried_once(&table).map_err(&err)?);
        if !data_files.is_empty() {
            // The crate's duplicate check reads every manifest of the
            // table at each append (requests growing with the table);
            // stoke's own check is the job's snapshots and, where the
            // machine says files may be there, its manifests
            // (`files_under`).
            tx = tx
                .fast_append()
                .with_check_duplicate(false)
                .add_data_files(data_files)
                .set_snapshot_properties(summary)
                .apply(tx)
                .map_err(&err)?;
        }
        let mut properties = tx.update_table_properties();
        let mut changed = false;
        if !table
            .metadata()
            .properties()
            .contains_key(DEFAULT_SCHEMA_NAME_MAPPING)
        {
            let mapping = serde_json::to_string(&files::name_mapping(&schema)).unwrap_or_default();
            properties = properties.set(DEFAULT_SCHEMA_NAME_MAPPING.to_string(), mapping);
            changed = true;
        }
        if let Some(update) = &append.done {
            // Read again on each try: another job of the pipeline may
            // have recorded inputs since. In the same commit as the rows.
            let before = read_done(&table, name, &update.fingerprint)?;
            properties = properties.set(
                inputs_property(&update.fingerprint),
                merged_done(before, update),
            );
            changed = true;
        }
        if changed {
            tx = properties.apply(tx).map_err(&err)?;
        }
        let mut result = tx.commit(self.catalog).await;
        if result.is_ok() {
            // Fault injection: the catalog took the commit, but its answer
            // is lost (a connection broken after the database's update).
            (|| {
                fail::fail_point!("coordinator::iceberg_answer_lost", |_| {
                    result = Err(iceberg::Error::new(
                        ErrorKind::Unexpected,
                        "fault point: the catalog's answer to a commit was lost",
                    ));
                });
            })();
        }
        match result {
            Ok(after) => {
                // A commit of properties alone (an incremental job with no
                // new rows) makes no snapshot.
                let id = after
                    .metadata()
                    .current_snapshot_id()
                    .filter(|_| !adding.is_empty());
                info!(table = %name, job = %job_id, snapshot = ?id, files = adding.len(), "Iceberg append");
                Ok(Tried::Done(Appended {
                    version: id.and_then(|id| u64::try_from(id).ok()),
                    prior,
                }))
            }
            Err(e) => {
                // Whether it landed or not, the next try reads the
                // table's snapshots first: its own append found there is
                // not made again.
                let conflict = e.kind() == ErrorKind::CatalogCommitConflicts;
                warn!(table = %name, job = %job_id, error = %e, conflict, "an Iceberg append failed; reading the table again");
                if conflict || landed(self.catalog, name, job_id, append.seq).await? {
                    Ok(Tried::Again)
                } else {
                    Err(err(e))
                }
            }
        }
    }
}

/// A copy of `table` whose properties make the crate try a commit once
/// (`commit.retry.num-retries = 0`): after a refusal or a lost answer,
/// stoke's loop reads the snapshots again before any retry, as the crate
/// would not (it replays the append on the refreshed table).
fn tried_once(table: &Table) -> Result<Table, iceberg::Error> {
    let mut properties = table.metadata().properties().clone();
    properties.insert(
        TableProperties::PROPERTY_COMMIT_NUM_RETRIES.to_string(),
        "0".to_string(),
    );
    let location = table.metadata_location().map(str::to_string);
    let metadata = table
        .metadata()
        .clone()
        .into_builder(location.clone())
        .set_properties(properties)?
        .build()?
        .metadata;
    let mut builder = Table::builder()
        .metadata(metadata)
        .identifier(table.identifier().clone())
        .file_io(table.file_io().clone())
        .runtime(iceberg::Runtime::try_current()?);
    if let Some(location) = location {
        builder = builder.metadata_location(location);
    }
    builder.build()
}

/// Whether the table holds the job's append of `seq` (or a later one).
async fn landed(
    catalog: &dyn Catalog,
    name: &str,
    job_id: &str,
    seq: u64,
) -> Result<bool, IcebergError> {
    Ok(match load(catalog, name).await? {
        Some(t) => appends_of(&t, job_id).iter().any(|(_, s)| *s >= seq),
        None => false,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rest_catalogs_refusal_fails_the_job_and_its_conflicts_and_sign_ins_are_retried() {
        let answered = |status: &str| {
            iceberg::Error::new(
                ErrorKind::Unexpected,
                "Received response with unexpected status code",
            )
            .with_context("status", status.to_string())
            .with_context("json", "{}")
        };
        let e = catalog_error("a.t")(answered("422 Unprocessable Entity"));
        assert!(e.is_permanent(), "{e}");
        assert!(e.to_string().contains("422"), "{e}");
        for status in [
            "409 Conflict",
            "401 Unauthorized",
            "429 Too Many Requests",
            "503 Service Unavailable",
        ] {
            let e = catalog_error("a.t")(answered(status));
            assert!(!e.is_permanent(), "{status}: {e}");
        }
        let e = catalog_error("a.t")(iceberg::Error::new(
            ErrorKind::Unexpected,
            "connection reset",
        ));
        assert!(!e.is_permanent(), "{e}");
    }
}
