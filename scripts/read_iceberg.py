"""Reads an Iceberg table the way analysts do: through its catalog with
pyiceberg, which shares no code with stoke's writer (the `iceberg` Rust
crate), and its metadata with DuckDB's iceberg extension.

Usage: read_iceberg.py CATALOG_URI CATALOG_NAME WAREHOUSE TABLE [JOB_ID ...]

CATALOG_URI is a SQL catalog's database (sqlite:///path/catalog.db), the
one stoke's `[output] catalog` names, or a REST catalog's http(s):// URI
(its bearer token in ICEBERG_REST_TOKEN, its prefix in
ICEBERG_REST_PREFIX). Prints one JSON object:
- "rows": every row as [id, prediction] (duplicates included, so the tests
  see them), or [id, null] when the table has no prediction column;
- "snapshots": the current snapshot's ancestry, oldest first, as
  {"id", "parent", "operation", "summary"};
- "jobs": for each JOB_ID, the stoke.seq values of its snapshots;
- "files": the live data files' paths;
- "schema": the table's columns as "name: type";
- "location": the table's location; "properties": its properties;
- "files_without_ids": the data files whose Parquet columns carry no
  Iceberg field ids; "files_with_other_ids": those whose ids are not the
  table's (each field's path and id, read with pyarrow, against
  pyiceberg's index of the table schema);
- "duckdb_rows": the row count DuckDB's iceberg_scan reads from the
  table's current metadata file (null when the table has no snapshot).

For an s3:// or abfss:// table it reads the endpoint and credentials from
the same variables as stoke (STOKE_STORE_ENDPOINT, AWS_ACCESS_KEY_ID,
AZURE_STORAGE_ACCOUNT_NAME, ...).
"""

import json
import os
import sys

from pyiceberg.catalog.sql import SqlCatalog


def store_properties() -> dict:
    """The catalog's FileIO settings from the same variables as stoke's:
    an Azure account (AZURE_STORAGE_ACCOUNT_NAME and _KEY, an emulator's
    STOKE_STORE_ENDPOINT) through fsspec's adlfs, which resolves
    abfss://container@account.dfs.core.windows.net/ locations (pyiceberg
    0.12's pyarrow FileIO puts the account into the path); else S3's."""
    env = os.environ
    if env.get("AZURE_STORAGE_ACCOUNT_NAME"):
        account = env["AZURE_STORAGE_ACCOUNT_NAME"]
        endpoint = env.get("STOKE_STORE_ENDPOINT", "")
        protocol = "http" if endpoint.startswith("http://") else "https"
        parts = [f"DefaultEndpointsProtocol={protocol}", f"AccountName={account}"]
        if env.get("AZURE_STORAGE_ACCOUNT_KEY"):
            parts.append(f"AccountKey={env['AZURE_STORAGE_ACCOUNT_KEY']}")
        if endpoint:
            parts.append(f"BlobEndpoint={endpoint}")
        return {
            "py-io-impl": "pyiceberg.io.fsspec.FsspecFileIO",
            "adls.account-name": account,
            "adls.connection-string": ";".join(parts) + ";",
        }
    return s3_properties()


def s3_properties() -> dict:
    env = os.environ
    props = {}
    if env.get("STOKE_STORE_ENDPOINT"):
        props["s3.endpoint"] = env["STOKE_STORE_ENDPOINT"]
    for key, prop in (
        ("AWS_ACCESS_KEY_ID", "s3.access-key-id"),
        ("AWS_SECRET_ACCESS_KEY", "s3.secret-access-key"),
        ("AWS_REGION", "s3.region"),
    ):
        if env.get(key):
            props[prop] = env[key]
    return props


def duckdb_count(metadata_location: str) -> int:
    import duckdb
    import duckdb_extension_avro
    import duckdb_extension_iceberg

    def path(module, name):
        return os.path.join(
            os.path.dirname(module.__file__),
            "extensions",
            "v" + duckdb.__version__,
            name + ".duckdb_extension",
        )

    con = duckdb.connect(config={"autoinstall_known_extensions": "false"})
    con.load_extension(path(duckdb_extension_avro, "avro"))
    con.load_extension(path(duckdb_extension_iceberg, "iceberg"))
    location = metadata_location.removeprefix("file://")
    return con.sql(f"SELECT count(*) FROM iceberg_scan('{location}')").fetchone()[0]


