"""Iceberg operations that need the JVM: commits that carry pgcdc's position in their snapshot summary."""

from __future__ import annotations

import copy
import json
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from pgcdc.errors import MetadataUnreadable
from pgcdc.iceberg.table_metadata import TableMetadata

if TYPE_CHECKING:
    from pyspark.sql import SparkSession
    from pyspark.sql.types import StructType

    from pgcdc.iceberg.parquet import FieldLayout

T = TypeVar("T")

_CALLBACK_SERVER_LOCK = threading.Lock()
_LISTENING_CALLBACK_SERVERS: weakref.WeakSet[Any] = weakref.WeakSet()


def _ensure_callback_server_listens(gateway: Any) -> None:
    """Start py4j's callback server once per gateway (Iceberg calls back into Python to run a committing
    statement) and return only when it accepts connections.

    pyspark's ``ensure_callback_server_started`` is neither safe from several threads at once (a second
    caller goes on before Java is told the port) nor waits for the server: py4j binds the socket, tells Java
    its port, and calls ``listen`` from the server's own thread, which on a busy interpreter may not have run
    yet when Java makes its first callback: the connection is refused and the commit fails (the run stops,
    its position unmoved). Listening here, before any commit can call back, closes that window."""
    from pyspark.java_gateway import ensure_callback_server_started

    with _CALLBACK_SERVER_LOCK:
        ensure_callback_server_started(gateway)
        server = gateway._callback_server
        if server not in _LISTENING_CALLBACK_SERVERS:
            server.server_socket.listen(5)  # what py4j's thread does too; a second listen changes nothing
            _LISTENING_CALLBACK_SERVERS.add(server)


COMMIT_LOCK_POLL_MS = 10  # how often a commit waiting for the JVM's in-memory lock of a table looks again


class IcebergClasses:
    """The Java classes (and constants) a batch calls, resolved once per JVM: py4j resolves each name of
    ``jvm.org.apache.iceberg.X`` with a round trip of its own, which every batch would otherwise pay dozens of
    times over (a round trip costs the apply tens of microseconds on an idle machine, milliseconds on a busy one)."""

    def __init__(self, jvm: Any) -> None:
        iceberg = jvm.org.apache.iceberg
        # static methods kept as members: a member looked up on its class is one more round trip per call
        self.load_table = iceberg.spark.Spark3Util.loadIcebergTable
        self.metadata_json = iceberg.TableMetadataParser.toJson
        self.set_active_session = jvm.org.apache.spark.sql.SparkSession.setActiveSession
        self.spark_actions = iceberg.spark.actions.SparkActions.get
        self.read_data_manifest = iceberg.ManifestFiles.read
        self.read_delete_manifest = iceberg.ManifestFiles.readDeleteManifest
        self.referenced_data_file = iceberg.util.ContentFileUtil.referencedDataFileLocation
        self.count = iceberg.relocated.com.google.common.collect.Iterables.size
        self.String = jvm.java.lang.String
        self.schema_json = iceberg.SchemaParser.toJson
        self.spark_schema = iceberg.spark.SparkSchemaUtil.convert
        self.metrics_for_table = iceberg.MetricsConfig.forTable
        self.metrics_for_position_deletes = iceberg.MetricsConfig.forPositionDelete
        self.metrics_from_footer = iceberg.parquet.ParquetUtil.footerMetrics
        self.FooterReader = iceberg.shaded.org.apache.parquet.format.converter.ParquetMetadataConverter
        self.BytesInput = jvm.java.io.ByteArrayInputStream
        self.no_field_metrics = jvm.java.util.stream.Stream.empty
        self.delete_file_builder = iceberg.FileMetadata.deleteFileBuilder
        self.data_file_builder = iceberg.DataFiles.builder
        self.PARQUET = iceberg.FileFormat.PARQUET
        self.always_true = iceberg.expressions.Expressions.alwaysTrue()
        # runs each task in the thread that submits it: steps_where_cheapest
        self.in_calling_thread = (iceberg.relocated.com.google.common.util.concurrent.MoreExecutors
                                  .newDirectExecutorService())
        self.ArrayList = jvm.java.util.ArrayList
        self.spec_json = iceberg.PartitionSpecParser.toJson
        # Commits to one table from this JVM (a batch's, a consistent tag's move, a maintenance step) take turns
        # under the Hadoop catalog's lock, held for milliseconds: the JVM's default lock manager, unless a catalog
        # names its own (lock-impl), which polls every 5 s by default and reads no catalog's settings — a batch of
        # 0.8 s took 5.6 s when it met a tag's move on one mirror. Its other settings keep their defaults.
        locks = jvm.java.util.HashMap()
        locks.put("lock.acquire-interval-ms", str(COMMIT_LOCK_POLL_MS))
        iceberg.util.LockManagers.defaultLockManager().initialize(locks)
        # pgcdc's own class, from its jar (None: a session started without it)
        from py4j.java_gateway import JavaClass
        from py4j.protocol import Py4JError

        def own_class(name: str) -> Any:
            try:
                found = getattr(jvm.pgcdc.iceberg, name)
            except Py4JError:  # a class loader that sees the jar but not Iceberg
                return None
            return _StaticMembers(found) if isinstance(found, JavaClass) else None

        self.partitions = own_class("Partitions")
        self.manifests = own_class("Manifests")
        self.health = own_class("Health")
        self.tags = own_class("Tags")
        self.files = own_class("Files")
        self.facts = own_class("Facts")
        self.commits = own_class("Commits")
        self.HashMap = jvm.java.util.HashMap


