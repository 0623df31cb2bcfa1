//! `[output]`: where a job's results go, in which format, and for a table
//! format (Delta, Iceberg) when its rows become visible.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::JobSpec;
use crate::error::SpecError;
use stoke_uri::StoreUri;

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OutputSpec {
    /// Where output objects go; default `<root>/jobs/<job>/outputs`. For
    /// `format = "iceberg"`: the folder of the job's data files, and the
    /// location of a table stoke creates; default the table's location
    /// (filled in at submit).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uri: Option<String>,
    #[serde(default)]
    pub format: OutputFormat,
    /// `format = "delta"` or `"iceberg"` only: when the table shows the
    /// job's rows.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub commit: Option<DeltaCommit>,
    /// `format = "iceberg"`: the table, `namespace.table` (a nested
    /// namespace has more dots: `a.b.table`). Created with the outputs'
    /// schema if the catalog lacks it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub table: Option<String>,
    /// `format = "iceberg"`: the catalog that holds `table`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub catalog: Option<CatalogSpec>,
    /// The same as `[dataset] incremental`, said where the table is:
    /// skip the input objects earlier jobs of the same pipeline wrote to
    /// this table.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub incremental: bool,
    /// `format = "iceberg"`: the Iceberg field ids of the table's columns,
    /// filled in at submit from the table if it exists (a value given in
    /// a spec is replaced). The workers write them into their Parquet
    /// files (`PARQUET:field_id`), which readers and REST catalogs
    /// expect; a table stoke creates numbers its columns as the workers
    /// did (see [`FieldId`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub field_ids: Vec<FieldId>,
}

/// An Iceberg field id and where the field is: its names from the
/// top-level column down. A list's element is `element`, a map's key and
/// value are `key` and `value` (Iceberg's and Parquet's spelling), so
/// `["tags", "element"]` is the element of list column `tags`.
///
/// Columns without an id (a new table's, or ones the table lacks) are
/// numbered as Iceberg numbers a new table's (iceberg-rust's
/// `ReassignFieldIds`, after the largest id given): a struct's fields
/// one after another, then the fields nested in each, in order; a list's
/// element, then what is in it; a map's key and what is in it, then its
/// value and what is in it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FieldId {
    pub path: Vec<String>,
    pub id: i32,
}

impl OutputSpec {
    /// The Delta commit mode, for a job that writes a Delta table.
    pub fn delta(&self) -> Option<DeltaCommit> {
        (self.format == OutputFormat::Delta).then(|| self.commit.unwrap_or_default())
    }

    /// The commit mode of a job that writes a table (Delta or Iceberg).
    pub fn table_commit(&self) -> Option<DeltaCommit> {
        matches!(self.format, OutputFormat::Delta | OutputFormat::Iceberg)
            .then(|| self.commit.unwrap_or_default())
    }

    /// An Iceberg job's table and catalog (checked at submit).
    pub fn iceberg(&self) -> Option<(&str, &CatalogSpec)> {
        if self.format != OutputFormat::Iceberg {
            return None;
        }
        Some((self.table.as_deref()?, self.catalog.as_ref()?))
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OutputFormat {
    #[default]
    Parquet,
    Jsonl,
    /// Parquet data files in a Delta Lake table at `output.uri`, added to
    /// its log by the coordinator (see `output.commit`).
    Delta,
    /// Parquet data files appended to the Iceberg table `output.table` of
    /// `output.catalog` by the coordinator (see `output.commit`).
    Iceberg,
    /// The OpenAI Batch API's output lines (`id`, `custom_id`, `response`,
    /// `error`), one per record, from the LLM processor.
    #[serde(rename = "openai-batch")]
    OpenaiBatch,
}

impl OutputFormat {
    pub fn extension(self) -> &'static str {
        match self {
            Self::Parquet | Self::Delta | Self::Iceberg => "parquet",
            Self::Jsonl | Self::OpenaiBatch => "jsonl",
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Parquet => "parquet",
            Self::Jsonl => "jsonl",
            Self::Delta => "delta",
            Self::Iceberg => "iceberg",
            Self::OpenaiBatch => "openai-batch",
        }
    }

    /// Whether the objects are added to a table (Delta, Iceberg) by the
    /// coordinator.
    pub fn is_table(self) -> bool {
        matches!(self, Self::Delta | Self::Iceberg)
    }
}

/// When a table job's rows become visible in its table.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DeltaCommit {
    /// One table commit when the job succeeds: readers see all of the job
    /// or none of it.
    #[default]
    End,
    /// One table commit per progress group: readers of a long job see its
    /// committed rows as they land.
    Checkpoint,
}

