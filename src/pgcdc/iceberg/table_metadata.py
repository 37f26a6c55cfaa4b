"""An Iceberg table's metadata file read in Python: what a start-up asks of a mirror without a JVM.

:class:`TableMetadata` answers with the names of Iceberg's Java ``Table`` API (``currentSnapshot()``,
``snapshot(id)``, ``properties()``, ``refs()``; a snapshot's ``snapshotId()``, ``parentId()``, ``operation()``,
``summary()``), read-only: the rules that read a JVM table — a mirror's position
(:func:`pgcdc.mirrors.positions.table_position`), its consistent tag (:mod:`pgcdc.mirrors.consistent`) — read
this one unchanged, so both ways of reading agree by construction. It follows the table metadata format of the
Iceberg spec (versions 1 to 3) as Iceberg's ``TableMetadataParser`` and ``SnapshotParser`` read it: a summary
holds every entry but ``operation``, a current snapshot id of -1 means none, a v1 table without ``refs`` has
its ``main`` branch at the current snapshot. Anything else (an unknown format version, a malformed file) is
:class:`MetadataUnreadable`: the caller reads the table through the JVM instead, never a guess.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from pgcdc.errors import MetadataUnreadable

SUPPORTED_FORMAT_VERSIONS = (1, 2, 3)


@dataclass(frozen=True)
class SnapshotRef:
    """A branch or tag (``SnapshotRef`` of Iceberg's Java API)."""

    snapshot_id: int
    type: str

    def snapshotId(self) -> int:
        return self.snapshot_id


@dataclass(frozen=True)
class Snapshot:
    """One snapshot of a table (``Snapshot`` of Iceberg's Java API, what the start path reads of it)."""

    snapshot_id: int
    parent_id: int | None
    operation_name: str | None
    summary_entries: Mapping[str, str]
    manifest_list: str | None = None  # where the Avro list of its manifests is (pgcdc.iceberg.table_files)
    timestamp_ms: int = 0  # when it was committed

    def snapshotId(self) -> int:
        return self.snapshot_id

    def parentId(self) -> int | None:
        return self.parent_id

    def operation(self) -> str | None:
        return self.operation_name

    def summary(self) -> Mapping[str, str]:
        return self.summary_entries

    def timestampMillis(self) -> int:
        return self.timestamp_ms


class TableMetadata:
    """A table as one metadata file describes it; ``location``: where that file is."""

    def __init__(self, document: Mapping[str, Any], location: str) -> None:
        self.location = location
        try:
            self.format_version = int(document["format-version"])
            if self.format_version not in SUPPORTED_FORMAT_VERSIONS:
                raise MetadataUnreadable(f"{location}: Iceberg format version {self.format_version}")
            self._properties = {str(k): str(v) for k, v in (document.get("properties") or {}).items()}
            self._snapshots = {snapshot.snapshot_id: snapshot for snapshot in map(_snapshot,
                                                                                  document.get("snapshots") or [])}
            current = document.get("current-snapshot-id")
            self.current_snapshot_id = None if current is None or int(current) == -1 else int(current)
            refs = document.get("refs")
            if refs is None:  # format v1 before refs: the main branch is the current snapshot
                refs = {} if self.current_snapshot_id is None else {
                    "main": {"snapshot-id": self.current_snapshot_id, "type": "branch"}}
            self._refs = {str(name): SnapshotRef(int(ref["snapshot-id"]), str(ref["type"]))
                          for name, ref in refs.items()}
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise MetadataUnreadable(f"{location} is not Iceberg table metadata ({exc!r})") from None

    @classmethod
    def parse(cls, data: bytes, location: str) -> TableMetadata:
        """The metadata in ``data``, the bytes of the file at ``location`` (gzip-compressed when its name says
        so, as Iceberg names such files)."""
        try:
            if location.endswith((".gz.metadata.json", ".metadata.json.gz")):
                data = gzip.decompress(data)
            document = json.loads(data)
        except (OSError, EOFError, ValueError) as exc:
            raise MetadataUnreadable(f"{location} cannot be read as JSON ({exc})") from None
        if not isinstance(document, dict):
            raise MetadataUnreadable(f"{location} is not Iceberg table metadata")
        return cls(document, location)

    def currentSnapshot(self) -> Snapshot | None:
        return None if self.current_snapshot_id is None else self._snapshots.get(self.current_snapshot_id)

    def snapshot(self, snapshot_id: int) -> Snapshot | None:
        return self._snapshots.get(int(snapshot_id))

    def snapshots(self) -> list[Snapshot]:
        return list(self._snapshots.values())

    # read-only views: one TableMetadata is shared by every reader of its file (pgcdc.spark.iceberg_java.metadata_view)
    def properties(self) -> Mapping[str, str]:
        return MappingProxyType(self._properties)

    def refs(self) -> Mapping[str, SnapshotRef]:
        return MappingProxyType(self._refs)


def _snapshot(entry: Mapping[str, Any]) -> Snapshot:
    summary = {str(k): str(v) for k, v in (entry.get("summary") or {}).items()}
    operation = summary.pop("operation", None)
    parent = entry.get("parent-snapshot-id")
    manifest_list = entry.get("manifest-list")
    return Snapshot(int(entry["snapshot-id"]), None if parent is None else int(parent), operation,
                    MappingProxyType(summary), None if manifest_list is None else str(manifest_list),
                    int(entry.get("timestamp-ms") or 0))
