"""A namespace's mirrors read without Spark's JVM: what a start-up needs of them before anything is copied or
applied — which mirrors exist, their positions, the slot each streams from, their consistent tags.

:class:`MirrorMetadata` stands in for :class:`pgcdc.mirrors.catalog.MirrorCatalog` in those reads, with its names
(:class:`pgcdc.mirrors.catalog.MirrorNames`), its listing, and its rules: a position is read by
:func:`pgcdc.mirrors.positions.table_position` from the same metadata the JVM would load (a value that is no
LSN, a pending mark that cannot be resolved: refused alike), a tag by :func:`pgcdc.mirrors.consistent.tag_state`.
What it cannot read by itself (:mod:`pgcdc.iceberg.catalog_reader` says which catalogs and storage it reads) raises
:class:`pgcdc.iceberg.table_metadata.MetadataUnreadable`, and the caller reads through Spark instead. Each table is
read once: an instance answers for one start-up.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from pgcdc.errors import MetadataUnreadable
from pgcdc.iceberg.catalog_reader import CatalogReader, catalog_reader
from pgcdc.iceberg.table_metadata import TableMetadata
from pgcdc.lsn import Lsn
from pgcdc.mirrors.catalog import REJECTS_SUFFIX, MirrorNames, decode_name, encode_name
from pgcdc.mirrors.positions import table_position
from pgcdc.spark.destination import Destination


class MirrorMetadata(MirrorNames):
    """The mirrors of ``namespace`` in ``catalog``, read through ``reader``."""

    def __init__(self, reader: CatalogReader, catalog: str, namespace: str) -> None:
        super().__init__(catalog, namespace)
        self.reader = reader
        self._where: dict[str, tuple[tuple[str, ...], str]] = {}  # identifier -> (namespace levels, table name)
        self._tables: dict[str, TableMetadata | None] = {}
        self._listed: list[tuple[str, str, str]] | None = None
        self.positions = _Positions(self)
        self.properties = _Properties(self)

    @classmethod
    def of(cls, destination: Destination) -> MirrorMetadata:
        """The mirrors of ``destination``, read as the Spark session pgcdc would start for it would read them;
        :class:`MetadataUnreadable` when this process cannot (another catalog or storage, or settings from
        elsewhere than the destination: ``spark-defaults.conf``, ``PYSPARK_SUBMIT_ARGS``)."""
        outside = settings_from_elsewhere()
        if outside is not None:
            raise MetadataUnreadable(f"Spark also takes settings from {outside}")
        settings = destination.spark_settings()
        return cls(catalog_reader(destination.catalog, settings), destination.catalog, destination.namespace)

    def source_tables(self) -> list[tuple[str, str, str]]:
        """(source schema, source table, identifier) of every mirror in the namespace
        (:meth:`pgcdc.mirrors.catalog.MirrorCatalog.source_tables`)."""
        if self._listed is None:
            found = []
            for levels in self.reader.namespaces((self.namespace,)) or []:
                source_schema = decode_name(levels[-1])
                for name in self.reader.tables(levels):
                    source_table = self.mirrored(name)
                    if source_table is not None:
                        identifier = self.identifier_for(source_schema, source_table)
                        self._where[identifier] = (levels, name)
                        found.append((source_schema, source_table, identifier))
            self._listed = sorted(found)
        return self._listed

    def table(self, identifier: str) -> TableMetadata | None:
        """The current metadata of a mirror of the namespace (None: it is gone since it was listed)."""
        return self._load(identifier, "")

    def rejects_table(self, identifier: str) -> TableMetadata | None:
        """The current metadata of the table holding the changes set aside for a mirror of the namespace (None:
        it has none)."""
        return self._load(identifier, REJECTS_SUFFIX)

    def _load(self, identifier: str, suffix: str) -> TableMetadata | None:
        """A mirror's table (``suffix`` ""), or the table beside it whose source name carries ``suffix``."""
        if identifier + suffix not in self._tables:
            if identifier not in self._where:
                self.source_tables()
            where = self._where.get(identifier)
            if where is None:
                raise MetadataUnreadable(f"{identifier} is not a mirror of namespace {self.namespace!r}")
            levels, name = where
            named = encode_name(decode_name(name) + suffix) if suffix else name
            self._tables[identifier + suffix] = self.reader.load(levels, named)
        return self._tables[identifier + suffix]


class _Positions:
    """:class:`pgcdc.mirrors.positions.MirrorPositions`' reads."""

    def __init__(self, metadata: MirrorMetadata) -> None:
        self._metadata = metadata

    def exists(self, identifier: str) -> bool:
        return self._metadata.table(identifier) is not None

    def read(self, identifier: str) -> Lsn | None:
        table = self._metadata.table(identifier)
        return None if table is None else table_position(identifier, table)


class _Properties:
    """:class:`pgcdc.mirrors.properties.MirrorProperties`' reads."""

    def __init__(self, metadata: MirrorMetadata) -> None:
        self._metadata = metadata

    def read(self, identifier: str) -> Mapping[str, str]:
        table = self._metadata.table(identifier)
        if table is None:
            raise MetadataUnreadable(f"{identifier} disappeared while read")
        return dict(table.properties())


def settings_from_elsewhere() -> str | None:
    """What gives Spark settings besides pgcdc's own (which a session would take too): a ``spark-defaults.conf``
    in Spark's configuration directory, or arguments in ``PYSPARK_SUBMIT_ARGS``; None: nothing."""
    if os.environ.get("PYSPARK_SUBMIT_ARGS"):
        return "PYSPARK_SUBMIT_ARGS"
    directory = os.environ.get("SPARK_CONF_DIR")
    if not directory:
        home = os.environ.get("SPARK_HOME")
        if not home:
            import importlib.util

            spec = importlib.util.find_spec("pyspark")  # where pip's pyspark is its own Spark home
            locations = list(spec.submodule_search_locations or []) if spec is not None else []
            home = locations[0] if locations else None
        directory = os.path.join(home, "conf") if home else None
    defaults = Path(directory, "spark-defaults.conf") if directory else None
    return str(defaults) if defaults is not None and defaults.is_file() else None
