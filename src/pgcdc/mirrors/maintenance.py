"""Table maintenance of the mirrors: compaction, snapshot expiry, orphan files and manifests, positions kept.

Every batch adds a snapshot, a data file and (merge-on-read) a delete file to each mirror it touches; left
alone, a busy mirror gains thousands of each a day and every read pays for all of them. A maintenance of one
table runs, each step only when there is something to do:

1. ``compact-data``: small data files, and every data file that deletes apply to, rewritten into few large
   ones with the deletes applied (Iceberg's ``rewrite_data_files``); the new files keep the sequence number
   of the snapshot the rewrite started from, so deletes committed meanwhile (the row-delta writer's equality
   deletes, by key) still apply to them and the rewrite does not conflict with a stream that goes on;
2. ``compact-deletes``: delete files left without a row to apply to dropped (every equality delete no newer
   than the oldest live data file, every position delete older than it or naming a data file no longer
   live), then the position delete files left rewritten (``rewrite_position_delete_files``);
3. ``rewrite-manifests``: the manifests, many small ones after many commits, rewritten into few;
4. ``expire``: snapshots older than the retention age expired, and a mirror holding ``snapshots`` or more
   brought back to the newest half of that many however young they are (:func:`expiry_cutoff`); the newest
   ``snapshots_kept`` (and any a tag or branch points at) always kept, and the files only they held deleted
   (Iceberg's own expiry, on the driver);
5. ``remove-orphans``: files no snapshot references and older than ``orphan_age_seconds`` deleted — never
   younger than an hour, so files of a commit in flight (pgcdc's own or anyone's) are not taken.

Steps 1-3 are commits that change no row, onto which the mirror's consistent tag follows
(:func:`pgcdc.mirrors.consistent.follow_rewrites`); each carries the table's position (``pgcdc.lsn``, and
``pgcdc.ordinal`` for ``__rejects`` tables) in its snapshot summary, read from the table just before, so the
newest snapshot keeps telling where the table stands; expiry may still remove every snapshot that carries
it when others commit to the table too, which is why pgcdc also keeps it in a table property
(:meth:`pgcdc.mirrors.catalog.MirrorCatalog.recording`). The pipeline runs a maintenance of one table at a time
on a thread beside the applies (:mod:`pgcdc.pipeline.applier`), whose commits and the maintenance's are retried
over each other by Iceberg — except the rewrites (steps 1-3) of a mirror whose batches delete by position (the
row-delta writer's default, and MERGE): those deletes name the files a compaction replaces, so its rewrites run
in a gap between two applies; ``pgcdc maintain`` runs it on demand.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from pgcdc.faults import injection_point
from pgcdc.spark.iceberg_java import (
    iceberg_classes,
    is_commit_conflict,
    java_count,
    light_view,
    live_files,
    load_table,
)

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from pgcdc.mirrors.catalog import MirrorCatalog

log = logging.getLogger("pgcdc.mirrors.maintenance")

MIN_ORPHAN_AGE_SECONDS = 3600.0  # a commit in flight writes its files before it references them
ORPHANS_REMOVED_PROPERTY = "pgcdc.orphans-removed-at"  # epoch seconds of the last orphan-file removal
MAINTENANCE_JOB_GROUP = "pgcdc-maintenance"  # the Spark job group of the pipeline's maintenance: cancelled at a stop
STEPS = ("compact-data", "compact-deletes", "rewrite-manifests", "expire", "remove-orphans")
REWRITES = ("compact-data", "compact-deletes", "rewrite-manifests")  # commits that keep the rows as they are
# a compaction rewrites every data file a delete applies to up to this much data and these many rows (seconds of
# Spark, and of the key index following the rewrite), or once position deletes remove this share of a larger
# table's rows (rewrites_every_deleted_file)
WHOLE_REWRITE_BYTES = 256 << 20
WHOLE_REWRITE_ROWS = 4_000_000
DELETED_SHARE = 0.1
# a larger table's compaction packs the data files below this size only: a full-size file stays as it is (its
# deletes merged), where Iceberg's default (three quarters of the target size) would rewrite a 100,000,000-row
# file of 180 MB, a narrow table's, at every maintenance
PACKED_BELOW_BYTES = 16 << 20
DEFAULT_TARGET_FILE_BYTES = 512 << 20  # Iceberg's write.target-file-size-bytes
# Old metadata.json files are kept by Iceberg unless told otherwise: one per commit, forever.
METADATA_CLEANUP = {"write.metadata.delete-after-commit.enabled": "true",
                    "write.metadata.previous-versions-max": "20"}


@dataclass(frozen=True)
class MaintenancePolicy:
    """When the pipeline maintains a mirror, and what a maintenance keeps.

    >>> MaintenancePolicy(snapshot_max_age_seconds=6 * 3600, snapshots_kept=10)  # doctest: +ELLIPSIS
    MaintenancePolicy(enabled=True, ...)
    """

    enabled: bool = True
    interval_seconds: float = 300.0  # the least time between two maintenances of one table
    data_files: int = 32  # a table is due at this many data files ...
    delete_files: int = 8  # ... or this many delete files ...
    snapshots: int = 100  # ... or this many snapshots (then brought back to half as many: expiry_cutoff)
    snapshot_max_age_seconds: float = 3600.0  # snapshots older than this are expired ...
    snapshots_kept: int = 5  # ... except the newest this many
    orphan_age_seconds: float = 24 * 3600.0  # unreferenced files older than this are deleted ...
    orphan_interval_seconds: float = 24 * 3600.0  # ... this often
    target_file_bytes: int | None = None  # compacted file size (None: the table's write.target-file-size-bytes)
    check_seconds: float = 10.0  # how often the pipeline looks whether a table is due (see check_every)

    @property
    def check_every(self) -> float:
        """Seconds between two looks at whether a table is due: ``check_seconds``, or the interval when that is
        shorter (a table that may be maintained every 2 s is not left waiting 10 s), but at least a second apart
        (a look reads the tables' metadata)."""
        return min(self.check_seconds, max(self.interval_seconds, 1.0))

    def problems(self) -> list[str]:
        """What is wrong with these settings, each with the fix (empty: nothing)."""
        problems = []
        if self.interval_seconds < 0:
            problems.append("maintenance interval must be 0 or more seconds")
        for name in ("data_files", "delete_files", "snapshots"):
            if getattr(self, name) < 1:
                problems.append(f"maintenance threshold {name} must be at least 1")
        if self.snapshots_kept < 1:
            problems.append("snapshots_kept must be at least 1 (the current snapshot is always kept)")
        if self.snapshot_max_age_seconds < 0:
            problems.append("snapshot retention age must be 0 or more seconds")
        if self.orphan_age_seconds < MIN_ORPHAN_AGE_SECONDS:
            problems.append(f"orphan file age {self.orphan_age_seconds:g}s is below {MIN_ORPHAN_AGE_SECONDS:g}s: "
                            "files of a commit still being written would be deleted; use at least an hour")
        if self.target_file_bytes is not None and self.target_file_bytes < 1 << 20:
            problems.append("target file size must be at least 1 MiB")
        return problems


@dataclass(frozen=True)
class TableHealth:
    """What a table's current metadata says about it (read without scanning anything)."""

    snapshots: int
    data_files: int
    delete_files: int
    manifests: int
    orphans_removed_at: float | None
    current_snapshot: int | None = None  # its id: the table changed when it did
    rows: int = 0  # live rows, before deletes
    data_bytes: int = 0  # of its data files
    position_deletes: int = 0  # rows its position-delete files remove
    compacted_data_files: int | None = None  # data files after its newest rewrite kept in its history (None: none)


@dataclass
class MaintenanceResult:
    """What one maintenance of one table did: per step, the files it rewrote, dropped or deleted, and the
    snapshots it expired."""

    identifier: str
    steps: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    before: TableHealth | None = None
    after: TableHealth | None = None


def table_health(spark: SparkSession, identifier: str) -> TableHealth:
    return _health(spark, load_table(spark, identifier))


# the snapshot summary values a table's health reads
HEALTH_SUMMARY = ("total-data-files", "total-delete-files", "total-records", "total-files-size",
                  "total-position-deletes")


def _health(spark: SparkSession, table: Any, *, count_manifests: bool = True) -> TableHealth:
    """``count_manifests``: read the manifest list for :attr:`TableHealth.manifests` (0 without: a look at
    whether a table is due needs none of it)."""
    view = light_view(table, HEALTH_SUMMARY)
    current = view.currentSnapshot()
    removed_at = view.properties().get(ORPHANS_REMOVED_PROPERTY)
    if current is None:
        return TableHealth(0, 0, 0, 0, float(removed_at) if removed_at else None)
    summary = current.summary()
    rewrites = [snapshot for snapshot in view.snapshots() if snapshot.operation() == "replace"]
    newest_rewrite = max(rewrites, key=lambda snapshot: snapshot.timestampMillis(), default=None)
    return TableHealth(
        snapshots=len(view.snapshots()),
        data_files=int(summary.get("total-data-files") or "0"),
        delete_files=int(summary.get("total-delete-files") or "0"),
        # the manifest list is a file of its own: read through the Java table
        manifests=int(table.currentSnapshot().allManifests(table.io()).size()) if count_manifests else 0,
        orphans_removed_at=float(removed_at) if removed_at else None,
        current_snapshot=int(current.snapshotId()),
        rows=int(summary.get("total-records") or "0"),
        data_bytes=int(summary.get("total-files-size") or "0"),
        position_deletes=int(summary.get("total-position-deletes") or "0"),
        compacted_data_files=None if newest_rewrite is None else int(
            newest_rewrite.summary().get("total-data-files") or "0"))


def _looked_health(spark: SparkSession, table: Any) -> TableHealth:
    """``table``'s health as :func:`_health` reads it without the manifest count, in one call into the JVM when
    pgcdc's jar is there (:class:`pgcdc.iceberg.Health`), rather than from the whole metadata as JSON."""
    classes = iceberg_classes()
    if classes.health is None:
        return _health(spark, table, count_manifests=False)
    snapshots, data, deletes, rows, size, current, has_current, removed_at, position_deletes, compacted = (
        int(figure) for figure in str(classes.health.of(table, ORPHANS_REMOVED_PROPERTY)).split(","))
    return TableHealth(snapshots, data, deletes, 0, None if removed_at < 0 else float(removed_at),
                       current if has_current else None, rows, size, position_deletes,
                       None if compacted < 0 else compacted)


def due_steps(health: TableHealth, policy: MaintenancePolicy, now: float, *, settled: bool = False) -> list[str]:
    """The steps a table's health calls for under ``policy`` (empty: the table is fine as it is). ``settled``:
    the table has not changed for an interval; its delete files, however few, are compacted away then, as every
    read of it pays for them (a scan cannot count from metadata, each task reads the deletes) and no batch is
    coming to push it over the thresholds."""
    steps = []
    whole = rewrites_every_deleted_file(health)
    # a large mirror counts the data files its batches added since its last compaction (else, one of 40 GB would be
    # due at every interval whatever changed): those its history shows, or, without a compaction in it, those
    # beyond one per target size; and only a mirror rewritten whole is compacted of the deletes a rest leaves
    added = health.data_files if whole else health.data_files - (
        health.compacted_data_files if health.compacted_data_files is not None else
        health.data_bytes // (policy.target_file_bytes or DEFAULT_TARGET_FILE_BYTES))
    if (added >= policy.data_files or health.delete_files >= policy.delete_files
            or (settled and health.delete_files > 0 and whole)):
        steps += ["compact-data", "compact-deletes", "rewrite-manifests"]
    if health.snapshots >= policy.snapshots or (steps and health.snapshots > policy.snapshots_kept):
        steps.append("expire")
    # a table never cleaned starts its orphan clock when the pipeline first looks at it (Maintainer.turn) or first
    # maintains it (maintain_table): a listing of every file is the costliest step, and files of a crash are rare
    if health.orphans_removed_at is not None and now - health.orphans_removed_at >= policy.orphan_interval_seconds:
        steps.append("remove-orphans")
    return steps


def expiry_cutoff(commit_times_ms: Sequence[int], policy: MaintenancePolicy, now: float) -> int:
    """The commit time (ms) before which a table's snapshots are expired: those older than the retention age and,
    once the table holds ``policy.snapshots`` or more, every one older than the newest half of that many (at least
    ``snapshots_kept``), however young. Without that bound a mirror committing every second would hold thousands
    of snapshots within an hour's retention, and each commit, which rewrites a metadata file listing every
    snapshot kept, would cost more than the one before."""
    cutoff = int((now - policy.snapshot_max_age_seconds) * 1000)
    keep = max(policy.snapshots_kept, policy.snapshots // 2)
    if len(commit_times_ms) >= policy.snapshots and keep < len(commit_times_ms):
        cutoff = max(cutoff, sorted(commit_times_ms, reverse=True)[keep - 1])
    return cutoff


def maintain_table(spark: SparkSession, identifier: str,
                   carried: Mapping[str, str] | Callable[[], Mapping[str, str]], policy: MaintenancePolicy, *,
                   steps: tuple[str, ...] | list[str] = STEPS, orphan_age_seconds: float | None = None,
                   between: Callable[[Callable[[], None]], None] | None = None) -> MaintenanceResult:
    """Run ``steps`` (in their fixed order) on one table; every commit carries ``carried`` (the table's position
    properties, or how to read them when the rewrites start) in its snapshot summary. ``orphan_age_seconds``
    overrides the policy's age (at least an hour for a table anyone may be writing; tests of tables nobody writes
    go lower). ``between``: runs the rewrites
    (:data:`REWRITES`, one call) where no batch applies — the pipeline's apply thread between two batches, when
    its batches delete by position, which name the files a rewrite replaces; the other steps (expiry, orphans)
    stay on the calling thread, beside the batches, whose commits and theirs Iceberg retries over each other."""
    started = time.monotonic()
    classes = iceberg_classes()
    # the actions' worker threads find the catalogs through the active session they inherit from this thread,
    # which has none when Spark did not start it (the pipeline's apply thread)
    classes.set_active_session(spark._jsparkSession)
    actions = classes.spark_actions(spark._jsparkSession)
    table = load_table(spark, identifier)
    wanted = [step for step in STEPS if step in steps]
    rewrites = [step for step in wanted if step in REWRITES]
    in_a_gap = bool(rewrites) and between is not None
    # rewrites in a gap read the table's health there, after the batches before it
    result = MaintenanceResult(identifier, before=None if in_a_gap else _health(spark, table))
    _clean_old_metadata(table)

    def run(steps: list[str]) -> None:
        # only the rewrites' commits carry it (expiry and the orphans' removal make no snapshot)
        summary: Mapping[str, str] = {}
        if any(step in REWRITES for step in steps):
            summary = carried() if callable(carried) else carried
        for step in steps:
            injection_point(f"maintain.{step}")
            log.info("%s: %s starting", identifier, step, extra={"event": "maintenance.step", "table": identifier,
                                                                  "step": step})
            try:
                assert result.before is not None
                result.steps[step] = _run_step(spark, actions, table, step, result.before, summary, policy,
                                               orphan_age_seconds)
            except Exception as exc:
                if not is_commit_conflict(exc):
                    raise
                # a commit of the stream's (or anyone's) landed first: this step changed nothing and is due again at
                # the next maintenance; the steps after it (expiry above all) still run
                log.info("%s: %s lost to a concurrent commit (%s); it runs again at the next maintenance",
                         identifier, step, next((line.strip(": ") for line in str(exc).splitlines()
                                                 if "iceberg.exceptions" in line), _first_line(exc))[:300])
                result.steps[step] = 0
            table.refresh()
            if step in REWRITES and result.steps[step]:
                _follow_rewrites(table, identifier)

    if in_a_gap:
        assert between is not None

        def in_the_gap() -> None:
            classes.set_active_session(spark._jsparkSession)  # (another thread's)
            table.refresh()  # what the batches before the gap committed
            result.before = _health(spark, table)
            run(rewrites)

        between(in_the_gap)
    else:
        run(rewrites)
    run([step for step in wanted if step not in REWRITES])
    injection_point("maintain.done")
    result.after = _health(spark, table)
    result.seconds = time.monotonic() - started
    log.info("maintained %s in %.1fs: %s; now %d snapshots, %d data files, %d delete files", identifier,
             result.seconds, ", ".join(f"{k} {v}" for k, v in result.steps.items()) or "nothing to do",
             result.after.snapshots, result.after.data_files, result.after.delete_files,
             extra={"event": "maintenance", "table": identifier, "steps": result.steps})
    return result


def _run_step(spark: SparkSession, actions: Any, table: Any, step: str, before: TableHealth,
              carried: Mapping[str, str], policy: MaintenancePolicy, orphan_age_seconds: float | None) -> int:
    """One maintenance step on ``table``, its commits carrying ``carried``; returns the files it rewrote, dropped
    or deleted, or the snapshots it expired (0: nothing to do)."""

    def carrying(action: Any) -> Any:
        for key, value in carried.items():
            action = action.snapshotProperty(str(key), str(value))
        return action

    if step == "compact-data" and (before.data_files > 1 or before.delete_files > 0):
        from pgcdc.mirrors.small_compaction import compact_small_table  # Arrow: imported when first needed

        if _small(before) and not policy.target_file_bytes:
            compacted = compact_small_table(spark, table, carried)
            if compacted is not None:
                return compacted
        # the new files keep the starting snapshot's sequence number: every delete file up to it is left without a
        # row to apply to in the files rewritten, and equality deletes committed during the rewrite still apply to
        # them (no conflict with the stream)
        action = (actions.rewriteDataFiles(table).option("min-input-files", "2")
                  .option("partial-progress.enabled", "false")
                  .option("use-starting-sequence-number", "true").option("remove-dangling-deletes", "true"))
        if rewrites_every_deleted_file(before):
            # every data file a delete applies to is rewritten without the deleted rows: reads apply no delete
            action = action.option("delete-file-threshold", "1")
        else:
            # a large mirror's small files are packed, and its deletes stay on its large files (merged by
            # compact-deletes) until they remove a share of its rows: a rewrite of every file each interval would
            # cost the whole mirror however little changed
            target = policy.target_file_bytes or int(table.properties().getOrDefault(
                "write.target-file-size-bytes", str(DEFAULT_TARGET_FILE_BYTES)))
            action = action.option("min-file-size-bytes", str(min(PACKED_BELOW_BYTES, target * 3 // 4)))
        if policy.target_file_bytes:
            action = action.option("target-file-size-bytes", str(policy.target_file_bytes))
        return int(carrying(action).execute().rewrittenDataFilesCount())
    if step == "compact-deletes" and _health(spark, table).delete_files > 0:
        if table.spec().isUnpartitioned() and table.specs().size() == 1:
            # Iceberg's dangling-delete action leaves unpartitioned tables to its commits, which drop only what
            # one commit's own manifests show: equality deletes stay after a compaction
            dropped = _drop_dangling_deletes(spark, table, carried)
        else:
            dropped = java_count(carrying(actions.removeDanglingDeleteFiles(table)).execute().removedDeleteFiles())
        table.refresh()
        # Iceberg 1.10's position-delete reader fails on list and map columns ("Invalid partition field parent"):
        # there the position deletes a compaction did not make dangling stay until the next one
        if _position_delete_files(table) and not _has_lists_or_maps(table):
            outcome = carrying(actions.rewritePositionDeletes(table).option("rewrite-all", "true")).execute()
            dropped += int(outcome.rewrittenDeleteFilesCount())
        return dropped
    if step == "rewrite-manifests" and _health(spark, table).manifests > 1:
        classes = iceberg_classes()
        if _small(before) and classes.manifests is not None:
            summary = classes.HashMap()
            for key, value in carried.items():
                summary.put(str(key), str(value))
            return int(classes.manifests.rewrite(table, summary, classes.in_calling_thread))
        return java_count(carrying(actions.rewriteManifests(table)).execute().rewrittenManifests())
    if step == "expire":
        # Iceberg's own expiry, its files cleaned up on this thread: the same commit as Spark's action makes, whose
        # cleanup plans Spark jobs over every file of the table before and after — about 1 s and 1.4 CPU-s a
        # turn on a warm Spark for a mirror of a few files, 2.4 s on a cold one, against 60 ms here (a mirror under
        # this maintenance has few manifests for the driver to read)
        def snapshots_now() -> list[Any]:
            return list(light_view(table).snapshots())

        snapshots = snapshots_now()
        held = {int(snapshot.snapshotId()) for snapshot in snapshots}
        older_than = expiry_cutoff([int(snapshot.timestampMillis()) for snapshot in snapshots], policy, time.time())
        # the commit leaves the table's metadata its own (the step's refresh follows in maintain_table)
        table.expireSnapshots().expireOlderThan(older_than).retainLast(policy.snapshots_kept).commit()
        return len(held - {int(snapshot.snapshotId()) for snapshot in snapshots_now()})
    if step == "remove-orphans":
        age = policy.orphan_age_seconds if orphan_age_seconds is None else orphan_age_seconds
        outcome = actions.deleteOrphanFiles(table).olderThan(int((time.time() - age) * 1000)).execute()
        table.updateProperties().set(ORPHANS_REMOVED_PROPERTY, str(int(time.time()))).commit()
        return java_count(outcome.orphanFileLocations())
    return 0


def rewrites_every_deleted_file(health: TableHealth) -> bool:
    """Whether a compaction of the table rewrites every data file a delete applies to, leaving reads no delete to
    apply: a table of up to WHOLE_REWRITE_BYTES and WHOLE_REWRITE_ROWS, or one whose position deletes remove
    DELETED_SHARE of its rows or more. A larger table's files are rewritten that way once its deletes reach that
    share: the rewrite costs the table's size, paid once per changes of a share of it, so what maintenance costs
    grows with the changes."""
    return ((health.data_bytes <= WHOLE_REWRITE_BYTES and health.rows <= WHOLE_REWRITE_ROWS)
            or health.position_deletes >= DELETED_SHARE * max(health.rows, 1))


def _small(health: TableHealth) -> bool:
    """Whether a table is maintained in the driver (:mod:`pgcdc.mirrors.small_compaction`)."""
    from pgcdc.mirrors.small_compaction import SMALL_BYTES, SMALL_ROWS

    return health.rows <= SMALL_ROWS and health.data_bytes <= SMALL_BYTES


def _follow_rewrites(table: Any, identifier: str) -> None:
    """The consistent tag onto the rewrite of the snapshot it was on (same rows, same LSN): its readers read the
    compacted files, and expiry frees the old ones. A concurrent commit of the tags' own (the stream moving them)
    wins: the tag is then where it should be."""
    from pgcdc.mirrors.consistent import follow_rewrites
    try:
        follow_rewrites(table)
    except Exception as exc:
        if not is_commit_conflict(exc):
            raise
        log.info("%s: the consistent tag moved meanwhile; it stays where the stream put it", identifier)
    table.refresh()


def _drop_dangling_deletes(spark: SparkSession, table: Any, carried: Mapping[str, str]) -> int:
    """Drop the delete files of an unpartitioned table that apply to no live data file, in one commit carrying
    ``carried``: an equality delete applies to data files of a lower data sequence number, a position delete to
    those of a lower or equal one, and only to the data file it names when it names one (pgcdc's name the file
    they delete from when it is one: a compaction keeping its starting sequence number leaves the last batch's
    position deletes naming files no longer live). Returns how many were dropped (no commit when none is)."""
    snapshot = table.currentSnapshot()
    if snapshot is None:
        return 0
    classes = iceberg_classes()
    live_data = live_files(table, snapshot, "data")
    oldest_data = min((int(data.dataSequenceNumber()) for data in live_data), default=None)
    live_paths = {str(data.location()) for data in live_data}
    rewrite = table.newRewrite().validateFromSnapshot(snapshot.snapshotId())
    dropped = 0
    for delete in live_files(table, snapshot, "deletes", stats=True):
        sequence = int(delete.dataSequenceNumber())
        if str(delete.content()) == "EQUALITY_DELETES":
            dangling = oldest_data is None or sequence <= oldest_data
        else:
            named = classes.referenced_data_file(delete)
            dangling = oldest_data is None or sequence < oldest_data or (
                named is not None and str(named) not in live_paths)
        if dangling:
            rewrite = rewrite.deleteFile(delete)
            dropped += 1
    if dropped:
        for key, value in carried.items():
            rewrite = rewrite.set(str(key), str(value))
        rewrite.commit()
    return dropped


def _position_delete_files(table: Any) -> int:
    snapshot = table.currentSnapshot()
    if snapshot is None:
        return 0
    return int(snapshot.summary().getOrDefault("total-position-deletes", "0"))


def _has_lists_or_maps(table: Any) -> bool:
    return any(field.type().isListType() or field.type().isMapType() or "list<" in str(field.type())
               or "map<" in str(field.type()) for field in table.schema().columns())


def _clean_old_metadata(table: Any) -> None:
    """Have Iceberg delete metadata files older than the last few versions (unless the table says otherwise), and
    start the orphan clock of a table never cleaned, in one metadata commit when either is missing."""
    properties = table.properties()
    missing = {k: v for k, v in METADATA_CLEANUP.items() if properties.get(k) is None}
    if properties.get(ORPHANS_REMOVED_PROPERTY) is None:
        missing[ORPHANS_REMOVED_PROPERTY] = str(int(time.time()))
    if missing:
        update = table.updateProperties()
        for key, value in missing.items():
            update = update.set(key, value)
        update.commit()


@dataclass
class MaintainedTable:
    """A table the pipeline maintains, and how to read the position properties its maintenance commits carry."""

    identifier: str
    carried: Callable[[], Mapping[str, str]]
    # its Java table as the pipeline keeps it between batches (None: none kept), which a look at whether the table
    # is due reads instead of loading the table from the catalog
    kept: Callable[[], Any] = lambda: None


def mirror_tables(mirrors: MirrorCatalog, tables: list[tuple[str, bool, Callable[[], Any]]]
                  ) -> list[MaintainedTable]:
    """The tables ``(identifier, is a __rejects table, its kept Java table)``, each with the positions its
    maintenance carries."""
    return [MaintainedTable(identifier, lambda identifier=identifier, rejects=rejects:  # type: ignore[misc]
                            mirrors.positions.carried(identifier, rejects=rejects), kept)
            for identifier, rejects, kept in tables]


class MaintenanceCancelled(Exception):
    """A table's rewrites did not run: the run stopped while they waited for a gap between two applies."""


MAINTENANCE_REST_FACTOR = 4.0
# a turn maintains due tables after its first while it has taken less than this: turns run beside the applies (a
# table's rewrites in a gap between two), so a turn may take the default look interval, and the expiry of
# mirrors committing every second keeps up with them (a second a turn left 60 such mirrors at 150 snapshots)
TURN_SECONDS = 10.0
MAINTENANCE_OVERDUE_LOOKS = 3  # looks a stream of batches may delay before a maintenance turn goes before one


class Maintainer:
    """The pipeline's schedule: :meth:`turn` maintains the due tables (round robin), more than one while the turn
    has taken less than ``TURN_SECONDS``; a table is maintained again only ``policy.interval_seconds`` after its
    last maintenance began (or four times as long as that maintenance took, when that is longer) — meanwhile only
    its snapshots are expired, once they reach the policy's bound — and one left unchanged for an interval (the
    stream went quiet) is compacted of its last delete files.
    ``clock`` keeps the schedule's time (seconds; a simulation may run its own)."""

    def __init__(self, spark: Callable[[], SparkSession], policy: MaintenancePolicy,
                 tables: Callable[[], list[MaintainedTable]], clock: Callable[[], float] = time.monotonic, *,
                 between: Callable[[str, Callable[[], None]], None] | None = None) -> None:
        """``between(what, call)``: runs a table's rewrites where no batch applies, returning once they ran (see
        :func:`maintain_table`); None: where the turn runs."""
        self._spark = spark
        self.between = between
        self.policy = policy
        self._tables = tables
        self.clock = clock
        self._last: dict[str, float] = {}
        self._rest: dict[str, float] = {}  # per table: seconds before its next maintenance, at least the interval
        self._changed: dict[str, tuple[int | None, float]] = {}  # per table: its snapshot, first seen when
        self._first_seen: dict[str, float] = {}  # per table never cleaned of orphans: when first looked at (epoch)
        self._last_check = float("-inf")
        self._next = 0
        self._cancelled = False
        self._started_jobs = False
        self.results: list[MaintenanceResult] = []

    def cancel(self) -> None:
        """Cancel the Spark jobs of the turn in flight (at a stop): its step fails having committed nothing, and
        runs again at the next maintenance."""
        self._cancelled = True
        if not self._started_jobs:  # no turn reached Spark (nor started it only to cancel nothing)
            return
        with contextlib.suppress(Exception):  # a JVM already gone has nothing left to cancel
            self._spark().sparkContext.cancelJobGroup(MAINTENANCE_JOB_GROUP)

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    @property
    def patience(self) -> float:
        """Seconds a table's rewrites waiting for a gap between two applies give way to batches due."""
        return MAINTENANCE_OVERDUE_LOOKS * self.policy.check_every

    def ready(self, now: float | None = None) -> bool:
        """Whether a turn may find something to do (a clock check only; no table is read)."""
        now = self.clock() if now is None else now
        return self.policy.enabled and now - self._last_check >= self.policy.check_every

    def turn(self) -> MaintenanceResult | None:
        """Maintain the due tables, round robin, the first of them whatever it takes, the others while the turn
        has spent less than ``TURN_SECONDS`` (hundreds of small mirrors each due every interval are maintained in
        a fraction of a second each); on the way, expire the snapshots of tables resting since their last
        maintenance that hold ``policy.snapshots`` or more: a mirror a batch commits to every second would
        otherwise gather hundreds within an interval, each listed in the metadata file every commit rewrites and
        every refresh reads. A failure (a conflict with someone else's commit) is logged and the table tried again
        after the interval. Returns the last maintenance made."""
        self._last_check = now = self.clock()
        started = time.monotonic()
        tables = self._tables()
        made = None
        first = self._next
        for offset in range(len(tables)):
            spent = time.monotonic() - started >= TURN_SECONDS
            if made is not None and spent:
                break
            candidate = tables[(first + offset) % len(tables)]
            rest = max(self.policy.interval_seconds, self._rest.get(candidate.identifier, 0.0))
            resting = now - self._last.get(candidate.identifier, float("-inf")) < rest
            if resting and (candidate.kept() is None or spent):
                continue  # a look costs a load from the catalog, or the turn has spent its time
            self._started_jobs = True
            spark = self._spark()
            try:
                health = self._look(spark, candidate)
                if resting:
                    if health.snapshots < self.policy.snapshots:
                        continue
                    steps = ["expire"]
                else:
                    steps = due_steps(health, self.policy, time.time(),
                                      settled=self._settled(candidate.identifier, health.current_snapshot, now))
                    if not steps:
                        continue
                    self._last[candidate.identifier] = now
                    self._next = (first + offset + 1) % len(tables)
                with _job_group(spark):
                    result = maintain_table(spark, candidate.identifier, candidate.carried, self.policy,
                                            steps=steps, between=self._in_a_gap(spark, candidate.identifier))
            except Exception as exc:  # maintenance must never stop the stream
                self._last[candidate.identifier] = now
                if self._cancelled:
                    log.info("maintenance of %s cancelled by the stop", candidate.identifier)
                else:
                    log.warning("maintenance of %s failed, tried again in %.0fs: %s", candidate.identifier,
                                self.policy.interval_seconds, _first_line(exc))
                return made
            kept = candidate.kept()
            if kept is not None:  # its next look reads what the maintenance made of it
                with contextlib.suppress(Exception):
                    kept.refresh()
            self.results = [*self.results[-99:], result]
            made = result
            if not resting:
                # a table whose maintenance takes long (a large mirror, every file of it touched by deletes) rests
                # for a multiple of that time: maintenance of any one table takes at most a quarter of the time
                self._rest[candidate.identifier] = MAINTENANCE_REST_FACTOR * result.seconds
        return made

    def _in_a_gap(self, spark: SparkSession, identifier: str) -> Callable[[Callable[[], None]], None] | None:
        """How ``identifier``'s rewrites run between two applies (None: where the turn runs), their Spark jobs in
        the maintenance's group."""
        between = self.between
        if between is None:
            return None

        def grouped(call: Callable[[], None]) -> None:
            def in_group() -> None:
                with _job_group(spark):
                    call()
            between(f"the rewrites of {identifier}", in_group)
        return grouped

    def _look(self, spark: SparkSession, candidate: MaintainedTable) -> TableHealth:
        """``candidate``'s health, as cheaply as it can be had (a look every few seconds over hundreds of mirrors
        takes a core's time from the applies): a kept table is read from the pipeline's own handle in one call into
        the JVM, not loaded from the catalog nor read as JSON. A table never cleaned of orphans counts its orphan
        clock from its first look (its maintenance records it in the table: :func:`_clean_old_metadata`)."""
        table = candidate.kept()
        health = table_health(spark, candidate.identifier) if table is None else _looked_health(spark, table)
        if health.orphans_removed_at is None:
            started = self._first_seen.setdefault(candidate.identifier, time.time())
            health = replace(health, orphans_removed_at=started)
        return health

    def _settled(self, identifier: str, snapshot: int | None, now: float) -> bool:
        """Whether ``identifier`` has had ``snapshot`` as its current snapshot for an interval (by this
        schedule's looks at it)."""
        recorded = self._changed.get(identifier)
        if recorded is None or recorded[0] != snapshot:
            self._changed[identifier] = (snapshot, now)
            return False
        return now - recorded[1] >= self.policy.interval_seconds


@contextlib.contextmanager
def _job_group(spark: SparkSession) -> Iterator[None]:
    """The Spark jobs this thread starts inside belong to the maintenance's job group (cancelled at a stop)."""
    context = spark.sparkContext
    context.setJobGroup(MAINTENANCE_JOB_GROUP, "pgcdc maintenance", interruptOnCancel=True)
    try:
        yield
    finally:  # the apply thread runs the MERGE writer's maintenance too: its own jobs are not the group's
        for key in ("spark.jobGroup.id", "spark.job.description", "spark.job.interruptOnCancel"):
            context.setLocalProperty(key, None)  # type: ignore[arg-type]


def _first_line(exc: BaseException) -> str:
    return next((line for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
