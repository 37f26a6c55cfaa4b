"""The catalogs pgcdc sets up, read without a JVM: which tables a namespace holds, and each one's metadata.

Spark's JVM takes seconds to start (tens on a loaded machine); what a start-up needs of the mirrors — their
positions, slots and consistent tags — is a few small metadata files. :func:`catalog_reader` reads them as
Iceberg's own catalogs find them, for the catalog types pgcdc configures:

- **hadoop** (a directory or a bucket): a table is a directory whose ``metadata`` directory holds
  ``*.metadata.json`` files; its current metadata is ``v<N>.metadata.json`` (or gzip's ``v<N>.gz.metadata.json``,
  ``v<N>.metadata.json.gz``), ``N`` read from ``version-hint.text`` (else the highest version listed), followed
  to the last ``v<N+1>`` that exists — ``HadoopTableOperations``' rules;
- **jdbc** on PostgreSQL: the ``metadata_location`` of the catalog's row in ``iceberg_tables``;
- **rest**: the ``metadata`` of the table's ``GET /v1/{prefix}/namespaces/{namespace}/tables/{table}``, with the
  catalog's bearer token and headers.

Metadata files are read from a local directory or from S3 with pyarrow (the same ``fs.s3a.*`` settings the
table's Hadoop FileIO uses, :func:`pgcdc.iceberg.locations.hadoop_s3_options`). Whatever else the settings name — a
catalog implementation or FileIO of its own, a JDBC database other than PostgreSQL, OAuth credentials, encryption,
another file system, Hadoop configuration files — is :class:`MetadataUnreadable`, and the caller reads through
Spark as before. Nothing here writes.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from typing import Any, Protocol

from pgcdc.errors import MetadataUnreadable
from pgcdc.iceberg.table_metadata import TableMetadata

SPARK_CATALOG = "org.apache.iceberg.spark.SparkCatalog"
HADOOP_FILE_IO = "org.apache.iceberg.hadoop.HadoopFileIO"
# how long a catalog or object store may take to answer one request before the start reads through Spark
REQUEST_SECONDS = 30.0
_VERSION_FILE = re.compile(r"v([^.]*)\..*")  # HadoopTableOperations.VERSION_PATTERN


class CatalogReader(Protocol):
    """A catalog's tables, read-only; ``storage``: where their files are read."""

    storage: Storage

    def namespaces(self, parent: tuple[str, ...]) -> list[tuple[str, ...]] | None:
        """The namespaces one level below ``parent`` (None: ``parent`` does not exist)."""
        ...

    def tables(self, namespace: tuple[str, ...]) -> list[str]: ...

    def load(self, namespace: tuple[str, ...], name: str) -> TableMetadata | None:
        """The table's current metadata (None: no such table)."""
        ...


def catalog_reader(catalog: str, settings: Mapping[str, str]) -> CatalogReader:
    """A reader of the Iceberg catalog ``catalog`` as Spark would configure it from ``settings`` (the session's
    whole configuration, :func:`pgcdc.spark.settings.spark_settings`); :class:`MetadataUnreadable` saying why
    when this process cannot read it by itself."""
    prefix = f"spark.sql.catalog.{catalog}"
    options = {key[len(prefix) + 1:]: value for key, value in settings.items() if key.startswith(prefix + ".")}
    if settings.get(prefix) != SPARK_CATALOG or "catalog-impl" in options:
        raise MetadataUnreadable(f"catalog {catalog!r} is not one of Iceberg's own SparkCatalog types")
    if options.get("io-impl", HADOOP_FILE_IO) != HADOOP_FILE_IO:
        raise MetadataUnreadable(f"catalog {catalog!r} reads its files with {options['io-impl']}")
    if any("encryption" in key for key in options):
        raise MetadataUnreadable(f"catalog {catalog!r} has encryption settings")
    if any("${" in value for value in settings.values()):
        raise MetadataUnreadable("a setting refers to a variable, which Hadoop expands and pgcdc does not")
    hadoop = {key.removeprefix("spark.hadoop."): value for key, value in settings.items()
              if key.startswith("spark.hadoop.")}
    hadoop.update({key.removeprefix("hadoop."): value for key, value in options.items() if key.startswith("hadoop.")})
    storage = Storage(hadoop)
    kind = options.get("type")
    if kind == "hadoop":
        warehouse = options.get("warehouse")
        if not warehouse:
            raise MetadataUnreadable(f"catalog {catalog!r} names no warehouse")
        return HadoopCatalogReader(warehouse.rstrip("/"), storage)
    if kind == "jdbc":
        return JdbcCatalogReader(catalog, options, storage)
    if kind == "rest":
        return RestCatalogReader(options, storage)
    raise MetadataUnreadable(f"catalog {catalog!r} is of type {kind!r}, which pgcdc reads through Spark only")