class _StaticMembers:
    """A Java class whose static methods are each looked up once: py4j resolves ``JavaClass.member`` with a round
    trip of its own at every call, which doubled the round trips of pgcdc's one-call helpers."""

    def __init__(self, java_class: Any) -> None:
        self._java_class = java_class

    def __getattr__(self, name: str) -> Any:
        member = _Unconverted(getattr(self._java_class, name))
        setattr(self, name, member)
        return member


class _Unconverted:
    """A static method called without py4j's input converters when every argument is one py4j sends as it is (a
    Java object, a string, a number, a bool, bytes, None): before each call py4j asks every converter (PySpark's
    among them) whether it takes each argument, most through ``inspect.getattr_static`` — ~0.2 ms of the GIL for
    a commit's dozen arguments, a mirror every batch. Other arguments (a Python list, a dict) are converted as
    before."""

    def __init__(self, member: Any) -> None:
        from py4j.java_gateway import JavaObject

        self._member = member
        self._plain = copy.copy(member)
        self._plain.converters = None
        self._sent_as_they_are = (str, int, float, bool, bytes, bytearray, type(None), JavaObject)

    def __call__(self, *args: Any) -> Any:
        if all(isinstance(arg, self._sent_as_they_are) for arg in args):
            return self._plain(*args)
        return self._member(*args)


_CLASSES: weakref.WeakKeyDictionary[Any, IcebergClasses] = weakref.WeakKeyDictionary()


def iceberg_classes() -> IcebergClasses:
    """:class:`IcebergClasses` of the running JVM (PySpark's one gateway; a new SparkContext keeps it)."""
    from pyspark import SparkContext

    jvm = SparkContext._jvm
    if jvm is None:
        raise RuntimeError("no Spark JVM is running")
    classes = _CLASSES.get(jvm)
    if classes is None:
        classes = _CLASSES[jvm] = IcebergClasses(jvm)
    return classes


class _JavaCallable:
    """A Python function seen by the JVM as a ``java.util.concurrent.Callable``."""

    def __init__(self, fn: Callable[[], object]) -> None:
        self._fn = fn
        self.result: object = None

    def call(self) -> None:
        self.result = self._fn()

    class Java:
        implements = ["java.util.concurrent.Callable"]


