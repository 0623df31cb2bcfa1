"""Another writer of an Iceberg table, for tests: appends rows with
pyiceberg through the same SQL catalog stoke commits to, creating the
namespace and the table (with the columns stoke's built-in processor
writes: id, prediction, scores) if they are missing.

Usage: append_iceberg.py CATALOG_URI CATALOG_NAME WAREHOUSE TABLE ID [ID ...]

Each ID becomes one row (prediction -1, no scores) in one append whose
snapshot summary says "writer": "other". Prints the snapshot's id.
"""

import os
import sys

import pyarrow as pa
from pyiceberg.catalog.sql import SqlCatalog
from pyiceberg.schema import Schema
from pyiceberg.types import FloatType, ListType, LongType, NestedField, StringType

from read_iceberg import sqlalchemy_uri, store_properties


def main() -> None:
    uri, name, warehouse, table_name, *ids = sys.argv[1:]
    catalog = SqlCatalog(name, uri=sqlalchemy_uri(uri), warehouse=warehouse, **store_properties())
    namespace = table_name.rsplit(".", 1)[0]
    catalog.create_namespace_if_not_exists(namespace)
    fields = [
        NestedField(1, "id", StringType(), required=False),
        NestedField(2, "prediction", LongType(), required=False),
        NestedField(3, "scores", ListType(4, FloatType(), element_required=False), required=False),
    ]
    # STOKE_TEST_ICEBERG_ORDER=reversed: a table created with the same
    # columns in the other order (so other field ids).
    if os.environ.get("STOKE_TEST_ICEBERG_ORDER") == "reversed":
        fields.reverse()
    schema = Schema(*fields)
    table = catalog.create_table_if_not_exists(table_name, schema=schema)
    rows = [{"id": i, "prediction": -1, "scores": []} for i in ids]
    data = pa.Table.from_pylist(rows, schema=table.schema().as_arrow())
    table.append(data, snapshot_properties={"writer": "other"})
    print(table.current_snapshot().snapshot_id)


if __name__ == "__main__":
    main()
