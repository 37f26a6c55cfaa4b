"""A long day of small batches into one mirror, maintained as the pipeline maintains it.

Streams many small batches (inserts, updates, deletes; 10,000 batches, or 60 with --quick) into one keyed
mirror through pgcdc's own apply (the apply thread's commit, with its position recording and conflict
retries) and its maintenance schedule (one turn between two batches when a table is due), with generated
change tables instead of a replication slot: what is measured is the table, not the source.

The batches come as fast as they are applied (~0.2 s each here), not every 5 seconds as a busy stream's do
(``--batch-seconds``): the schedule runs on a batch clock instead (each batch is ``--batch-seconds`` later)
with pgcdc's default thresholds and interval, so that 10,000 batches are the ~14 hours they stand for.
Snapshot expiry compares the snapshots' real commit times: its age is scaled to the run (a minute).

At intervals while streaming, and at the end once the stream has gone quiet for a few intervals of the
schedule, it reports what the mirror has become: snapshots retained, data files, delete files, metadata
bytes, and the time of a full-table ``SELECT count(*)`` and of a key lookup — beside the same figures for
the same rows freshly written in one commit. Goal: at the end, read time at most 1.5x the fresh table's;
counts bounded by the retention settings (not growing with the batches). While batches stream in, a mirror
holds up to an interval's worth of their small files (``streaming`` in the figures: the read-time ratios
seen at the reports; a lower ``--maintenance-interval`` keeps fewer).
Last line: one JSON object of the figures.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import unquote, urlparse

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import pyarrow as pa

from pgcdc.change_table import C, change_schema
from pgcdc.lsn import Lsn
from pgcdc.mirrors.catalog import TableSpec
from pgcdc.mirrors.maintenance import MaintenancePolicy, table_health
from pgcdc.pipeline import PipelineConfig, Progress
from pgcdc.pipeline.applier import Applier
from pgcdc.pipeline.tables import SourceTables
from pgcdc.spark.destination import Destination
from pgcdc.spark.iceberg_java import load_table
from pgcdc.spark.schema import spark_schema
from pgcdc.spark.session import spark_session

SOURCE = pa.schema([pa.field("id", pa.int64()), pa.field("n", pa.int64()), pa.field("note", pa.string())])


def batch(rng: random.Random, lsn: int, next_id: int, live: list[int], changes: int) -> tuple[pa.Table, int]:
    """One batch of one transaction: about half updates, a third inserts, the rest deletes."""
    ids, ns, notes, ops = [], [], [], []
    for _ in range(changes):
        roll = rng.random()
        if roll < 0.35 or len(live) < 100:
            ids.append(next_id)
            live.append(next_id)
            next_id += 1
            ops.append("I")
        elif roll < 0.85:
            ids.append(rng.choice(live))
            ops.append("U")
        else:
            index = rng.randrange(len(live))
            live[index], live[-1] = live[-1], live[index]
            ids.append(live.pop())
            ops.append("D")
        ns.append(rng.randrange(10**6))
        notes.append(f"note {rng.randrange(10**9)}")
    count = len(ids)
    schema = change_schema(SOURCE, ["id"])
    table = pa.table({
        "id": ids, "n": ns, "note": notes, C.OP: ops, C.LSN: [lsn] * count, C.ORDINAL: list(range(count)),
        C.UNCHANGED: [[] for _ in range(count)], C.OLD_KEY: pa.nulls(count, schema.field(C.OLD_KEY).type),
        C.XID: [lsn] * count, C.COMMIT_TS: pa.nulls(count, pa.timestamp("us", tz="UTC")),
        C.ORIGIN: pa.nulls(count, pa.string()), C.BEFORE: pa.nulls(count, schema.field(C.BEFORE).type),
    }, schema=schema)
    return table, next_id


def metadata_bytes(spark, identifier: str) -> int:
    location = urlparse(str(load_table(spark, identifier).location()))
    metadata = Path(unquote(location.path)) / "metadata"
    return sum(f.stat().st_size for f in metadata.iterdir() if f.is_file())


def read_times(spark, identifier: str, key: int, repeats: int = 3) -> tuple[float, float]:
    """Best of ``repeats``: a full-table count, a key lookup (Spark)."""
    spark.catalog.clearCache()
    counts, lookups = [], []
    for _ in range(repeats):
        started = time.perf_counter()
        spark.sql(f"SELECT count(*) FROM {identifier}").collect()
        counts.append(time.perf_counter() - started)
        started = time.perf_counter()
        spark.sql(f"SELECT * FROM {identifier} WHERE id = {key}").collect()
        lookups.append(time.perf_counter() - started)
    return min(counts), min(lookups)


def pyiceberg_read_times(spark, identifier: str, key: int, repeats: int = 3) -> tuple[float, float] | None:
    """Best of ``repeats``, PyIceberg reading the table's newest metadata file: all rows, a key lookup; None when
    it cannot read the table (equality deletes)."""
    from pyiceberg.expressions import EqualTo
    from pyiceberg.table import StaticTable

    location = Path(unquote(urlparse(str(load_table(spark, identifier).location())).path)) / "metadata"
    version = int((location / "version-hint.text").read_text().strip())
    while (location / f"v{version + 1}.metadata.json").exists():
        version += 1
    counts, lookups = [], []
    try:
        for _ in range(repeats):
            table = StaticTable.from_metadata(str(location / f"v{version}.metadata.json"))
            started = time.perf_counter()
            table.scan().to_arrow()
            counts.append(time.perf_counter() - started)
            started = time.perf_counter()
            table.scan(row_filter=EqualTo("id", key)).to_arrow()
            lookups.append(time.perf_counter() - started)
    except ValueError:  # "PyIceberg does not yet support equality deletes"
        return None
    return min(counts), min(lookups)


def measure(spark, mirror: str, fresh: str, key: int) -> dict:
    spark.sql(f"DROP TABLE IF EXISTS {fresh}")
    spark.table(mirror).writeTo(fresh).using("iceberg").tableProperty("format-version", "2").create()
    figures = {}
    for name, identifier in (("mirror", mirror), ("fresh", fresh)):
        health = table_health(spark, identifier)
        count_s, lookup_s = read_times(spark, identifier, key)
        pyiceberg = pyiceberg_read_times(spark, identifier, key)
        figures[name] = {"snapshots": health.snapshots, "data_files": health.data_files,
                         "delete_files": health.delete_files, "metadata_mb": metadata_bytes(spark, identifier) / 1e6,
                         "count_s": count_s, "lookup_s": lookup_s,
                         "pyiceberg_s": None if pyiceberg is None else sum(pyiceberg)}
    return figures


def print_report(label: str, figures: dict) -> None:
    m, f = figures["mirror"], figures["fresh"]
    pyiceberg = "cannot read" if m["pyiceberg_s"] is None else f"{m['pyiceberg_s']:>8.3f}"
    print(f"{label:>8} {m['snapshots']:>9} {m['data_files']:>6} {m['delete_files']:>7} {m['metadata_mb']:>8.2f} "
          f"{m['count_s']:>8.3f} {m['lookup_s']:>8.3f} {pyiceberg:>11} | fresh: {f['count_s']:>8.3f} "
          f"{f['lookup_s']:>8.3f} {f['pyiceberg_s']:>8.3f}", flush=True)


def read_ratio(figures: dict) -> float:
    """Spark's read time of the mirror (a count and a key lookup) over the freshly written table's."""
    mirror, fresh = figures["mirror"], figures["fresh"]
    return (mirror["count_s"] + mirror["lookup_s"]) / (fresh["count_s"] + fresh["lookup_s"])


def pyiceberg_ratio(figures: dict) -> float | None:
    """PyIceberg's read time of the mirror (all rows and a key lookup) over the freshly written table's; None when
    it cannot read the mirror."""
    mirror, fresh = figures["mirror"], figures["fresh"]
    return None if mirror["pyiceberg_s"] is None else mirror["pyiceberg_s"] / fresh["pyiceberg_s"]


def stream(spark, warehouse: Path, args: argparse.Namespace, deletes: str) -> dict:
    """The whole run for one way of deleting; returns its figures."""
    batches = args.batches or (60 if args.quick else 10_000)
    reports = 3 if args.quick else 20
    # pgcdc's defaults on the batch clock; retention by age in real time, scaled to the run: a day keeps an
    # hour of snapshots, this run its last few seconds (--quick) or its last minute
    policy = MaintenancePolicy(interval_seconds=args.maintenance_interval,
                               snapshot_max_age_seconds=5.0 if args.quick else 60.0, check_seconds=0.0)
    config = PipelineConfig(dsn="dbname=longrun", publication="longrun", maintenance=policy, deletes=deletes,
                            destination=Destination(warehouse=str(warehouse), namespace=f"longrun_{deletes}"))
    tables = SourceTables(config, lambda: spark)
    mirror = tables.mirrors.ensure(TableSpec("bench", "events", spark_schema(SOURCE), ("id",)))
    fresh = tables.mirrors.identifier_for("bench", "events_fresh")
    applier = Applier(tables, lambda: spark, Progress(), lambda: None, changelog=False, deletes=deletes,
                      maintenance=policy)
    clock = [0.0]  # the schedule's time: each batch is --batch-seconds later
    applier.maintainer.clock = lambda: clock[0]
    rng = random.Random(16)
    live: list[int] = []
    next_id, lsn = 1, 0x1000000
    started = time.monotonic()
    apply_s = maintain_s = 0.0
    turns = 0
    rows = []
    print(f"deletes by {deletes}:")
    print(f"{'batches':>8} {'snapshots':>9} {'data':>6} {'deletes':>7} {'meta MB':>8} {'count s':>8} "
          f"{'lookup s':>8} {'pyiceberg s':>11} | fresh: {'count s':>8} {'lookup s':>8} {'pyiceberg s':>8}")
    with applier:
        for number in range(1, batches + 1):
            clock[0] += args.batch_seconds
            lsn += 1000
            changes, next_id = batch(rng, lsn, next_id, live, args.changes)
            t0 = time.perf_counter()
            applier.target.apply(mirror, changes, Lsn(lsn))  # the apply thread's own call
            t1 = time.perf_counter()
            apply_s += t1 - t0
            if applier.maintainer.ready() and applier.maintainer.turn() is not None:
                turns += 1
            maintain_s += time.perf_counter() - t1
            if number % max(1, batches // reports) == 0 or number == batches:
                figures = measure(spark, mirror.identifier, fresh, rng.choice(live))
                rows.append((number, figures))
                print_report(str(number), figures)
        # then the stream goes quiet: the schedule's clock runs on, an interval at a time
        for _ in range(3):
            clock[0] += policy.interval_seconds
            if applier.maintainer.turn() is not None:
                turns += 1
    ratios = sorted(read_ratio(r[1]) for r in rows)
    pyiceberg = sorted(ratio for r in rows if (ratio := pyiceberg_ratio(r[1])) is not None)
    streaming = rows[-1][1]
    rest = measure(spark, mirror.identifier, fresh, rng.choice(live))
    m, f = rest["mirror"], rest["fresh"]
    print_report("at rest", rest)
    position = tables.mirrors.positions.read(mirror.identifier)
    assert position == Lsn(lsn), f"the mirror holds {position}, not the last batch's {Lsn(lsn)}"
    return {
        "batches": batches, "changes_per_batch": args.changes, "rows": len(live),
        "seconds": round(time.monotonic() - started, 1), "apply_s_per_batch": round(apply_s / batches, 4),
        "maintenance_turns": turns, "maintenance_s_total": round(maintain_s, 1),
        "snapshots": m["snapshots"], "data_files": m["data_files"], "delete_files": m["delete_files"],
        "metadata_mb": round(m["metadata_mb"], 3),
        "count_s": round(m["count_s"], 4), "lookup_s": round(m["lookup_s"], 4),
        "fresh_count_s": round(f["count_s"], 4), "fresh_lookup_s": round(f["lookup_s"], 4),
        "fresh_metadata_mb": round(f["metadata_mb"], 3),
        "read_time_ratio_vs_fresh": round(read_ratio(rest), 3),
        "pyiceberg_read_time_ratio_vs_fresh": None if pyiceberg_ratio(rest) is None else round(pyiceberg_ratio(rest), 3),
        "streaming": {"read_time_ratio_last": round(read_ratio(streaming), 3),
                      "read_time_ratio_median": round(ratios[len(ratios) // 2], 3),
                      "read_time_ratio_max": round(ratios[-1], 3),
                      "pyiceberg_read_time_ratio_median": round(pyiceberg[len(pyiceberg) // 2], 3) if pyiceberg else None,
                      "pyiceberg_read_time_ratio_max": round(pyiceberg[-1], 3) if pyiceberg else None,
                      "pyiceberg_reads": f"{len(pyiceberg)} of {len(rows)}",
                      "data_files_last": streaming["mirror"]["data_files"],
                      "delete_files_last": streaming["mirror"]["delete_files"]},
        "simulated_hours": round(batches * args.batch_seconds / 3600, 1),
        "max_snapshots_seen": max(r[1]["mirror"]["snapshots"] for r in rows),
        "max_data_files_seen": max(r[1]["mirror"]["data_files"] for r in rows),
        "max_delete_files_seen": max(r[1]["mirror"]["delete_files"] for r in rows),
        "retention": {"snapshots_kept": policy.snapshots_kept, "snapshot_max_age_s": policy.snapshot_max_age_seconds,
                      "compact_at_data_files": policy.data_files, "compact_at_delete_files": policy.delete_files,
                      "interval_s": policy.interval_seconds},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="60 batches (under 2 minutes on an idle machine)")
    parser.add_argument("--batches", type=int, help="batches to stream (default 10,000; 60 with --quick)")
    parser.add_argument("--changes", type=int, default=50, help="changes per batch")
    parser.add_argument("--batch-seconds", type=float, default=5.0,
                        help="the time a batch stands for on the maintenance schedule's clock (pgcdc's default)")
    parser.add_argument("--maintenance-interval", type=float, default=MaintenancePolicy().interval_seconds,
                        help="seconds (of the batch clock) between two maintenances of the mirror at least")
    parser.add_argument("--deletes", choices=("position", "equality", "both"), default="both",
                        help="how the row-delta writer deletes: position (pgcdc's default), equality, or both, "
                             "one after the other, to compare")
    args = parser.parse_args()
    warehouse = Path(tempfile.mkdtemp(prefix="pgcdc-longrun-"))
    spark = spark_session(Destination(warehouse=str(warehouse), conf={"spark.sql.shuffle.partitions": "2"}))
    kinds = ("position", "equality") if args.deletes == "both" else (args.deletes,)
    try:
        results = {kind: stream(spark, warehouse, args, kind) for kind in kinds}
    finally:
        spark.stop()
        shutil.rmtree(warehouse, ignore_errors=True)
    # the default's figures at the top level, as before; each kind's under its name
    print(json.dumps({**results[kinds[0]], "deletes": kinds[0], **{f"deletes_{kind}": results[kind] for kind in kinds}}))


if __name__ == "__main__":
    main()