def with_commit_properties(spark: SparkSession, properties: Mapping[str, str], fn: Callable[[], T]) -> T:
    """Run ``fn`` (e.g. a ``MERGE INTO``) so that every Iceberg commit it makes carries ``properties``
    in its snapshot summary: the data and the properties land in one atomic commit.

    Iceberg keeps these properties in a JVM thread-local; py4j's pinned-thread mode runs the
    callback's own JVM calls on the thread that set them.
    """
    context = spark.sparkContext
    _ensure_callback_server_listens(context._gateway)
    jvm: Any = context._jvm
    java_properties = jvm.java.util.HashMap()
    for key, value in properties.items():
        java_properties.put(str(key), str(value))
    callable_ = _JavaCallable(fn)
    runtime_exception = jvm.java.lang.Class.forName("java.lang.RuntimeException")
    jvm.org.apache.iceberg.spark.CommitMetadata.withCommitProperties(java_properties, callable_, runtime_exception)
    return callable_.result  # type: ignore[return-value]


def java_exceptions(exc: BaseException) -> list[str]:
    """The class names of the Java exception behind ``exc`` and of each of its causes, outermost first (empty when
    ``exc`` did not come from the JVM). Spark wraps what Iceberg raises (a MERGE's commit, an action's), so the
    whole chain is looked at."""
    from py4j.protocol import Py4JJavaError

    names: list[str] = []
    if isinstance(exc, Py4JJavaError):
        throwable = exc.java_exception
        while throwable is not None and len(names) < 20:
            names.append(str(throwable.getClass().getName()))
            throwable = throwable.getCause()
        return names
    captured = getattr(exc, "_origin", None)  # pyspark's CapturedException keeps the Java throwable there
    if captured is not None:
        while captured is not None and len(names) < 20:
            names.append(str(captured.getClass().getName()))
            captured = captured.getCause()
    return names


def failure_text(exc: BaseException) -> str:
    """One line saying what failed: the Java exception's own line (its class and message) when ``exc`` came from
    the JVM, where py4j's first line only names the call ("An error occurred while calling ..."); else the
    exception's first line."""
    lines = [line.strip(": \t") for line in str(exc).splitlines() if line.strip()]
    java = next((line for line in lines if line.split(":", 1)[0].endswith(("Exception", "Error"))
                 and "." in line.split(":", 1)[0]), None)
    return (java or (lines[0] if lines else type(exc).__name__))[:300]


def is_commit_conflict(exc: BaseException) -> bool:
    """Whether ``exc`` is an Iceberg commit that lost to a concurrent one and changed nothing: safe to redo.
    (CommitStateUnknownException is not: that commit may have landed.)"""
    names = java_exceptions(exc)
    if any(name.endswith(".CommitStateUnknownException") for name in names):
        return False
    return any(name in ("org.apache.iceberg.exceptions.ValidationException",
                        "org.apache.iceberg.exceptions.CommitFailedException") for name in names)


def commit_outcome_unknown(exc: BaseException) -> bool:
    """Whether ``exc`` is a commit whose outcome is unknown (the catalog did not answer): it may have landed."""
    return any(name.endswith(".CommitStateUnknownException") for name in java_exceptions(exc))


# -- data files written outside Spark's writer (the initial copy) ------------------------------------------

def load_table(spark: SparkSession, identifier: str) -> Any:
    """The ``org.apache.iceberg.Table`` behind a Spark identifier, as its catalog holds it now. pgcdc's catalogs
    load a table afresh each time (``cache-enabled`` false); one a user set to cache tables is asked again."""
    table = iceberg_classes().load_table(spark._jsparkSession, identifier)
    if _caches_tables(spark, identifier):
        table.refresh()
    return table


def spark_schema_of(table: Any) -> StructType:
    """The Spark schema of an Iceberg ``table``, as Spark's own table gives it (``SparkSchemaUtil.convert``): one
    call into the JVM, where ``spark.table(identifier).schema`` loads the table again and plans a relation."""
    from pyspark.sql.types import StructType

    converted = iceberg_classes().spark_schema(table.schema())
    return StructType.fromJson(json.loads(str(converted.json())))


