"""Hostile names: schemas, tables and columns with quotes, spaces, dots, back-quotes, upper case, unicode
and reserved words, a publication name that needs quoting and a slot named like a keyword — all mirrored
correctly. Identifiers are always quoted by the code that writes SQL, never pasted."""

from __future__ import annotations

import os
import random

import pytest

from pgcdc.pipeline import Pipeline, PipelineConfig
from pgcdc.spark.destination import Destination
from pipeline_support import assert_mirrors_equal
from start_support import assert_read_alike

pytestmark = pytest.mark.slow

SCHEMA = 'We"ird Schema.x'
TABLES = {
    "select": ['"a b"', '"q""uote"', '"Ünïcødé"', '"x.y"', '"Order"', '"back`tick"', '"from"'],
    "Mixed Case.Table": ['"Dots.And Spaces"', '"%percent"', '"slash/col"'],
}
PUBLICATION = 'My "Pub", with a comma'


def _ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def test_hostile_identifiers_are_mirrored_correctly(pg, spark):
    with pg.connect() as conn:
        conn.execute(f"CREATE SCHEMA {_ident(SCHEMA)}")
        for table, columns in TABLES.items():
            qualified = f"{_ident(SCHEMA)}.{_ident(table)}"
            conn.execute(f"CREATE TABLE {qualified} (id int PRIMARY KEY, "
                         + ", ".join(f"{c} text" for c in columns) + ")")
            conn.execute(f"INSERT INTO {qualified} SELECT i, " + ", ".join(f"'{i}' || i" for i, _ in
                                                                            enumerate(columns))
                         + " FROM generate_series(1, 50) i")
        conn.execute(f"CREATE TABLE public.{_ident('UPPER')} (id int PRIMARY KEY, {_ident('Value')} int)")
        conn.execute(f"INSERT INTO public.{_ident('UPPER')} VALUES (1, 1)")
        conn.execute(f"CREATE PUBLICATION {_ident(PUBLICATION)} FOR TABLE "
                     + ", ".join(f"{_ident(SCHEMA)}.{_ident(t)}" for t in TABLES) + f", public.{_ident('UPPER')}")

    warehouse = spark.conf.get("spark.sql.catalog.pgcdc.warehouse")
    config = PipelineConfig(dsn=pg.dsn, publication=PUBLICATION, slot="select", batch_max_seconds=0.5,
                            destination=Destination(warehouse=warehouse,
                                                    namespace=f"names {os.getpid()}.{random.randrange(10**6)}"))
    pipeline = Pipeline(config, spark=spark)
    pipeline.check()
    pipeline.run(until_caught_up=True, handle_signals=False)

    with pg.connect() as conn:
        select = f"{_ident(SCHEMA)}.{_ident('select')}"
        conn.execute(f'UPDATE {select} SET "a b" = \'changed\', "x.y" = NULL WHERE id <= 10')
        conn.execute(f"UPDATE {select} SET id = id + 100 WHERE id BETWEEN 11 AND 15")
        conn.execute(f'DELETE FROM {select} WHERE "Order" LIKE \'4%\' AND id % 3 = 0')
        conn.execute(f"TRUNCATE {_ident(SCHEMA)}.{_ident('Mixed Case.Table')}")
        conn.execute(f"INSERT INTO {_ident(SCHEMA)}.{_ident('Mixed Case.Table')} VALUES (7, 'a', 'b', 'c')")
        conn.execute(f"ALTER TABLE public.{_ident('UPPER')} ADD COLUMN {_ident('New Col.umn')} text")
        conn.execute(f"INSERT INTO public.{_ident('UPPER')} VALUES (2, 2, 'added')")
    Pipeline(config, spark=spark).run(until_caught_up=True, handle_signals=False)
    assert_mirrors_equal(config, spark, pg.dsn,
                         {f"{SCHEMA}.select", f"{SCHEMA}.Mixed Case.Table", "public.UPPER"})
    # a start reads these mirrors without a JVM as Spark reads them: the same names, positions, slots and tags
    assert_read_alike(config, spark)