class Storage:
    """Files at ``file:`` and ``s3a://`` (``s3://``, ``s3n://``) locations, reached with the Hadoop settings
    ``hadoop`` (``fs.s3a.*``) the table's FileIO would use."""

    def __init__(self, hadoop: Mapping[str, str]) -> None:
        self._hadoop = dict(hadoop)
        self._s3: dict[str, Any] = {}  # per bucket: its pyarrow file system

    def read(self, location: str) -> bytes | None:
        """The file's bytes (None: it does not exist)."""
        filesystem, path = self._reach(location)
        if filesystem is None:
            try:
                with open(path, "rb") as file:
                    return file.read()
            except FileNotFoundError:
                return None
            except OSError as exc:
                raise MetadataUnreadable(f"{location}: {exc}") from None
        try:
            with filesystem.open_input_stream(path) as stream:
                return bytes(stream.read())
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise MetadataUnreadable(f"{location}: {exc}") from None

    def exists(self, location: str) -> bool:
        filesystem, path = self._reach(location)
        if filesystem is None:
            return os.path.exists(path)
        return self._info(filesystem, path, location).type.name != "NotFound"

    def is_directory(self, location: str) -> bool:
        filesystem, path = self._reach(location)
        if filesystem is None:
            return os.path.isdir(path)
        return self._info(filesystem, path, location).type.name == "Directory"

    def list(self, location: str) -> list[tuple[str, bool]] | None:
        """(name, is a directory) of each entry of the directory at ``location`` (None: there is none)."""
        filesystem, path = self._reach(location)
        if filesystem is None:
            try:
                with os.scandir(path) as entries:
                    return [(entry.name, entry.is_dir()) for entry in entries]
            except (FileNotFoundError, NotADirectoryError):
                return None
            except OSError as exc:
                raise MetadataUnreadable(f"{location}: {exc}") from None
        from pyarrow import fs

        try:
            infos = filesystem.get_file_info(fs.FileSelector(path, allow_not_found=True))
        except OSError as exc:
            raise MetadataUnreadable(f"{location}: {exc}") from None
        if not infos and not self.is_directory(location):
            return None
        return [(info.base_name, info.type == fs.FileType.Directory) for info in infos]

    def _info(self, filesystem: Any, path: str, location: str) -> Any:
        try:
            return filesystem.get_file_info(path)
        except OSError as exc:
            raise MetadataUnreadable(f"{location}: {exc}") from None

    def _reach(self, location: str) -> tuple[Any, str]:
        """(None, a local path) for a file of this machine, else (the pyarrow file system, its path there)."""
        from pgcdc.iceberg.locations import hadoop_s3_options, local_path, object_path

        path = local_path(location)
        if path is not None:
            return None, path
        scheme = location.split(":", 1)[0]
        if scheme not in ("s3a", "s3", "s3n"):
            raise MetadataUnreadable(f"{location}: pgcdc reads {scheme}:// locations through Spark only")
        if os.environ.get("HADOOP_CONF_DIR") or os.environ.get("YARN_CONF_DIR"):
            raise MetadataUnreadable("Hadoop configuration files may hold s3a settings (HADOOP_CONF_DIR)")
        bucket = object_path(location).split("/", 1)[0]
        filesystem = self._s3.get(bucket)
        if filesystem is None:
            options = hadoop_s3_options(location, self._hadoop.get)
            if options is None:
                raise MetadataUnreadable(f"{location}: its credentials come from a provider pyarrow cannot use")
            from pyarrow import fs

            options.setdefault("connect_timeout", REQUEST_SECONDS)
            options.setdefault("request_timeout", REQUEST_SECONDS)
            filesystem = self._s3[bucket] = fs.S3FileSystem(**options)
        return filesystem, object_path(location)


