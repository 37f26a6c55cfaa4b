"""The files of an Iceberg table's snapshot, read from its manifests in Python, and the rows they hold.

A snapshot lists its manifests in an Avro manifest list; each manifest lists data files, or delete files, with
their record counts (:mod:`pgcdc.iceberg.avro_files` reads both). :func:`live_rows` counts what a reader of the
snapshot reads, as the Iceberg spec (version 2, "Scan Planning") says a reader applies deletes: every live data
file's records, less each position it finds in a position delete file that applies to it — the delete file names
the data file's path, its data sequence number is that of the data file or later, and both are of one partition
of one spec. A position is taken away once however many delete files name it, and a delete naming a file that is
no longer live (left behind when compaction replaced it) takes nothing away. So :func:`live_rows` is exact where
the snapshot summary's totals are not: they count such deletes anyway.

Equality deletes (which only a reader of the rows can apply), deletion vectors (format v3) and delete files in
another format than Parquet are not counted here: :func:`live_rows` returns None, and the caller counts through
Spark. A manifest or delete file that cannot be read is :class:`MetadataUnreadable`, never a guess.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pgcdc.errors import MetadataUnreadable
from pgcdc.iceberg.avro_files import read_container
from pgcdc.iceberg.table_metadata import Snapshot, TableMetadata

if TYPE_CHECKING:
    from pgcdc.iceberg.catalog_reader import Storage

DATA, POSITION_DELETES = 0, 1  # a file's content (the spec's data_file.content; 2: equality deletes)
ADDED, DELETED = 1, 2  # a manifest entry's status: the file came, or left, in that manifest's snapshot


@dataclass(frozen=True)
class TableFile:
    """A live file of a snapshot, as its manifest entry describes it."""

    content: int
    path: str
    file_format: str
    record_count: int
    data_sequence_number: int
    partition: tuple[int, tuple[Any, ...]]  # (partition spec id, partition values)
    content_offset: int | None  # set for a deletion vector (a blob in a Puffin file)


def snapshot_files(snapshot: Snapshot, storage: Storage) -> list[TableFile]:
    """Every live file of ``snapshot`` (data and delete files), read from its manifests at ``storage``."""
    if snapshot.manifest_list is None:
        raise MetadataUnreadable(f"snapshot {snapshot.snapshot_id} has no manifest list (format v1 manifests inline)")
    files = []
    for manifest in _records(snapshot.manifest_list, storage):
        try:
            path = str(manifest["manifest_path"])
            spec_id = int(manifest["partition_spec_id"])
            manifest_sequence = int(manifest.get("sequence_number") or 0)  # format v1 has none: 0
        except (KeyError, TypeError, ValueError) as exc:
            raise MetadataUnreadable(f"{snapshot.manifest_list}: not an Iceberg manifest list ({exc!r})") from None
        files.extend(_manifest_files(path, spec_id, manifest_sequence, storage))
    return files


def _manifest_files(location: str, spec_id: int, manifest_sequence: int, storage: Storage) -> list[TableFile]:
    files = []
    for entry in _records(location, storage):
        try:
            if int(entry["status"]) == DELETED:
                continue
            file = entry["data_file"]
            sequence = entry.get("sequence_number")
            if sequence is None:
                # inherited from the manifest by the files it added (or by all, in a table without sequence
                # numbers), as Iceberg's readers inherit it
                if int(entry["status"]) != ADDED and manifest_sequence != 0:
                    raise MetadataUnreadable(f"{location}: an existing file without its data sequence number")
                sequence = manifest_sequence
            partition = file.get("partition") or {}
            files.append(TableFile(
                content=int(file.get("content") or DATA), path=str(file["file_path"]),
                file_format=str(file["file_format"]).upper(), record_count=int(file["record_count"]),
                data_sequence_number=int(sequence), partition=(spec_id, tuple(partition.values())),
                content_offset=file.get("content_offset")))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise MetadataUnreadable(f"{location}: not an Iceberg manifest ({exc!r})") from None
    return files


def _records(location: str, storage: Storage) -> list[dict[str, Any]]:
    data = storage.read(location)
    if data is None:
        raise MetadataUnreadable(f"{location} does not exist")
    return read_container(data, location)[1]


def live_rows(table: TableMetadata, storage: Storage) -> int | None:
    """The rows a reader reads in ``table``'s current snapshot: its summary's total when no delete file takes any
    away, else its data files' records less the positions its position delete files take away (read at
    ``storage``). None when only a reader of the rows could count them: equality deletes, deletion vectors,
    delete files in another format than Parquet."""
    snapshot = table.currentSnapshot()
    if snapshot is None:
        return 0
    summary = snapshot.summary()
    try:
        if int(summary["total-delete-files"]) == 0:
            return int(summary["total-records"])
    except (KeyError, ValueError):
        pass
    files = snapshot_files(snapshot, storage)
    deletes = [file for file in files if file.content != DATA]
    if any(file.content != POSITION_DELETES or file.file_format != "PARQUET" or file.content_offset is not None
           for file in deletes):
        return None
    data = [file for file in files if file.content == DATA]
    return sum(file.record_count for file in data) - _deleted_positions(data, deletes, storage)


def _deleted_positions(data: list[TableFile], deletes: list[TableFile], storage: Storage) -> int:
    """How many positions of the ``data`` files the position delete files ``deletes`` take away: distinct
    (file, position) pairs naming a live data file of their partition, no newer than the delete, within its
    records."""
    if not deletes or not data:
        return 0
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    targets = pa.table({
        "file_path": pa.array([file.path for file in data], pa.string()),
        "data_sequence": pa.array([file.data_sequence_number for file in data], pa.int64()),
        "data_partition": pa.array([repr(file.partition) for file in data], pa.string()),
        "record_count": pa.array([file.record_count for file in data], pa.int64())})
    pieces = []
    for file in deletes:
        raw = storage.read(file.path)
        if raw is None:
            raise MetadataUnreadable(f"{file.path}, a delete file of the snapshot, does not exist")
        try:
            positions = pq.read_table(pa.BufferReader(raw), columns=["file_path", "pos"])
            positions = pa.table({"file_path": positions["file_path"].cast(pa.string()),
                                  "pos": positions["pos"].cast(pa.int64())})
        except (pa.ArrowException, KeyError) as exc:
            raise MetadataUnreadable(f"{file.path} is not a position delete file ({exc})") from None
        count = positions.num_rows
        pieces.append(positions.append_column("delete_sequence", pa.repeat(pa.scalar(file.data_sequence_number,
                                                                                      pa.int64()), count))
                      .append_column("delete_partition", pa.repeat(pa.scalar(repr(file.partition), pa.string()),
                                                                   count)))
    joined = pa.concat_tables(pieces).join(targets, keys="file_path", join_type="inner")
    applies = pc.and_(pc.and_(pc.greater_equal(joined["delete_sequence"], joined["data_sequence"]),
                              pc.equal(joined["delete_partition"], joined["data_partition"])),
                      pc.and_(pc.greater_equal(joined["pos"], 0), pc.less(joined["pos"], joined["record_count"])))
    taken = joined.filter(applies).select(["file_path", "pos"])
    return taken.group_by(["file_path", "pos"]).aggregate([]).num_rows