/// An Iceberg catalog (`[output] catalog = { type = "sql", ... }`).
/// Secrets are never in the spec: it names the environment variables of
/// the coordinator that hold them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "lowercase", deny_unknown_fields)]
pub enum CatalogSpec {
    /// A SQL catalog on an SQLite database file: embedded, no server.
    /// Its tables are in the same database rows pyiceberg's `SqlCatalog`
    /// reads.
    Sql {
        /// `sqlite:///path/to/catalog.db` (created if missing).
        uri: String,
        /// Where new tables go: `file://`, `s3://`, `az://`, `gs://`.
        warehouse: String,
        /// The catalog's name in the database (`catalog_name`); readers
        /// open the catalog by this name. Default `"default"`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        name: Option<String>,
    },
    /// A catalog behind the Iceberg REST protocol (Polaris, Lakekeeper,
    /// Nessie, Glue's and S3 Tables' REST endpoints).
    Rest {
        /// The catalog's base URI (`https://catalog.example/api/catalog`).
        uri: String,
        /// The warehouse the server serves (its name, or a location; the
        /// server decides).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        warehouse: Option<String>,
        /// The environment variable holding a bearer token.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        token_env: Option<String>,
        /// The environment variable holding OAuth2 client credentials,
        /// `client_id:client_secret`, exchanged for a token.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        credential_env: Option<String>,
        /// Where client credentials are exchanged (default: the catalog's
        /// own `v1/oauth/tokens`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        oauth2_server_uri: Option<String>,
        /// The OAuth2 scope asked for (default `catalog`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        scope: Option<String>,
        /// Other catalog properties, handed to the REST client as they
        /// are (`prefix` for a server whose configuration does not give
        /// one, `header.X-Iceberg-Access-Delegation`, ...). Never a
        /// secret: those are named by `token_env` and `credential_env`.
        #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
        properties: BTreeMap<String, String>,
    },
}

/// The catalog name when a SQL catalog's `name` is left out (pyiceberg's
/// default catalog name too).
pub const DEFAULT_CATALOG_NAME: &str = "default";

impl CatalogSpec {
    /// `sql` or `rest`.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Sql { .. } => "sql",
            Self::Rest { .. } => "rest",
        }
    }

    /// The catalog's name (a REST catalog's is its URI's, for messages).
    pub fn name(&self) -> &str {
        match self {
            Self::Sql { name, .. } => name.as_deref().unwrap_or(DEFAULT_CATALOG_NAME),
            Self::Rest { .. } => "rest",
        }
    }

    fn validate(&self) -> Result<(), SpecError> {
        match self {
            Self::Sql {
                uri,
                warehouse,
                name,
            } => {
                if !uri.starts_with("sqlite:") || uri.len() <= "sqlite:".len() {
                    return Err(SpecError::invalid(
                        "output.catalog.uri",
                        format!(
                            "a SQL catalog is an SQLite database, \"sqlite:///path/to/catalog.db\", not \"{uri}\" (other databases are not built in)"
                        ),
                    ));
                }
                let at = StoreUri::parse(warehouse)
                    .map_err(|e| SpecError::invalid("output.catalog.warehouse", e.to_string()))?;
                readable_by_engines(&at, "output.catalog.warehouse")?;
                if name.as_deref().is_some_and(|n| n.trim().is_empty()) {
                    return Err(SpecError::invalid(
                        "output.catalog.name",
                        "must not be empty (leave it out for \"default\")",
                    ));
                }
                Ok(())
            }
            Self::Rest {
                uri,
                token_env,
                credential_env,
                oauth2_server_uri,
                properties,
                ..
            } => {
                for secret in ["token", "credential"] {
                    if properties.contains_key(secret) {
                        return Err(SpecError::invalid(
                            format!("output.catalog.properties.{secret}"),
                            format!(
                                "a secret never goes in a spec: name the coordinator's environment variable that holds it with {secret}_env"
                            ),
                        ));
                    }
                }
                let http = |field: &str, value: &str| {
                    if value.starts_with("http://") || value.starts_with("https://") {
                        Ok(())
                    } else {
                        Err(SpecError::invalid(
                            field,
                            format!("must be an http:// or https:// URI, not \"{value}\""),
                        ))
                    }
                };
                http("output.catalog.uri", uri)?;
                if let Some(o) = oauth2_server_uri {
                    http("output.catalog.oauth2_server_uri", o)?;
                }
                if token_env.is_some() && credential_env.is_some() {
                    return Err(SpecError::invalid(
                        "output.catalog",
                        "token_env and credential_env are two ways to sign in: give one",
                    ));
                }
                for (field, name) in [
                    ("output.catalog.token_env", token_env),
                    ("output.catalog.credential_env", credential_env),
                ] {
                    if let Some(name) = name
                        && !is_env_name(name)
                    {
                        return Err(SpecError::invalid(
                            field,
                            format!(
                                "names an environment variable (letters, digits, '_'), not \"{name}\": the secret itself never goes in a spec"
                            ),
                        ));
                    }
                }
                Ok(())
            }
        }
    }
}