class HadoopCatalogReader:
    """Iceberg's Hadoop catalog: tables are directories of the warehouse (``HadoopCatalog``)."""

    def __init__(self, warehouse: str, storage: Storage) -> None:
        self.warehouse = warehouse
        self.storage = storage

    def _location(self, namespace: tuple[str, ...], name: str | None = None) -> str:
        return "/".join([self.warehouse, *namespace, *([name] if name is not None else [])])

    def _is_table(self, location: str) -> bool:
        entries = self.storage.list(location + "/metadata") or []
        return any(entry.endswith(".metadata.json") for entry, _ in entries)

    def namespaces(self, parent: tuple[str, ...]) -> list[tuple[str, ...]] | None:
        location = self._location(parent)
        if not self.storage.is_directory(location) or self._is_table(location):
            return None
        return [(*parent, name) for name, directory in self.storage.list(location) or []
                if directory and not self._is_table(f"{location}/{name}")]

    def tables(self, namespace: tuple[str, ...]) -> list[str]:
        location = self._location(namespace)
        return [name for name, directory in self.storage.list(location) or []
                if directory and self._is_table(f"{location}/{name}")]

    def load(self, namespace: tuple[str, ...], name: str) -> TableMetadata | None:
        metadata = self._location(namespace, name) + "/metadata"
        version = self._hinted_version(metadata)
        current = self._version_file(metadata, version)
        if current is None:
            if version == 0:
                return None  # no v0 metadata: the table does not exist
            raise MetadataUnreadable(f"{metadata}: the metadata file of version {version} is missing")
        while (following := self._version_file(metadata, version + 1)) is not None:
            version, current = version + 1, following
        data = self.storage.read(current)
        if data is None:  # replaced by a commit meanwhile: the JVM reads it again, as it would retry
            raise MetadataUnreadable(f"{current} disappeared while read")
        return TableMetadata.parse(data, current)

    def _hinted_version(self, metadata: str) -> int:
        """``version-hint.text``'s number; when it cannot be read, the highest version listed (0: none)."""
        hint = self.storage.read(metadata + "/version-hint.text")
        if hint is not None:
            with contextlib.suppress(ValueError, UnicodeDecodeError):
                return int(hint.decode().splitlines()[0])
        entries = self.storage.list(metadata)
        if entries is None:
            return 0
        versions = [0]
        for name, _ in entries:
            match = _VERSION_FILE.fullmatch(name)
            if match:
                with contextlib.suppress(ValueError):
                    versions.append(int(match.group(1)))
        return max(versions)

    def _version_file(self, metadata: str, version: int) -> str | None:
        for suffix in (".metadata.json", ".gz.metadata.json", ".metadata.json.gz"):
            location = f"{metadata}/v{version}{suffix}"
            if self.storage.exists(location):
                return location
        return None


# JDBC connection properties of PostgreSQL's driver that libpq takes under another name (or the same); any other
# property the catalog passes to the driver makes its connection one this process does not reproduce
_LIBPQ_NAMES = {"user": "user", "password": "password", "sslmode": "sslmode", "sslrootcert": "sslrootcert",
                "sslcert": "sslcert", "sslkey": "sslkey", "connectTimeout": "connect_timeout",
                "ApplicationName": "application_name"}
# the JDBC catalog's own settings, which are not driver properties
_JDBC_CATALOG_SETTINGS = ("jdbc.schema-version", "jdbc.init-catalog-tables", "jdbc.strict-mode")


