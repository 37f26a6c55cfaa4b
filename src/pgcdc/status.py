"""What `pgcdc status` and `pgcdc slot list` report: slots on the server, positions of the mirrors."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import psycopg

from pgcdc.replication.options import CLIENT_ENCODING

_SLOTS_SQL = """
SELECT s.slot_name, s.plugin, s.database, s.active, s.confirmed_flush_lsn::text,
       pg_wal_lsn_diff(pg_current_wal_lsn(), s.confirmed_flush_lsn)::bigint,
       pg_wal_lsn_diff(pg_current_wal_lsn(), s.restart_lsn)::bigint,
       s.wal_status, s.two_phase,
       EXTRACT(EPOCH FROM now() - r.reply_time)::float
FROM pg_replication_slots s
LEFT JOIN pg_stat_replication r ON r.pid = s.active_pid
WHERE s.slot_type = 'logical' AND (%(slot)s::text IS NULL OR s.slot_name = %(slot)s)
ORDER BY s.slot_name
"""

if TYPE_CHECKING:
    from pgcdc.spark.destination import Destination

log = logging.getLogger(__name__)


def slot_status(dsn: str, slot: str | None) -> list[dict[str, Any]]:
    """Logical slots with their confirmed position, lag in bytes (and seconds since the consumer's last
    reply, when one is connected), WAL retained and wal_status."""
    with psycopg.connect(dsn, autocommit=True, application_name="pgcdc status",
                         client_encoding=CLIENT_ENCODING) as conn:
        rows = conn.execute(_SLOTS_SQL, {"slot": slot}).fetchall()
    keys = ("slot", "plugin", "database", "active", "confirmed_flush_lsn", "lag_bytes", "wal_retained_bytes",
            "wal_status", "two_phase", "lag_seconds")
    result = [dict(zip(keys, row, strict=True)) for row in rows]
    for row in result:
        if row["lag_seconds"] is not None:
            row["lag_seconds"] = round(row["lag_seconds"], 1)
    return result


def idle_slot_warnings(slots: list[dict[str, Any]]) -> list[dict[str, str]]:
    """Inactive slots from :func:`slot_status`: each holds the server's WAL from its position on, growing until
    a consumer reads it or it is dropped (a leftover of a failed first run, or a consumer gone for good)."""
    warnings = []
    for row in slots:
        if row["active"] or row["wal_retained_bytes"] is None:
            continue
        warnings.append({
            "slot": row["slot"],
            "warning": f"slot {row['slot']} is inactive and retains {_size(row['wal_retained_bytes'])} of WAL, "
                       "growing until it is read or dropped",
            "fix": f"resume its consumer (pgcdc run --slot {row['slot']} ...), or if nothing reads it any more: "
                   f"pgcdc slot drop {row['slot']} --dsn ...",
        })
    return warnings


def gone_source_warnings(dsn: str, slots: list[dict[str, Any]], mirrors: list[dict[str, Any]]) -> list[dict[str, str]]:
    """Mirrors (from :func:`mirror_status`) streamed from a slot of the database ``dsn`` connects to whose table
    that database no longer has: dropped, renamed or moved to another schema. No message in the stream tells
    so, and the mirror stays as it was. Mirrors of other databases' slots are not judged here."""
    with psycopg.connect(dsn, autocommit=True, application_name="pgcdc status",
                         client_encoding=CLIENT_ENCODING) as conn:
        database = conn.execute("SELECT current_database()").fetchone()[0]  # type: ignore[index]
        slots_here = {row["slot"] for row in slots if row["database"] == database}
        sources = sorted({row["source"] for row in mirrors if row["slot"] in slots_here and row["lsn"] is not None})
        if not sources:
            return []
        gone = set(sources) - {name for name, in conn.execute(
            "SELECT n.nspname || '.' || c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE c.relkind IN ('r', 'p') AND n.nspname || '.' || c.relname = ANY(%s)", (sources,))}
    return [{"mirror": row["mirror"],
             "warning": f"the source table {row['source']} of mirror {row['mirror']} no longer exists in database "
                        f"{database} (dropped, renamed or moved to another schema): the mirror keeps the rows it held "
                        f"at {row['lsn']} and is no longer written",
             "fix": "drop the mirror if it is not wanted; a table published under that name again is copied again"}
            for row in mirrors if row["source"] in gone and row["slot"] in slots_here]


def _size(size: int) -> str:
    value = float(max(size, 0))
    for unit in ("bytes", "kB", "MB", "GB"):
        if value < 1024 or unit == "GB":
            return f"{value:.0f} {unit}" if unit == "bytes" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def mirrors_streaming_from(slot: str, destination: Destination) -> list[tuple[str, Any]]:
    """(mirror, position) of each mirror of ``destination`` that streams from ``slot`` (its ``pgcdc.slot``): read
    from the mirrors' metadata by this process where it can (as ``pgcdc run`` starts), else through Spark."""
    from pgcdc.errors import MetadataUnreadable
    from pgcdc.mirrors.catalog import MirrorCatalog
    from pgcdc.mirrors.metadata import MirrorMetadata
    from pgcdc.mirrors.status import mirrors_streaming_from as streaming_from
    from pgcdc.spark.session import spark_session

    try:
        return streaming_from(MirrorMetadata.of(destination), slot)
    except MetadataUnreadable as exc:
        log.info("reading the mirrors through Spark: %s", exc)
    spark = spark_session(destination, short_lived=True)
    return streaming_from(MirrorCatalog(spark, destination), slot)


def mirror_status(destination: Destination) -> list[dict[str, Any]]:
    """Each mirror of ``destination``: its source table, ``pgcdc.lsn`` and row count. Read by this process from the
    mirrors' metadata, manifests and position delete files (:mod:`pgcdc.iceberg.table_files`), else — a mirror with
    equality deletes, a catalog or storage this process does not read — through Spark, which reads the rows."""
    from pgcdc.errors import MetadataUnreadable
    from pgcdc.mirrors.catalog import MirrorCatalog
    from pgcdc.mirrors.metadata import MirrorMetadata
    from pgcdc.mirrors.status import describe_mirrors, describe_mirrors_from_metadata
    from pgcdc.spark.session import spark_session

    try:
        described = describe_mirrors_from_metadata(MirrorMetadata.of(destination))
        if described is not None:
            return described
        log.info("counting the mirrors' rows through Spark: a mirror's current snapshot has equality deletes or "
                 "deletion vectors, which only a reader of its rows applies")
    except MetadataUnreadable as exc:
        log.info("reading the mirrors through Spark: %s", exc)
    spark = spark_session(destination, short_lived=True)
    return describe_mirrors(MirrorCatalog(spark, destination))
