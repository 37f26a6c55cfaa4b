"""Databases in any server encoding are mirrored as Unicode, the copy and the stream alike, text and binary
values: every connection pgcdc opens (catalog, copy, walsender, comparison) reads UTF-8 from the server."""

from __future__ import annotations

import contextlib
import os

import psycopg
import pytest
from psycopg import sql

from conftest import TestDatabase, drop_database
from pgcdc.pipeline import Pipeline
from pipeline_support import assert_mirrors_equal, pipeline_config

pytestmark = pytest.mark.slow

# what each encoding can hold: LATIN1 the Western European letters, SQL_ASCII bytes as they are (here ASCII)
VALUES = {"LATIN1": ["café", "Ångström ½ ÿ", "plain"], "SQL_ASCII": ["plain ascii", "tab\there", "x"]}


@contextlib.contextmanager
def database_in(pg_server, encoding: str):
    name = f"pgcdc_enc_{encoding.lower()}_{os.getpid()}"
    with psycopg.connect(pg_server.dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {} ENCODING {} LOCALE 'C' TEMPLATE template0").format(
            sql.Identifier(name), sql.Literal(encoding)))
    try:
        yield TestDatabase(pg_server, name)
    finally:
        drop_database(pg_server, name)


@pytest.mark.parametrize("encoding", ["LATIN1", "SQL_ASCII"])
def test_a_database_in_another_encoding_is_mirrored_as_unicode(pg_server, spark, encoding):
    first, second, third = VALUES[encoding]
    with database_in(pg_server, encoding) as db:
        with psycopg.connect(db.dsn, autocommit=True, client_encoding="UTF8") as conn:
            conn.execute("CREATE TABLE t (id int PRIMARY KEY, s text, c char(12), v varchar(20)[])")
            conn.execute("INSERT INTO t VALUES (1, %s, %s, ARRAY[%s, NULL])", (first, first, second))
            conn.execute("CREATE PUBLICATION pub FOR TABLE t")
        configs = {binary: pipeline_config(db, spark, publication="pub", slot=f"s_{int(binary)}", binary=binary)
                   for binary in (False, True)}
        for config in configs.values():
            Pipeline(config, spark=spark).snapshot()
        with psycopg.connect(db.dsn, autocommit=True, client_encoding="UTF8") as conn:
            conn.execute("INSERT INTO t VALUES (2, %s, %s, ARRAY[%s])", (second, third, first))
            conn.execute("UPDATE t SET s = s || %s WHERE id = 1", (third,))
        expected = [(1, first + third, first.ljust(12), [second, None]), (2, second, third.ljust(12), [first])]
        for binary, config in configs.items():
            pipeline = Pipeline(config, spark=spark)
            pipeline.run(until_caught_up=True, handle_signals=False)
            rows = spark.table(pipeline.mirrors.identifier_for("public", "t")).collect()
            assert sorted((r.id, r.s, r.c, list(r.v)) for r in rows) == expected, f"binary={binary}"
            assert_mirrors_equal(config, spark, db.dsn, {"public.t"})