fn is_env_name(name: &str) -> bool {
    !name.is_empty()
        && !name.starts_with(|c: char| c.is_ascii_digit())
        && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// An Iceberg table name, `namespace.table`: its namespace's levels and
/// its own name.
pub fn split_table_name(table: &str) -> Result<(Vec<String>, String), SpecError> {
    let parts: Vec<&str> = table.split('.').collect();
    let bad = |why: &str| {
        SpecError::invalid(
            "output.table",
            format!("\"{table}\" {why}: write it as namespace.table (\"analytics.predictions\")"),
        )
    };
    if parts.len() < 2 {
        return Err(bad("has no namespace"));
    }
    if parts.iter().any(|p| p.trim().is_empty()) {
        return Err(bad("has an empty part"));
    }
    if parts.iter().any(|p| p.contains('/') || p.contains('\\')) {
        return Err(bad("has a '/' in a name"));
    }
    let (name, namespace) = parts.split_last().ok_or_else(|| bad("is empty"))?;
    Ok((
        namespace.iter().map(|s| s.to_string()).collect(),
        name.to_string(),
    ))
}

impl JobSpec {
    /// `[output]`: its URI, a commit mode only for a table, and an
    /// Iceberg table's name and catalog.
    pub(super) fn validate_output(&self) -> Result<(), SpecError> {
        let output = &self.output;
        if let Some(uri) = &output.uri {
            StoreUri::parse(uri).map_err(|e| SpecError::invalid("output.uri", e.to_string()))?;
        }
        let format = output.format.as_str();
        if output.commit.is_some() && !output.format.is_table() {
            return Err(SpecError::invalid(
                "output.commit",
                format!("only for format \"delta\" or \"iceberg\", not \"{format}\""),
            ));
        }
        if output.format != OutputFormat::Iceberg {
            for (field, given) in [
                ("output.table", output.table.is_some()),
                ("output.catalog", output.catalog.is_some()),
            ] {
                if given {
                    return Err(SpecError::invalid(
                        field,
                        format!("only for format \"iceberg\", not \"{format}\""),
                    ));
                }
            }
            return Ok(());
        }
        let table = output.table.as_deref().ok_or_else(|| {
            SpecError::invalid(
                "output.table",
                "format \"iceberg\" needs the table, namespace.table (\"analytics.predictions\")",
            )
        })?;
        split_table_name(table)?;
        let catalog = output.catalog.as_ref().ok_or_else(|| {
            SpecError::invalid(
                "output.catalog",
                "format \"iceberg\" needs the catalog: { type = \"sql\", uri = \"sqlite:///path/catalog.db\", warehouse = \"s3://bucket/warehouse\" } or { type = \"rest\", uri = \"https://...\" }",
            )
        })?;
        if let Some(uri) = &output.uri {
            readable_by_engines(
                &StoreUri::parse(uri)
                    .map_err(|e| SpecError::invalid("output.uri", e.to_string()))?,
                "output.uri",
            )?;
        }
        catalog.validate()
    }
}

/// An Iceberg table's files are located by URIs other engines resolve:
/// on Azure, ABFS (`abfss://container@account.dfs.core.windows.net/`),
/// not stoke's `az://container/`, which Iceberg's readers do not know.
fn readable_by_engines(uri: &StoreUri, key: &str) -> Result<(), SpecError> {
    if uri.scheme() != "az" {
        return Ok(());
    }
    Err(SpecError::invalid(
        key,
        format!(
            "{uri} is stoke's own spelling, which Iceberg readers (Spark, Trino, pyiceberg) do not resolve; write it as abfss://{}@ACCOUNT.dfs.core.windows.net{}",
            uri.authority(),
            uri.url_path()
        ),
    ))
}
