"""Slot safety: a slot that lost its WAL or disappeared is reported with the way out and never silently
recreated (a new slot starts at today's WAL: the changes in between would be skipped without a word).

(An idle publication on a busy server keeps its slot advancing: see
tests/integration/test_pipeline.py::test_quiet_slot_keeps_advancing_and_tables_added_later_are_copied_while_streaming.)
"""

from __future__ import annotations

import dataclasses
import os
import random

import psycopg
import pytest

from pgcdc.embedded import EmbeddedPostgres
from pgcdc.errors import ConfigError
from pgcdc.pipeline import Pipeline, PipelineConfig
from pgcdc.replication.slots import SlotManager
from pgcdc.spark.destination import Destination
from pipeline_support import assert_mirrors_equal

pytestmark = pytest.mark.slow


def _config(dsn: str, spark, **overrides) -> PipelineConfig:
    return PipelineConfig(dsn=dsn, publication="pub", slot="safe", batch_max_seconds=0.5,
                          destination=Destination(warehouse=spark.conf.get("spark.sql.catalog.pgcdc.warehouse"),
                                                  namespace=f"safe_{os.getpid()}_{random.randrange(10**9)}"),
                          **overrides)


def _source(conn: psycopg.Connection) -> None:
    conn.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
    conn.execute("INSERT INTO t SELECT i, 'v' || i FROM generate_series(1, 100) i")
    conn.execute("CREATE PUBLICATION pub FOR TABLE t")


def _changes(conn: psycopg.Connection) -> None:
    conn.execute("UPDATE t SET v = 'changed' WHERE id <= 10")
    conn.execute("DELETE FROM t WHERE id > 90")
    conn.execute("INSERT INTO t VALUES (1000, 'new')")


def test_an_invalidated_slot_is_reported_with_the_way_out(spark):
    with EmbeddedPostgres(settings={"max_slot_wal_keep_size": "1MB"}) as server, \
            psycopg.connect(server.dsn, autocommit=True) as conn:
        _source(conn)
        config = _config(server.dsn, spark)
        Pipeline(config, spark=spark).run(until_caught_up=True, handle_signals=False)

        # pgcdc is down while the server writes more WAL than the slot may keep: the slot is invalidated
        _changes(conn)
        conn.execute("CREATE TABLE filler (v text)")
        for _ in range(4):
            conn.execute("INSERT INTO filler SELECT repeat('x', 1000) FROM generate_series(1, 3000)")
            conn.execute("SELECT pg_switch_wal()")
            conn.execute("CHECKPOINT")
        status = conn.execute("SELECT wal_status FROM pg_replication_slots WHERE slot_name = 'safe'").fetchone()
        assert status == ("lost",)

        with pytest.raises(ConfigError, match=r"invalidated.*--resnapshot"):
            Pipeline(config, spark=spark).run(until_caught_up=True, handle_signals=False)

        # the way out: copy everything again at a new slot's consistent point
        again = dataclasses.replace(config, resnapshot=True)
        Pipeline(again, spark=spark).run(until_caught_up=True, handle_signals=False)
        assert_mirrors_equal(config, spark, server.dsn, {"public.t"})


def test_a_lost_slot_is_never_silently_recreated(pg, spark):
    with pg.connect() as conn:
        _source(conn)
    config = _config(pg.dsn, spark)
    Pipeline(config, spark=spark).run(until_caught_up=True, handle_signals=False)

    # the slot disappears (dropped, or a failover to a server it was not synchronized to) and changes go on; the
    # run's walsender releases the slot a moment after the run ends
    SlotManager(pg.dsn).drop("safe", wait_seconds=30)
    with pg.connect() as conn:
        _changes(conn)
    with pytest.raises(ConfigError, match=r"does not exist, but 1 mirrors .* hold positions.*--resnapshot"):
        Pipeline(config, spark=spark).run(until_caught_up=True, handle_signals=False)
    assert pg.execute("SELECT count(*) FROM pg_replication_slots WHERE slot_name = 'safe'") == [(0,)]

    Pipeline(dataclasses.replace(config, resnapshot=True), spark=spark).run(until_caught_up=True,
                                                                             handle_signals=False)
    assert_mirrors_equal(config, spark, pg.dsn, {"public.t"})