# per session, per catalog name: whether it caches tables. Read once: Spark keeps a catalog as it was made from
# its settings, and the question would otherwise cost every table load a round trip to the JVM
_CATALOGS_CACHING: weakref.WeakKeyDictionary[Any, dict[str, bool]] = weakref.WeakKeyDictionary()


def _caches_tables(spark: SparkSession, identifier: str) -> bool:
    """Whether the Spark catalog ``identifier`` names first caches the tables it loads (Iceberg's default)."""
    catalog = identifier.split(".", 1)[0].strip("`")
    known = _CATALOGS_CACHING.setdefault(spark, {})
    if catalog not in known:
        setting = spark.conf.get(f"spark.sql.catalog.{catalog}.cache-enabled", "true")
        known[catalog] = str(setting).strip().lower() != "false"
    return known[catalog]


def java_items(iterable: Any) -> list[Any]:
    """The elements of a Java ``Iterable`` (a list, a snapshot's manifests, an action's results), read with
    ``hasNext``/``next``. py4j's own Python iteration ends on the exception its last ``next`` raises, which
    PySpark's error handler then inspects with a dozen round trips more: per list iterated."""
    iterator = iterable.iterator()
    items = []
    while iterator.hasNext():
        items.append(iterator.next())
    return items


def live_files(table: Any, snapshot: Any, content: Literal["data", "deletes"], *, stats: bool = False) -> list[Any]:
    """The live data files (or delete files) of ``table``'s ``snapshot``, read from its manifests (their added
    and existing entries); with their column statistics when ``stats`` (a position delete's bounds name the data
    file it deletes from)."""
    classes = iceberg_classes()
    io, specs = table.io(), table.specs()
    manifests, read = ((snapshot.dataManifests(io), classes.read_data_manifest) if content == "data"
                       else (snapshot.deleteManifests(io), classes.read_delete_manifest))
    files = []
    for manifest in java_items(manifests):
        reader = read(manifest, io, specs)
        try:
            iterator = reader.iterator()
            while iterator.hasNext():
                entry = iterator.next()
                files.append(entry.copy() if stats else entry.copyWithoutStats())
        finally:
            reader.close()
    return files


def java_count(iterable: Any) -> int:
    """How many elements a Java ``Iterable`` holds, in one round trip."""
    return int(iceberg_classes().count(iterable))


def metadata_view(table: Any) -> Any:
    """``table``'s current metadata, to read in Python: a Java ``Table``'s as one JSON document (serialised once per
    metadata file and table: ``_VIEWS``), as a :class:`TableMetadata` (its snapshots, their summaries, refs and
    properties: through the Java API, a few round trips per snapshot and per property, which every batch paid for
    every mirror); a :class:`TableMetadata` as it is. Both answer the same calls, so the rules that read a table
    take either. What the Java table holds is what is read (it is not refreshed); metadata the Python reader does
    not know (a newer format) leaves the Java table to be read."""
    from py4j.protocol import Py4JError

    if isinstance(table, TableMetadata):
        return table
    try:
        current = table.operations().current()
    except Py4JError:  # a Table without table operations (Iceberg's own catalogs return none such)
        return table
    key = _view_key(current)
    if key is not None:
        with _VIEWS_LOCK:
            view = _VIEWS.get(key)
            if view is not None:
                _VIEWS.move_to_end(key)
                return view
    document = json.loads(str(iceberg_classes().metadata_json(current)))
    try:
        view = TableMetadata(document, f"the current metadata of {document.get('location')}")
    except MetadataUnreadable:
        return table
    if key is not None:
        _keep_view(key, view)
    return view


