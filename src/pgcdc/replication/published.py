"""What a publication publishes, read from the source's catalog, in the shape of pgoutput Relation messages.

The initial snapshot needs each table's columns before the stream has sent a single
Relation message; describing them as :class:`~pgcdc.pgoutput.Relation` lets the copy
and the stream share one converter and one mirror schema.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import psycopg

from pgcdc.errors import ConfigError, ProtocolError
from pgcdc.lsn import Lsn
from pgcdc.pgoutput.messages import (
    REPLICA_IDENTITY_DEFAULT,
    REPLICA_IDENTITY_FULL,
    REPLICA_IDENTITY_INDEX,
    Column,
    Relation,
)
from pgcdc.replication.options import quote_ident

log = logging.getLogger("pgcdc.replication")

# PostgreSQL 15+ says which columns and rows a publication publishes of each table (its column list, or every
# column it sends: generated ones too where the publication publishes them; its row filter, already combined
# as pgoutput applies it: none where the table is also published whole, by schema or FOR ALL TABLES).
_TABLES_SQL = """
SELECT c.oid, n.nspname, c.relname, c.relreplident::text,
       COALESCE(c.relpages, 0)::bigint, GREATEST(c.reltuples, 0)::bigint, c.relkind = 'p', {published}
FROM pg_publication_tables pt
JOIN pg_namespace n ON n.nspname = pt.schemaname
JOIN pg_class c ON c.relnamespace = n.oid AND c.relname = pt.tablename
WHERE pt.pubname = %s
ORDER BY n.nspname, c.relname
"""
_PUBLISHED_SINCE_15 = "pt.attnames, pt.rowfilter"
_PUBLISHED_BEFORE_15 = "NULL::name[], NULL::text"

# Columns of a table, without dropped ones, in the order pgoutput sends them; key flags follow the replica
# identity: the identity index's columns, or every column under FULL.
_COLUMNS_SQL = """
SELECT a.attname, a.atttypid::bigint, a.atttypmod,
       CASE
         WHEN c.relreplident = 'f' THEN true
         WHEN c.relreplident = 'n' THEN false
         ELSE EXISTS (
           SELECT 1 FROM pg_index i
           WHERE i.indrelid = c.oid AND a.attnum = ANY(i.indkey)
             AND ((c.relreplident = 'd' AND i.indisprimary) OR (c.relreplident = 'i' AND i.indisreplident)))
       END AS is_key,
       a.attgenerated <> '' AS generated
FROM pg_attribute a
JOIN pg_class c ON c.oid = a.attrelid
WHERE a.attrelid = %s AND a.attnum > 0 AND NOT a.attisdropped
ORDER BY a.attnum
"""


# What the catalog tells of a table's storage that Relation messages do not: the files holding its rows (its
# partitions' for a partitioned table; a rewrite gives them new file numbers), its columns' numbers (a column
# dropped and added again under its name gets a new one), and the definitions its values print through (the
# labels of the enums and the attributes of the composites its columns hold, through arrays and domains): an
# enum value renamed or an attribute added changes the text of rows no change was decoded for; and a
# partitioned table's partitions, each with whether it holds rows (ATTACH and DETACH PARTITION, or a partition
# dropped, bring or take rows with no change decoded).
_STORAGE_SQL = """
SELECT c.oid::bigint,
       ARRAY(SELECT pg_relation_filenode(t.relid)::bigint
             FROM (SELECT c.oid::regclass AS relid UNION SELECT p.relid FROM {tree} p) t
             WHERE pg_relation_filenode(t.relid) IS NOT NULL ORDER BY t.relid::oid),
       ARRAY(SELECT a.attname::text FROM pg_attribute a
             WHERE a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped ORDER BY a.attnum),
       ARRAY(SELECT a.attnum::int FROM pg_attribute a
             WHERE a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped ORDER BY a.attnum),
       ARRAY(WITH RECURSIVE used(oid) AS (
               SELECT a.atttypid FROM pg_attribute a
               WHERE a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped AND a.atttypid >= 16384
             UNION
               SELECT part.oid FROM used u JOIN pg_type t ON t.oid = u.oid
               CROSS JOIN LATERAL (SELECT t.typelem UNION ALL SELECT t.typbasetype
                                   UNION ALL SELECT a.atttypid FROM pg_attribute a
                                   WHERE t.typtype = 'c' AND a.attrelid = t.typrelid AND a.attnum > 0
                                     AND NOT a.attisdropped) part(oid)
               WHERE part.oid >= 16384)
             SELECT fact FROM (
               SELECT 'enum ' || e.enumtypid || ' ' || e.oid || ' ' || e.enumlabel
               FROM used JOIN pg_enum e ON e.enumtypid = used.oid
               UNION ALL
               SELECT 'composite ' || t.oid || ' ' || a.attnum || ' ' || a.atttypid || ' ' || a.atttypmod
               FROM used JOIN pg_type t ON t.oid = used.oid AND t.typtype = 'c'
               JOIN pg_attribute a ON a.attrelid = t.typrelid AND a.attnum > 0 AND NOT a.attisdropped) f(fact)
             ORDER BY fact),
       ARRAY(SELECT t.relid::oid::bigint || ' ' || (pg_relation_size(t.relid) > 0)::int
             FROM {tree} t WHERE t.isleaf AND t.relid::oid <> c.oid ORDER BY t.relid::oid)