class JdbcCatalogReader:
    """Iceberg's JDBC catalog on PostgreSQL: each table's row in ``iceberg_tables`` names its current metadata
    file (``JdbcCatalog``, its namespaces written dot-joined)."""

    def __init__(self, catalog: str, options: Mapping[str, str], storage: Storage) -> None:
        self.catalog = catalog
        self.storage = storage
        self.conninfo = self._conninfo(options.get("uri", ""), options)  # libpq's keywords

    @staticmethod
    def _conninfo(uri: str, options: Mapping[str, str]) -> dict[str, str]:
        match = re.fullmatch(r"jdbc:postgresql://([^/:?,\[\]]+)(?::(\d+))?/([^?]*)(?:\?(.*))?", uri)
        if match is None:
            raise MetadataUnreadable(f"the JDBC catalog's database {uri!r} is not a PostgreSQL database at one host")
        host, port, dbname, query = match.groups()
        properties = dict(urllib.parse.parse_qsl(query or "", keep_blank_values=True))
        properties.update({key.removeprefix("jdbc."): value for key, value in options.items()
                           if key.startswith("jdbc.") and key not in _JDBC_CATALOG_SETTINGS})
        ssl = properties.pop("ssl", None)
        if ssl is not None:  # PostgreSQL's driver: ssl=true verifies the server fully unless sslmode says otherwise
            properties.setdefault("sslmode", "verify-full" if ssl.lower() == "true" else "disable")
        unknown = sorted(set(properties) - set(_LIBPQ_NAMES))
        if unknown:
            raise MetadataUnreadable(f"the JDBC catalog's connection sets {', '.join(unknown)}")
        conninfo = {"host": host, "port": port or "5432", "dbname": urllib.parse.unquote(dbname),
                    "connect_timeout": str(int(REQUEST_SECONDS))}
        conninfo.update({_LIBPQ_NAMES[key]: value for key, value in properties.items()})
        return conninfo

    def _rows(self, query: str, params: tuple) -> list[tuple]:
        import psycopg

        try:
            with psycopg.connect(psycopg.conninfo.make_conninfo(**self.conninfo), autocommit=True) as conn:
                conn.execute(f"SET statement_timeout = {int(REQUEST_SECONDS * 1000)}")
                typed = conn.execute("SELECT 1 FROM information_schema.columns WHERE table_name = 'iceberg_tables' "
                                     "AND column_name = 'iceberg_type' AND table_schema = ANY(current_schemas(false))"
                                     ).fetchone() is not None
                return conn.execute(query.format(tables_only="AND (iceberg_type = 'TABLE' OR iceberg_type IS NULL)"
                                                 if typed else ""), params).fetchall()
        except psycopg.Error as exc:
            raise MetadataUnreadable(f"the JDBC catalog's database: {' '.join(str(exc).split())}") from None

    def namespaces(self, parent: tuple[str, ...]) -> list[tuple[str, ...]] | None:
        joined = ".".join(parent)
        pattern = re.sub(r"([\\%_])", r"\\\1", joined) + ".%"
        rows = self._rows("SELECT DISTINCT table_namespace FROM iceberg_tables WHERE catalog_name = %s "
                          "AND (table_namespace = %s OR table_namespace LIKE %s) {tables_only}",
                          (self.catalog, joined, pattern))
        below = [str(namespace)[len(joined) + 1:] for (namespace,) in rows if str(namespace) != joined]
        if any("." in name for name in below):
            # Iceberg's listing splits names at every dot: a namespace holding one is listed otherwise by the JVM
            raise MetadataUnreadable(f"namespaces below {joined!r} hold dots in their names")
        if not rows:  # namespaces made without tables are recorded elsewhere: ask the JVM when there is no table
            raise MetadataUnreadable(f"the JDBC catalog holds no table below {joined!r}")
        return [(*parent, name) for name in sorted(set(below))]

    def tables(self, namespace: tuple[str, ...]) -> list[str]:
        rows = self._rows("SELECT table_name FROM iceberg_tables WHERE catalog_name = %s AND table_namespace = %s "
                          "{tables_only}", (self.catalog, ".".join(namespace)))
        return sorted(str(name) for (name,) in rows)

    def load(self, namespace: tuple[str, ...], name: str) -> TableMetadata | None:
        rows = self._rows("SELECT metadata_location FROM iceberg_tables WHERE catalog_name = %s "
                          "AND table_namespace = %s AND table_name = %s {tables_only}",
                          (self.catalog, ".".join(namespace), name))
        if not rows:
            return None
        location = str(rows[0][0])
        data = self.storage.read(location)
        if data is None:
            raise MetadataUnreadable(f"{location}, the catalog's metadata file of {'.'.join([*namespace, name])}, "
                                     "is missing")
        return TableMetadata.parse(data, location)