def light_view(table: Any, summary_keys: Sequence[str] = ()) -> Any:
    """``table``'s metadata, to read in Python, holding what pgcdc's rules read — properties, refs, snapshots with
    their ids, parents, times, operations and the values of ``summary_keys`` — as a :class:`TableMetadata` from one
    call into the JVM (``pgcdc.iceberg.Facts``), rather than the whole metadata as JSON (:func:`metadata_view`,
    which it is without pgcdc's jar: tens of milliseconds a table in a JVM just started, paid for every mirror at a
    run's start and its first batch). ``table`` itself when it is a :class:`TableMetadata`."""
    if isinstance(table, TableMetadata):
        return table
    facts = iceberg_classes().facts
    if facts is None:
        return metadata_view(table)
    document = json.loads(str(facts.view(table, ",".join(summary_keys))))
    return TableMetadata(document, f"the metadata of {table.name()} (pgcdc.iceberg.Facts)")


def _keep_view(key: tuple[str, str], view: TableMetadata) -> None:
    global _VIEWS_SNAPSHOTS
    with _VIEWS_LOCK:
        if key in _VIEWS:  # read meanwhile by another thread
            return
        _VIEWS[key] = view
        _VIEWS_SNAPSHOTS += len(view.snapshots())
        while len(_VIEWS) > _VIEWS_KEPT or _VIEWS_SNAPSHOTS > _VIEWS_SNAPSHOTS_KEPT:
            _VIEWS_SNAPSHOTS -= len(_VIEWS.popitem(last=False)[1].snapshots())


# Views already read, by metadata file and table uuid. A batch reads each mirror's metadata several times between
# two of its commits (its position, its properties, its consistent tag, its health), and each read costs the JVM
# a serialisation of the whole document (tens of milliseconds for a table of many snapshots). A metadata file is
# never rewritten (each version is a file of its own), and a table made again where one was dropped (a Hadoop
# catalog's v1.metadata.json once more) has another uuid. Metadata not read from a file (a transaction's, staged)
# has no location and is never kept.
_VIEWS: OrderedDict[tuple[str, str], TableMetadata] = OrderedDict()
_VIEWS_KEPT = 64
_VIEWS_SNAPSHOTS_KEPT = 100_000  # and the snapshots they hold: a table never expired holds thousands a day
_VIEWS_SNAPSHOTS = 0
_VIEWS_LOCK = threading.Lock()


def _view_key(current: Any) -> tuple[str, str] | None:
    location = current.metadataFileLocation()
    uuid = None if location is None else current.uuid()
    return None if location is None or uuid is None else (str(location), str(uuid))


def partition_data(spec: Any, values: tuple[bytes | None, ...]) -> Any:
    """The partition of ``spec`` holding ``values`` (each in Iceberg's single-value binary form, None: NULL, as
    :func:`pgcdc.iceberg.partition_values.partition_rows` gives them): a Java ``StructLike`` a data or delete file is
    labelled with, each value converted by Iceberg itself to the Java type its field holds."""
    classes = iceberg_classes()
    if classes.partitions is None:
        raise PartitionsUnavailable()
    listed = classes.ArrayList()
    for value in values:
        listed.add(None if value is None else bytearray(value))
    return classes.partitions.of(spec, listed)


class PartitionsUnavailable(RuntimeError):
    def __init__(self) -> None:
        super().__init__("pgcdc's jar (pgcdc.spark.settings.PGCDC_JAR) is not on this Spark session's driver class "
                         "path, so the row-delta writer cannot label a partitioned mirror's files; start the session "
                         "with pgcdc.spark_settings(), or add the jar to spark.driver.extraClassPath")


def partition_spec_json(spec: Any) -> dict[str, Any]:
    return dict(json.loads(str(iceberg_classes().spec_json(spec))))


def schema_json(table: Any) -> dict[str, Any]:
    return dict(json.loads(str(iceberg_classes().schema_json(table.schema()))))


@dataclass(frozen=True)
class TableState:
    """What a batch asks of a mirror's table before it writes, read with its refresh in one call into the JVM
    (``pgcdc.iceberg.Commits.refreshed``): its current snapshot, whether equality-delete files are among its live
    files, how many manifests that snapshot lists, and its shape (``Commits.shape``: what its writer's layout is
    read from)."""

    snapshot_id: int | None
    equality_deletes: bool
    manifests: int
    shape: str


