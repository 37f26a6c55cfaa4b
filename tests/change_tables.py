"""Change tables (:mod:`pgcdc.change_table`) written by hand, for the tests of what reads them."""

from __future__ import annotations

import pyarrow as pa

from pgcdc.change_table import ChangeColumns as C
from pgcdc.change_table import change_schema

ARROW = pa.schema([("id", pa.int64()), ("name", pa.string()), ("big", pa.string()), ("tags", pa.list_(pa.string()))])


def changes(*events: tuple) -> pa.Table:
    """events: (op, lsn, ordinal, row dict or None, options dict) -> a change table keyed on id."""
    rows = []
    for op, lsn, ordinal, row, *rest in events:
        options = rest[0] if rest else {}
        rows.append({**{f.name: (row or {}).get(f.name) for f in ARROW}, C.OP: op, C.LSN: lsn, C.ORDINAL: ordinal,
                     C.UNCHANGED: options.get("unchanged", []), C.OLD_KEY: options.get("old_key"),
                     C.XID: 700 + lsn, C.COMMIT_TS: None, C.ORIGIN: options.get("origin"),
                     C.BEFORE: options.get("before")})
    return pa.Table.from_pylist(rows, schema=change_schema(ARROW, ("id",)))