class RestCatalogReader:
    """An Iceberg REST catalog, asked as Iceberg's ``RESTSessionCatalog`` asks it: its configuration first (which
    may set the path ``prefix``), then namespaces, tables and their metadata, with its bearer token."""

    def __init__(self, options: Mapping[str, str], storage: Storage) -> None:
        self.storage = storage
        uri = options.get("uri", "")
        if not uri.startswith(("http://", "https://")):
            raise MetadataUnreadable(f"the REST catalog's address {uri!r} is not http(s)")
        if options.get("credential") and not options.get("token"):
            raise MetadataUnreadable("the REST catalog authenticates with OAuth2 credentials")
        if any(key.startswith(("rest.sigv4", "rest.auth")) for key in options):
            raise MetadataUnreadable("the REST catalog signs its requests")
        self.uri = uri.rstrip("/")
        self.options = dict(options)
        config = self._get("v1/config", {"warehouse": options["warehouse"]} if options.get("warehouse") else {})
        merged = {**(config.get("defaults") or {}), **self.options, **(config.get("overrides") or {})}
        self.uri = str(merged.get("uri", self.uri)).rstrip("/")
        self.options = {str(k): str(v) for k, v in merged.items()}
        prefix = self.options.get("prefix")
        self.base = f"v1/{prefix.strip('/')}" if prefix else "v1"

    def _headers(self) -> dict[str, str]:
        headers = {key.removeprefix("header."): value for key, value in self.options.items()
                   if key.startswith("header.")}
        headers.setdefault("Accept", "application/json")
        if self.options.get("token"):
            headers["Authorization"] = f"Bearer {self.options['token']}"
        return headers

    def _get(self, path: str, query: Mapping[str, str] | None = None) -> dict[str, Any]:
        """The JSON answer to ``GET path``; {} for 404 (no such namespace or table)."""
        url = f"{self.uri}/{path}" + (f"?{urllib.parse.urlencode(query)}" if query else "")
        request = urllib.request.Request(url, headers=self._headers())
        try:
            with urllib.request.urlopen(request, timeout=REQUEST_SECONDS) as response:
                answer = json.loads(response.read())
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return {}
            raise MetadataUnreadable(f"the REST catalog answered {exc.code} to GET {path}") from None
        except (OSError, ValueError) as exc:
            raise MetadataUnreadable(f"the REST catalog did not answer GET {path}: {exc}") from None
        if not isinstance(answer, dict):
            raise MetadataUnreadable(f"the REST catalog's answer to GET {path} is not an object")
        return answer

    @staticmethod
    def _encoded(namespace: tuple[str, ...]) -> str:
        return "%1F".join(urllib.parse.quote_plus(level, safe="*") for level in namespace)

    def _pages(self, path: str, key: str, query: Mapping[str, str]) -> list[Any] | None:
        items: list[Any] = []
        token = None
        while True:
            answer = self._get(path, {**query, **({"pageToken": token} if token else {})})
            if key not in answer:  # 404: no such namespace
                return items or None
            items += answer[key] or []
            token = answer.get("next-page-token")
            if not token:
                return items

    def namespaces(self, parent: tuple[str, ...]) -> list[tuple[str, ...]] | None:
        if not self._get(f"{self.base}/namespaces/{self._encoded(parent)}"):
            return None
        found = self._pages(f"{self.base}/namespaces", "namespaces", {"parent": "\x1f".join(parent)})
        return [tuple(str(level) for level in namespace) for namespace in found or []]

    def tables(self, namespace: tuple[str, ...]) -> list[str]:
        found = self._pages(f"{self.base}/namespaces/{self._encoded(namespace)}/tables", "identifiers", {})
        return [str(identifier["name"]) for identifier in found or []]

    def load(self, namespace: tuple[str, ...], name: str) -> TableMetadata | None:
        answer = self._get(f"{self.base}/namespaces/{self._encoded(namespace)}/tables/"
                           f"{urllib.parse.quote_plus(name, safe='*')}")
        if not answer:
            return None
        metadata = answer.get("metadata")
        if not isinstance(metadata, dict):
            raise MetadataUnreadable(f"the REST catalog's table {'.'.join([*namespace, name])} came without metadata")
        return TableMetadata(metadata, str(answer.get("metadata-location")))