def refreshed_state(table: Any) -> TableState | None:
    """``table`` refreshed, and its :class:`TableState`; None (refreshed all the same) in a session without pgcdc's
    jar, where each question is asked on its own."""
    commits = iceberg_classes().commits
    if commits is None:
        table.refresh()
        return None
    facts, _, shape = str(commits.refreshed(table)).partition("\0")
    snapshot_id, equality_deletes, manifests = (int(part) for part in facts.split())
    return TableState(None if snapshot_id == -1 else snapshot_id, equality_deletes == 1, manifests, shape)


def holds_equality_deletes(snapshot: Any) -> bool:
    """Whether a snapshot's table holds equality-delete files (its summary's total): they apply to every data file
    older than they are, by sequence number, so a file rewritten from older ones would escape them."""
    return snapshot is not None and int(snapshot.summary().getOrDefault("total-equality-deletes", "0")) > 0


def data_directory(table: Any) -> str | None:
    """Where the table's new data files go (a ``file:`` or object store URI); None for a partitioned table,
    whose files only Spark's writer places."""
    if table.spec().isPartitioned():
        return None
    return _new_file_directory(table.locationProvider())


def default_data_directory(locations: Any) -> str | None:
    """The directory Iceberg's default ``LocationProvider`` (``locations``, a table's) puts every new file of no
    partition in — its ``newDataLocation(name)`` is that directory, a slash and the name — or None for any other
    provider (``write.object-storage.enabled``, a user's ``write.location-provider.impl``), whose locations vary."""
    if not str(locations.getClass().getName()).endswith("LocationProviders$DefaultLocationProvider"):
        return None
    return _new_file_directory(locations)


def _new_file_directory(locations: Any) -> str:
    return str(locations.newDataLocation("probe.parquet")).rsplit("/", 1)[0]


def local_data_directory(table: Any) -> str | None:
    """Where the table's new data files go, when that is a directory of this machine's file system (a local
    or shared-mount warehouse); None elsewhere."""
    location = data_directory(table)
    return location if location is not None and location.startswith(("file:", "/")) else None


def s3_options(table: Any, location: str) -> dict[str, Any] | None:
    """Keyword arguments of ``pyarrow.fs.S3FileSystem`` that reach ``location`` (``s3a://``, ``s3://``) as the
    table's own FileIO does (:func:`pgcdc.iceberg.locations.hadoop_s3_options` over its Hadoop settings). None when the
    table's files are not on S3 through Hadoop's FileIO, or its credentials come from a provider pyarrow cannot
    stand in for (e.g. an assumed role)."""
    from pgcdc.iceberg.locations import hadoop_s3_options

    io = table.io()
    if not str(io.getClass().getName()).endswith("HadoopFileIO"):
        return None
    conf = io.conf()
    return hadoop_s3_options(location, conf.getTrimmed)


def parquet_layout(table: Any, schema: dict[str, Any] | None = None) -> list[tuple[str, FieldLayout]]:
    """Each column's field id and Arrow type, nested ids included: Iceberg reads Parquet columns by id. Read from
    the schema's JSON in one call into the JVM (walking the schema object would cost a call per field and type:
    hundreds for a wide table, every batch); ``schema``: that JSON, when the caller read it already."""
    from pgcdc.iceberg.parquet import field_layout  # pyarrow: not for commands that only read metadata

    schema = schema if schema is not None else schema_json(table)
    return [(str(field["name"]), field_layout(field)) for field in schema["fields"]]


def parquet_compression(table: Any) -> tuple[str, int | None]:
    """The table's Parquet codec and level (Iceberg's defaults: zstd, the codec's own level)."""
    properties = table.properties()
    codec = str(properties.getOrDefault("write.parquet.compression-codec", "zstd")).lower()
    level = properties.get("write.parquet.compression-level")
    return ("none" if codec == "uncompressed" else codec), (int(level) if level is not None else None)