FROM pg_class c
WHERE c.oid = ANY(%s)
"""


# How the publication publishes each table (PostgreSQL 15+): its explicit column list (None: every column,
# which ADD COLUMN extends), its row filter as pgoutput combines them, and the catalog rows that make it a
# member (FOR TABLE, FOR TABLES IN SCHEMA; none for FOR ALL TABLES), which a table taken out of the
# publication and put back gets anew. A change of any gives the mirror rows or values the stream never sent.
_DEFINITION_SQL = """
SELECT c.oid::bigint,
       CASE WHEN EXISTS (SELECT 1 FROM pg_publication_rel pr JOIN pg_publication p ON p.oid = pr.prpubid
                         WHERE p.pubname = pt.pubname AND pr.prrelid = c.oid AND pr.prattrs IS NOT NULL)
            THEN pt.attnames::text[] END,
       pt.rowfilter,
       concat_ws(' ',
                 (SELECT 'table ' || pr.oid FROM pg_publication_rel pr JOIN pg_publication p ON p.oid = pr.prpubid
                  WHERE p.pubname = pt.pubname AND pr.prrelid = c.oid),
                 (SELECT 'schema ' || pn.oid FROM pg_publication_namespace pn
                  JOIN pg_publication p ON p.oid = pn.pnpubid WHERE p.pubname = pt.pubname AND pn.pnnspid = n.oid))
