"""Which ALTER COLUMN ... TYPE changes keep every value: exactly those PostgreSQL makes without rewriting the
table, asked of a real server (a rewrite gives the table a new file number)."""

from __future__ import annotations

import pytest

from pgcdc.types.kinds import type_change_keeps_values

CHANGES = [
    ("varchar(10)", "varchar(20)"), ("varchar(20)", "varchar(10)"), ("varchar(10)", "varchar"),
    ("varchar(10)", "text"), ("text", "varchar"), ("text", "varchar(10)"), ("char(3)", "char(6)"),
    ("char(3)", "text"), ("bit varying(4)", "bit varying(8)"), ("bit varying(8)", "bit varying(4)"),
    ("bit(4)", "bit(8)"), ("numeric(10, 2)", "numeric(12, 2)"), ("numeric(10, 2)", "numeric(12, 3)"),
    ("numeric(10, 2)", "numeric(9, 2)"), ("numeric(10, 2)", "numeric"), ("numeric", "numeric(10, 2)"),
    ("numeric(7, 0)", "numeric(5, -2)"), ("numeric(5, -2)", "numeric(7, -2)"),
    ("timestamp(0)", "timestamp(3)"), ("timestamp(3)", "timestamp(0)"), ("timestamp(3)", "timestamp"),
    ("timestamp", "timestamp(3)"), ("timestamptz(2)", "timestamptz(5)"), ("time(1)", "time"),
    ("time", "time(1)"), ("timetz(1)", "timetz(4)"), ("interval(2)", "interval"), ("interval(2)", "interval(4)"),
    ("int", "bigint"), ("smallint", "int"), ("real", "double precision"), ("int", "text"),
    ("timestamp", "timestamptz"), ("date", "timestamp"),
]

# Made without a rewrite, yet pgcdc copies the table: an interval's typmod mixes its fields with its precision,
# and a timestamp read as timestamptz means another instant unless the server's time zone is UTC.
COPIED_ANYWAY = {("interval(2)", "interval(4)"), ("timestamp", "timestamptz")}


@pytest.mark.parametrize(("old", "new"), CHANGES, ids=[f"{o}->{n}" for o, n in CHANGES])
def test_a_change_keeps_values_where_postgresql_does_not_rewrite_the_table(pg, old, new):
    value = {"int": "1", "bigint": "1", "smallint": "1", "real": "1", "text": "'1'", "date": "'2020-01-01'"}
    first = value.get(old, "NULL")
    with pg.connect() as conn:
        conn.execute(f"CREATE TABLE t (v {old}); INSERT INTO t VALUES ({first})")
        types = "SELECT atttypid::int, atttypmod FROM pg_attribute WHERE attrelid = 't'::regclass AND attname = 'v'"
        before = conn.execute(types).fetchone()
        filenode = conn.execute("SELECT pg_relation_filenode('t')").fetchone()
        conn.execute(f"ALTER TABLE t ALTER COLUMN v TYPE {new}")
        after = conn.execute(types).fetchone()
        rewritten = conn.execute("SELECT pg_relation_filenode('t')").fetchone() != filenode
    keeps = type_change_keeps_values(tuple(before), tuple(after))
    assert keeps == (not rewritten and (old, new) not in COPIED_ANYWAY)