def data_file(spark: SparkSession, table: Any, path: str, size: int, footer: bytes, *,
              equality_ids: list[int] | None = None, metrics_config: Any = None, partition: Any = None,
              spec: Any = None) -> Any:
    """The Iceberg ``DataFile`` (or, with ``equality_ids``, equality ``DeleteFile`` on those field ids) of the
    Parquet file at ``path``, its column metrics read from the file's ``footer`` (``metrics_config``: the table's
    ``MetricsConfig``, when the caller has it already), in ``partition`` of the table's spec (``spec``, when the
    caller has it) when given. One call into the JVM where pgcdc's jar is there (``pgcdc.iceberg.Files``), not a
    round trip per step of the builder."""
    classes = iceberg_classes()
    if metrics_config is None:
        metrics_config = classes.metrics_for_table(table)
    spec = spec if spec is not None else table.spec()
    ids = None
    if equality_ids is not None:
        gateway: Any = spark.sparkContext._gateway
        ids = gateway.new_array(gateway.jvm.int, len(equality_ids))
        for index, field_id in enumerate(equality_ids):
            ids[index] = field_id
    if classes.files is not None and (ids is None or partition is None):
        if ids is None:
            return classes.files.dataFile(spec, partition, path, size, bytearray(footer), metrics_config)
        return classes.files.equalityDeletes(spec, path, size, bytearray(footer), metrics_config, ids)
    metrics = footer_metrics(footer, metrics_config)
    if ids is None:
        builder = classes.data_file_builder(spec)
    else:
        builder = classes.delete_file_builder(spec).ofEqualityDeletes(ids)
    if partition is not None:
        builder = builder.withPartition(partition)
    return (builder.withPath(path).withFormat(classes.PARQUET).withFileSizeInBytes(size)
            .withMetrics(metrics).build())


def footer_metrics(footer: bytes, metrics_config: Any) -> Any:
    """Iceberg's column ``Metrics`` of a Parquet file whose writer holds its ``footer``
    (:func:`pgcdc.iceberg.parquet.parquet_footer`), as ``ParquetUtil.fileMetrics`` reads them from the file: that
    opens the file again, and builds Parquet's read options from a new Hadoop configuration, which parses Hadoop's
    default XML files and searches the whole class path for the site files each time (measured here: ~10 ms of the
    JVM's CPU a file, ~1 ms from the footer; a batch writes a file or two per mirror)."""
    classes = iceberg_classes()
    metadata = classes.FooterReader().readParquetMetadata(classes.BytesInput(bytearray(footer)))
    return classes.metrics_from_footer(metadata, classes.no_field_metrics(), metrics_config)


# Manifests a commit that removes files reads in its own thread, at most (about a millisecond each when small):
# beyond that, the worker pool's parallel reads outweigh its polling
MANIFESTS_READ_IN_TURN = 16


def steps_where_cheapest(operation: Any, table: Any, snapshot: Any, *, removes_files: bool) -> Any:
    """``operation`` (an Iceberg snapshot update of ``table`` at ``snapshot``) set to run its commit's steps
    (manifests filtered, merged, the manifest list written) in the calling thread, when that is cheaper than
    Iceberg's worker pool, whose caller polls its tasks every 10 ms: for a batch's commit, whose steps take a
    millisecond or two each, that polling was ~50 ms of sleep a batch, half its time. Only a commit that removes
    files reads the manifests that may list them, one after the other in the calling thread: on the pool's threads
    when there are many (a mirror not compacted for long)."""
    if steps_in_calling_thread(table, snapshot, removes_files):
        return operation.scanManifestsWith(iceberg_classes().in_calling_thread)
    return operation


def steps_in_calling_thread(table: Any, snapshot: Any, removes_files: bool, *, manifests: int | None = None) -> bool:
    """Whether a commit of ``table`` at ``snapshot`` runs its steps in the calling thread (steps_where_cheapest).
    ``manifests``: how many ``snapshot`` lists, when the caller knows (:class:`TableState`)."""
    if not removes_files or snapshot is None:
        return True
    if manifests is None:
        commits = iceberg_classes().commits
        manifests = commits.manifests(table, snapshot) if commits is not None else \
            java_count(snapshot.allManifests(table.io()))
    return manifests <= MANIFESTS_READ_IN_TURN