FROM pg_publication_tables pt
JOIN pg_namespace n ON n.nspname = pt.schemaname
JOIN pg_class c ON c.relnamespace = n.oid AND c.relname = pt.tablename
WHERE pt.pubname = %s AND c.oid = ANY(%s)
"""


@dataclass(frozen=True)
class TableStorage:
    """A table's file numbers (its partitions' too), its columns' numbers and the definitions of the enums and
    composites its values print through (``printed_types``), as the catalog has them now, and
    how the publication publishes it: ``definition`` is (its explicit column list or None, its row filter or
    None, its membership rows), itself None where the server cannot tell (before PostgreSQL 15) or was not
    asked."""

    filenodes: tuple[int, ...]
    attnums: tuple[tuple[str, int], ...]
    definition: tuple[tuple[str, ...] | None, str | None, str] | None = None
    # "enum <type> <value oid> <label>", "composite <type> <attnum> <type> <typmod>"
    printed_types: tuple[str, ...] = ()
    partitions: tuple[tuple[int, bool], ...] = ()  # (OID, holds rows) of each leaf of a partitioned table


def table_storage(conn: psycopg.Connection, relation_ids: list[int],
                  publication: str | None = None) -> dict[int, TableStorage]:
    """The storage of each table of ``relation_ids`` that exists (with its definition in ``publication``)."""
    if not relation_ids:
        return {}
    definitions: dict[int, tuple[tuple[str, ...] | None, str | None, str]] = {}
    if publication is not None and conn.info.server_version >= 150000:
        definitions = {oid: (None if columns is None else tuple(columns), row_filter, member)
                       for oid, columns, row_filter, member in conn.execute(
                           _DEFINITION_SQL, (publication, relation_ids)).fetchall()}
    # pg_partition_tree came with PostgreSQL 12; before 13 no publication holds a partitioned table anyway
    tree = ("pg_partition_tree(c.oid)" if conn.info.server_version >= 120000
            else "(SELECT c.oid::regclass AS relid, true AS isleaf WHERE false)")
    return {oid: TableStorage(tuple(filenodes), tuple(zip(names, numbers, strict=True)),
                              definitions.get(oid) if publication is not None else None, tuple(printed),
                              tuple((int(leaf.split()[0]), leaf.split()[1] == "1") for leaf in leaves))
            for oid, filenodes, names, numbers, printed, leaves in conn.execute(
                _STORAGE_SQL.format(tree=tree), (relation_ids,)).fetchall()}


def holds_rows_from_before_it_joined(conn: psycopg.Connection, partition_id: int) -> bool:
    """Whether a partition holds rows written before it became one (ATTACH PARTITION of a filled table: its
    ``pg_class`` row was rewritten then, after those rows), which were never decoded as the root's; rows
    inserted since it was created as a partition are younger than its catalog row. Reads the partition until
    the first such row: asked once, of a partition pgcdc has not seen before."""
    row = conn.execute("SELECT %s::oid::regclass::text, age(xmin) FROM pg_class WHERE oid = %s",
                       (partition_id, partition_id)).fetchone()
    if row is None:  # gone since
        return False
    name, joined_age = row
    older = conn.execute(f"SELECT EXISTS (SELECT 1 FROM ONLY {name} WHERE age(xmin) > %s)", (joined_age,)).fetchone()
    return bool(older and older[0])


@dataclass(frozen=True)
class PublishedTable:
    relation: Relation
    estimated_rows: int
    pages: int
    row_filter: str | None = None  # the publication's WHERE for this table, as PostgreSQL prints it
    partitioned: bool = False  # its rows are its partitions' (published through the root); else its own alone
    storage: TableStorage | None = None  # read before any copy of it starts

    @property
    def schema(self) -> str:
        return self.relation.namespace

    @property
    def name(self) -> str:
        return self.relation.name


def published_tables(conn: psycopg.Connection, publication: str) -> list[PublishedTable]:
    """The tables ``publication`` publishes, each described as the Relation message pgoutput would send, with
    the row filter it applies (a copy of the table holds only the rows the stream would send)."""
    exists = conn.execute("SELECT 1 FROM pg_publication WHERE pubname = %s", (publication,)).fetchone()
    if exists is None:
        raise ConfigError(f"publication {publication!r} does not exist; create it with "
                          f"CREATE PUBLICATION {quote_ident(publication)} FOR TABLE ... (or FOR ALL TABLES)")
    published = _PUBLISHED_SINCE_15 if conn.info.server_version >= 150000 else _PUBLISHED_BEFORE_15
    tables = []
    for oid, namespace, name, identity, pages, rows, partitioned, attnames, row_filter in conn.execute(
            _TABLES_SQL.format(published=published), (publication,)).fetchall():
        sent = set(attnames) if attnames is not None else None
        columns = tuple(
            Column(1 if is_key else 0, attname, type_oid, typmod)
            for attname, type_oid, typmod, is_key, generated in conn.execute(_COLUMNS_SQL, (oid,)).fetchall()
            if (attname in sent if sent is not None else not generated)
        )
        if not columns:  # CREATE TABLE z (): nothing a mirror could hold (the stream passes its changes over)
            log.warning("%s.%s has no published columns: it is not mirrored until it has one", namespace, name)
            continue
        tables.append(PublishedTable(Relation(None, oid, namespace, name, identity, columns), rows, pages,
                                     row_filter, partitioned))
    storage = table_storage(conn, [t.relation.relation_id for t in tables], publication)
    return [replace(t, storage=storage.get(t.relation.relation_id)) for t in tables]


def primary_key(conn: psycopg.Connection, relation_id: int) -> tuple[str, ...]:
    """The primary key's columns of a table, in the key's order (empty without one)."""
    row = conn.execute(
        "SELECT array_agg(a.attname ORDER BY array_position(i.indkey, a.attnum)) "
        "FROM pg_index i JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey) "
        "WHERE i.indrelid = %s AND i.indisprimary", (relation_id,)).fetchone()
    return tuple(row[0]) if row and row[0] else ()


@dataclass(frozen=True)
class AddedColumn:
    """What PostgreSQL gives the rows that existed when a column was added: ``missing_text`` is the value the
    catalog records for them (``pg_attribute.attmissingval``, a non-volatile default, as text); without one,
    ``has_default`` tells a table rewritten with a volatile default (its rows' values were never decoded)
    from a plain ADD COLUMN (NULL, which the mirror already holds)."""

    name: str
    missing_text: str | None
    has_default: bool


def added_columns(conn: psycopg.Connection, relation_id: int, names: list[str]) -> dict[str, AddedColumn]:
    """The catalog's word on columns the stream shows as new (absent: dropped since, nothing to give)."""
    rows = conn.execute(
        "SELECT a.attname, a.atthasmissing, a.attmissingval::text, d.adrelid IS NOT NULL "
        "FROM pg_attribute a LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum "
        "WHERE a.attrelid = %s AND a.attname = ANY(%s) AND a.attnum > 0 AND NOT a.attisdropped",
        (relation_id, names)).fetchall()
    return {name: AddedColumn(name, _single_element(missing) if has_missing else None, bool(has_default))
            for name, has_missing, missing, has_default in rows}


def _single_element(array_text: str | None) -> str | None:
    """The one element of ``attmissingval``'s text form (``{5}``, ``{"a \\"b\\""}``), unquoted; None for NULL."""
    if array_text is None or not array_text.startswith("{") or not array_text.endswith("}"):
        raise ProtocolError(f"pg_attribute.attmissingval {array_text!r} is not a one-element array")
    inner = array_text[1:-1]
    if not inner.startswith('"'):
        return None if inner == "NULL" else inner
    out, escaped = [], False
    for char in inner[1:-1]:
        if escaped or char != "\\":
            out.append(char)
            escaped = False
        else:
            escaped = True
    return "".join(out)


def identity_key(relation: Relation, primary: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The mirror's key: what the server sends as a row's identity. The flagged columns under REPLICA IDENTITY
    DEFAULT (the primary key) and USING INDEX (the index's columns); under FULL, where every column is flagged and
    the old row comes whole, the ``primary`` key when it is published, else none (rows match on every column);
    none under NOTHING."""
    if relation.replica_identity in (REPLICA_IDENTITY_DEFAULT, REPLICA_IDENTITY_INDEX):
        return tuple(c.name for c in relation.key_columns)
    if relation.replica_identity == REPLICA_IDENTITY_FULL and primary and set(primary) <= {c.name for c in relation.columns}:
        return primary
    return ()


def server_lsn(conn: psycopg.Connection) -> Lsn:
    """The server's current WAL write position."""
    row = conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()
    assert row is not None
    return Lsn.parse(row[0])


def two_phase_by_default(conn: psycopg.Connection) -> bool:
    """Whether a new slot decodes prepared transactions when not told: where the server can (PostgreSQL 15+)."""
    return conn.info.server_version >= 150000
