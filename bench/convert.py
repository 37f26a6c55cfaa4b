"""Value conversion throughput: pgcdc's columnar path beside a per-value loop over psycopg 3's loaders.

100,000 rows of a 10-column mixed-type table (int8, numeric(12,2), text, timestamptz, bool, float8, uuid,
jsonb, date, int4[]), captured from a real PostgreSQL 18 in text and in binary mode. pgcdc converts the
batch to one Arrow RecordBatch; the peer loads every value with psycopg's loader for its type and
format, as a row-at-a-time CDC consumer would. Last line: one JSON object of the figures.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import psycopg
from psycopg.adapt import Transformer
from psycopg.pq import Format

from pgcdc.embedded import EmbeddedPostgres
from pgcdc.pgoutput import Insert, Relation, decode
from pgcdc.types import SESSION_SETTINGS, TableConverter, TypeRegistry

TABLE = """
CREATE TABLE mixed (id int8 PRIMARY KEY, amount numeric(12, 2), name text, at timestamptz, flag bool,
                    ratio float8, ref uuid, doc jsonb, day date, tags int4[]);
CREATE PUBLICATION mixed_pub FOR TABLE mixed;
"""
FILL = """
INSERT INTO mixed SELECT i, i * 1.25, 'customer name ' || i, timestamptz '2024-01-01 00:00+00' + i * interval '1 s',
       i %% 2 = 0, i / 7.0, md5(i::text)::uuid, jsonb_build_object('i', i, 'tags', jsonb_build_array('a', 'b')),
       date '2024-01-01' + (i %% 365)::int, ARRAY[i %% 10, i %% 100, NULL]
FROM generate_series(1, %s) i
"""


def capture(rows: int) -> dict[str, tuple[Relation, list]]:
    captured = {}
    with EmbeddedPostgres() as server, psycopg.connect(server.dsn, autocommit=True) as conn:
        for key, value in SESSION_SETTINGS.items():
            conn.execute("SELECT set_config(%s, %s, false)", (key, value))
        conn.execute(TABLE)
        conn.execute("SELECT pg_create_logical_replication_slot('bench', 'pgoutput')")
        conn.execute(FILL, (rows,))
        for mode in ("false", "true"):
            relation, tuples = None, []
            data = conn.execute("SELECT data FROM pg_logical_slot_peek_binary_changes('bench', NULL, NULL, "
                                "'proto_version', '1', 'publication_names', 'mixed_pub', 'binary', %s)",
                                (mode,)).fetchall()
            for (payload,) in data:
                message = decode(payload, proto_version=1, in_stream=False)
                if isinstance(message, Relation):
                    relation = message
                elif isinstance(message, Insert):
                    tuples.append(message.new)
            captured["binary" if mode == "true" else "text"] = (relation, tuples)
    return captured


def per_value(relation: Relation, tuples: list, binary: bool) -> float:
    transformer = Transformer()
    fmt = Format.BINARY if binary else Format.TEXT
    loaders = [transformer.get_loader(c.type_oid, fmt).load for c in relation.columns]
    started = time.perf_counter()
    for row in tuples:
        [None if value is None else load(value) for load, value in zip(loaders, row.values, strict=True)]
    return time.perf_counter() - started


def columnar(relation: Relation, tuples: list) -> float:
    converter = TableConverter(relation, TypeRegistry())
    started = time.perf_counter()
    converter.convert(tuples)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="20,000 rows instead of 100,000")
    args = parser.parse_args()
    rows = 20_000 if args.quick else 100_000
    captured = capture(rows)
    figures: dict[str, float] = {"rows": rows}
    print(f"converting {rows:,} rows of 10 mixed-type columns, best of 3")
    print(f"{'format':<8} {'pgcdc rows/s':>14} {'per-value rows/s':>18} {'ratio':>7}")
    for mode, (relation, tuples) in captured.items():
        binary = mode == "binary"
        ours = min(columnar(relation, tuples) for _ in range(3))
        theirs = min(per_value(relation, tuples, binary) for _ in range(3))
        figures[f"{mode}_rows_per_s"] = round(rows / ours)
        figures[f"per_value_{mode}_rows_per_s"] = round(rows / theirs)
        figures[f"ratio_vs_per_value_{mode}"] = round(theirs / ours, 2)
        print(f"{mode:<8} {rows / ours:>14,.0f} {rows / theirs:>18,.0f} {theirs / ours:>6.1f}x")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