def file_field_ids(schema) -> dict:
    """Each field's id in a Parquet file's Arrow schema, by its path as
    pyiceberg's index_by_name spells it (a list's `element`, a map's
    `key` and `value`)."""
    import pyarrow as pa

    out = {}

    def walk(path, field):
        meta = field.metadata or {}
        if b"PARQUET:field_id" in meta:
            out[path] = int(meta[b"PARQUET:field_id"])
        t = field.type
        if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
            walk(f"{path}.element", t.value_field)
        elif pa.types.is_struct(t):
            for i in range(t.num_fields):
                walk(f"{path}.{t.field(i).name}", t.field(i))
        elif pa.types.is_map(t):
            walk(f"{path}.key", t.key_field)
            walk(f"{path}.value", t.item_field)

    for field in schema:
        walk(field.name, field)
    return out


def check_field_ids(table, files):
    """The files without field ids, and those whose ids differ from the
    table's."""
    import pyarrow.parquet as pq
    from pyiceberg.schema import index_by_name

    want = index_by_name(table.schema())
    without, other = [], []
    for path in files:
        with table.io.new_input(path).open() as f:
            got = file_field_ids(pq.read_schema(f))
        if not got:
            without.append(path)
        elif any(want.get(name) != i for name, i in got.items()):
            other.append({"file": path, "ids": got, "table": want})
    return without, other


def sqlalchemy_uri(uri: str) -> str:
    """stoke's `sqlite:///abs/path` (sqlx's form) as SQLAlchemy spells an
    absolute path, `sqlite:////abs/path`."""
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        return "sqlite:////" + uri[len("sqlite:///"):]
    return uri


def main() -> None:
    uri, name, warehouse, table_name, *jobs = sys.argv[1:]
    if uri.startswith(("http://", "https://")):
        from pyiceberg.catalog.rest import RestCatalog

        props = {"uri": uri, "token": os.environ["ICEBERG_REST_TOKEN"]}
        if os.environ.get("ICEBERG_REST_PREFIX"):
            props["prefix"] = os.environ["ICEBERG_REST_PREFIX"]
        catalog = RestCatalog(name, **props, **store_properties())
    else:
        catalog = SqlCatalog(name, uri=sqlalchemy_uri(uri), warehouse=warehouse, **store_properties())
    table = catalog.load_table(table_name)
    names = [f.name for f in table.schema().fields]
    columns = ["id"] + (["prediction"] if "prediction" in names else [])
    data = table.scan(selected_fields=tuple(columns)).to_arrow()
    ids = data.column("id").to_pylist()
    preds = data.column("prediction").to_pylist() if "prediction" in names else [None] * len(ids)
    snapshots = []
    current = table.current_snapshot()
    by_id = {s.snapshot_id: s for s in table.snapshots()}
    while current is not None:
        snapshots.append(current)
        current = by_id.get(current.parent_snapshot_id)
    snapshots.reverse()
    summaries = [
        {
            "id": s.snapshot_id,
            "parent": s.parent_snapshot_id,
            "operation": s.summary.operation.value if s.summary else None,
            "summary": dict(s.summary.additional_properties) if s.summary else {},
        }
        for s in snapshots
    ]
    job_seqs = {
        job: [
            int(s["summary"]["stoke.seq"])
            for s in summaries
            if s["summary"].get("stoke.job-id") == job
        ]
        for job in jobs
    }
    files = sorted(task.file.file_path for task in table.scan().plan_files())
    without_ids, other_ids = check_field_ids(table, files)
    metadata_location = table.metadata_location
    out = {
        "rows": [[i, p] for i, p in zip(ids, preds)],
        "snapshots": summaries,
        "jobs": job_seqs,
        "files": files,
        "schema": [f"{f.name}: {f.field_type}" for f in table.schema().fields],
        "location": table.location(),
        "properties": dict(table.properties),
        "files_without_ids": without_ids,
        "files_with_other_ids": other_ids,
        "duckdb_rows": duckdb_count(metadata_location)
        if snapshots and metadata_location.startswith("file://")
        else None,
    }
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