def replace_with_files(spark: SparkSession, table: Any, files: Iterable[tuple[str, int, bytes]],
                       properties: Mapping[str, str], table_properties: Mapping[str, str] | None = None) -> None:
    """One commit: every row of ``table`` replaced by the Parquet ``files`` (path, size in bytes, footer), with
    ``properties`` in the snapshot summary and ``table_properties`` set on the table in the same metadata commit.
    Column metrics come from each file's footer."""
    classes = iceberg_classes()
    current = table.currentSnapshot()
    transaction = table.newTransaction()
    overwrite = steps_where_cheapest(transaction.newOverwrite().overwriteByRowFilter(classes.always_true), table,
                                     current, removes_files=current is not None)
    metrics_config = classes.metrics_for_table(table)
    for path, size, footer in files:
        overwrite = overwrite.addFile(data_file(spark, table, path, size, footer, metrics_config=metrics_config))
    commit_in_transaction(transaction, overwrite, properties, table_properties)


def commit_in_transaction(transaction: Any, operation: Any, summary: Mapping[str, str],
                          table_properties: Mapping[str, str] | None) -> None:
    """``operation`` (of ``transaction``) committed with ``summary`` in its snapshot summary, then
    ``table_properties`` set, then the transaction: the snapshot and the properties land in one metadata file, or
    neither does."""
    for key, value in summary.items():
        operation = operation.set(str(key), str(value))
    operation.commit()
    if table_properties:
        update = transaction.updateProperties()
        for key, value in table_properties.items():
            update = update.set(str(key), str(value))
        update.commit()
    transaction.commitTransaction()


def create_table(spark: SparkSession, catalog: str, namespace: list[str], name: str, schema: StructType,
                 identifier_fields: list[str], partitioning: Iterable[tuple[str, str, int | None]],
                 properties: Mapping[str, str]) -> Any:
    """Iceberg's ``Table``, made in ``catalog`` (a Spark catalog name) as ``namespace.name`` with Spark's
    ``schema`` converted as Spark's DDL converts it (``SparkSchemaUtil``), ``identifier_fields``, a partition spec of
    (transform, column, width) fields and ``properties``: one call into the catalog, where ``CREATE TABLE`` and
    ``ALTER TABLE ... SET IDENTIFIER FIELDS`` cost Spark two statements to parse, analyse and run, and the table two
    metadata commits. Raises what Iceberg raises for a spec it refuses (``ValidationException``)."""
    jvm: Any = spark._jvm
    iceberg = jvm.org.apache.iceberg
    gateway: Any = spark.sparkContext._gateway
    converted = iceberg.spark.SparkSchemaUtil.convert(spark._jsparkSession.parseDataType(schema.json()))
    if identifier_fields:
        ids = jvm.java.util.HashSet()
        for field in identifier_fields:
            ids.add(converted.findField(field).fieldId())
        converted = iceberg.Schema(converted.columns(), ids)
    builder = iceberg.PartitionSpec.builderFor(converted)
    for transform, column, width in partitioning:
        if transform == "identity":
            builder = builder.identity(column)
        elif transform in ("bucket", "truncate"):
            builder = getattr(builder, transform)(column, width)
        else:  # year, month, day, hour
            builder = getattr(builder, transform)(column)
    levels = gateway.new_array(jvm.java.lang.String, len(namespace))
    for index, level in enumerate(namespace):
        levels[index] = level
    table_properties = jvm.java.util.HashMap()
    for key, value in properties.items():
        table_properties.put(str(key), str(value))
    identifier = iceberg.catalog.TableIdentifier.of(iceberg.catalog.Namespace.of(levels), name)
    return iceberg.spark.Spark3Util.loadIcebergCatalog(spark._jsparkSession, catalog).createTable(
        identifier, converted, builder.build(), table_properties)
