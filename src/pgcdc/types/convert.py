"""Rows of one relation (PostgreSQL text or binary format) to an Arrow record batch, column by column.

Each column converts as its type's kind (``kinds.py``: registered by the type families ``numeric``,
``temporal``, ``text`` and ``arrays``, sharing ``decoding``). A column's value bytes are gathered into
one Arrow array and parsed with vectorised Arrow casts or NumPy views of fixed-width binary values, or by
the optional C module (``_columns``) where Arrow has no kernel (integer arrays, numeric, uuid and jsonb in
binary); Python runs per value only where neither exists (bytea hex, intervals, other arrays) or for the
rare value a fast path defers (BC dates, infinity, NaN, unusual array forms).

Policies (also in docs/types.md):

- numeric(p, s) with p <= 38 → decimal(p, s); NaN in such a column is a ConversionError.
  Unconstrained numeric (and p > 38) → string holding PostgreSQL's text (NaN, Infinity
  included); with ``numeric='decimal38'`` → decimal(38, ``numeric_scale``), ConversionError on
  NaN, infinity or overflow. Never a float, never rounded.
- dates and timestamps: PostgreSQL's whole range, exactly (proleptic Gregorian, BC as negative years;
  never through Python's ``datetime``, which ends in 9999). date/timestamp ±infinity → the extremes of
  date32 / int64 microseconds, which no real value maps to, or a ConversionError with
  ``infinity='error'``. A timestamp past 294247-01-10 04:00:54.775806 (int64 microseconds since 1970
  end there) is a ConversionError on every path, never a wrapped value.
- time → int64 microseconds since midnight (Spark has no time type); timetz → its text
  ``HH:MM:SS[.ffffff]+HH[:MM]``; interval → struct(months, days, microseconds), exact; its ±infinity
  (PostgreSQL 17+) is every field at its extreme, as PostgreSQL itself keeps it.
- arrays → list of the element type; multi-dimensional arrays are flattened in row-major order;
  lower bounds other than 1 are not kept.
- enums, domains of text types, uuid, json, jsonb, money, inet, cidr, macaddr, bit, varbit,
  tsvector, ranges, composites, hstore and unknown types → string of PostgreSQL's text output. In
  binary mode those without a binary decoder here make ``requires_text_mode`` true: pgcdc then asks
  the server for text.
"""

from __future__ import annotations

import gc
import itertools
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from pgcdc.errors import ConversionError, TextValuesRequired, UnconvertibleValue
from pgcdc.lsn import Lsn
from pgcdc.pgoutput.messages import Relation, TupleData
from pgcdc.types import decoding
from pgcdc.types.decoding import ConversionOptions, Values
from pgcdc.types.kinds import column_kind
from pgcdc.types.registry import TypeRegistry

# -- the table converter ------------------------------------------------------------------------


@dataclass(frozen=True)
class ConvertedRows:
    """A batch of rows; ``unchanged`` marks unchanged TOAST values (null in ``batch`` but NOT null)."""

    batch: pa.RecordBatch
    unchanged: dict[str, pa.BooleanArray]


class TableConverter:
    """Converts the tuple data of one relation version to Arrow (see the module's policies).

    >>> converter = TableConverter(relation, TypeRegistry())      # doctest: +SKIP
    >>> converter.convert([insert.new for insert in inserts]).batch  # doctest: +SKIP
    """

    def __init__(self, relation: Relation, registry: TypeRegistry, options: ConversionOptions | None = None) -> None:
        self.relation = relation
        self.options = options or ConversionOptions()
        self.kinds = [column_kind(registry, c.type_oid, c.type_modifier, self.options) for c in relation.columns]
        self.arrow_schema = pa.schema([pa.field(c.name, k.arrow_type) for c, k in zip(relation.columns, self.kinds,
                                                                                     strict=True)])

    @property
    def requires_text_mode(self) -> bool:
        """True when a column has no binary decoder: stream this table in text mode."""
        return any(kind.binary is None for kind in self.kinds)

    def convert(self, rows: Sequence[TupleData], *, lsn: Lsn | None = None) -> ConvertedRows:
        # the conversion allocates per-value objects but no reference cycles: collecting during it is pure cost
        enabled = gc.isenabled()
        gc.disable()
        try:
            return self._convert(rows, lsn)
        finally:
            if enabled:
                gc.enable()

    def _convert(self, rows: Sequence[TupleData], lsn: Lsn | None) -> ConvertedRows:
        width = len(self.kinds)
        if not rows:
            return self.convert_columns([[] for _ in range(width)], binary=False, lsn=lsn)
        columns, column_kinds = self._split(rows, width, lsn)
        return self._convert_split(columns, [kinds.encode("ascii") for kinds in column_kinds], lsn)

    def convert_split(self, columns: Sequence[Values | pa.Array], kinds: Sequence[bytes], *,
                      lsn: Lsn | None = None) -> ConvertedRows:
        """Rows already split into columns: per column its values (a list of bytes or None, or an Arrow binary
        array, null where the kind is not 't' or 'b') and its kinds, one byte per row ('t', 'b', 'n', 'u')."""
        enabled = gc.isenabled()
        gc.disable()
        try:
            return self._convert_split(columns, kinds, lsn)
        finally:
            if enabled:
                gc.enable()

    def _convert_split(self, columns: Sequence[Values | pa.Array], column_kinds: Sequence[bytes],
                       lsn: Lsn | None) -> ConvertedRows:
        arrays = []
        unchanged: dict[str, pa.BooleanArray] = {}
        for index in range(len(self.kinds)):
            kinds = column_kinds[index]
            values = columns[index]
            binary = b"b" in kinds
            if binary and b"t" in kinds:
                raise ConversionError(f"{self._column(index)}: text and binary values mixed in one batch")
            if b"u" in kinds:
                mask = np.frombuffer(kinds, dtype="u1") == ord("u")
                unchanged[self.relation.columns[index].name] = pa.array(mask, pa.bool_())
            arrays.append(self._decode(index, values, binary, lsn))
        return ConvertedRows(pa.RecordBatch.from_arrays(arrays, schema=self.arrow_schema), unchanged)

    def _split(self, rows: Sequence[TupleData], width: int, lsn: Lsn | None) -> tuple[list[list], list[str]]:
        """Rows to columns: per column, its values and its kinds ('t', 'b', 'n', 'u'), without a Python loop
        per value."""
        if decoding.accelerator is not None:
            try:
                return decoding.accelerator.split_columns(rows, width)
            except ValueError:
                pass  # a row of the wrong width: found and named below
        for row in rows:
            if len(row.kinds) != width:
                raise ConversionError(f"{self._table}: a row has {len(row.kinds)} columns, the relation {width} "
                                      f"(at LSN {lsn})")
        # slicing one flat sequence (C speed)
        all_kinds = "".join([row.kinds for row in rows])
        all_values = list(itertools.chain.from_iterable([row.values for row in rows]))
        return [all_values[i::width] for i in range(width)], [all_kinds[i::width] for i in range(width)]

    def convert_columns(self, columns: Sequence[Values | pa.Array], *, binary: bool | Sequence[bool],
                        lsn: Lsn | None = None) -> ConvertedRows:
        """The same conversion fed column-wise (COPY output, catalog reads): per column, a list of values or an
        Arrow binary/string array of them; ``binary`` says their format, for all columns or for each."""
        formats = [binary] * len(columns) if isinstance(binary, bool) else list(binary)
        arrays = [self._decode(i, values, formats[i], lsn) for i, values in enumerate(columns)]
        return ConvertedRows(pa.RecordBatch.from_arrays(arrays, schema=self.arrow_schema), {})

    def _decode(self, index: int, values: Values, binary: bool, lsn: Lsn | None) -> pa.Array:
        kind = self.kinds[index]
        decoder = kind.binary if binary else kind.text
        if decoder is None:
            raise TextValuesRequired(f"{self._column(index)}: type {kind.type_name} has no binary decoder; stream "
                                     "this table in text mode (binary off)")
        if isinstance(values, pa.Array) and not getattr(decoder, "columnar", False):
            values = values.to_pylist()
        try:
            array = decoder(values)
        except (UnconvertibleValue, ValueError, struct.error, UnicodeDecodeError, pa.ArrowInvalid, OverflowError) as exc:
            where = "" if lsn is None else f" at LSN {lsn}"  # None: not from the stream (the snapshot's COPY)
            raise ConversionError(f"{self._column(index)} ({kind.type_name}, {'binary' if binary else 'text'})"
                                  f"{where}: {exc}") from None
        return array if array.type == kind.arrow_type else array.cast(kind.arrow_type)

    @property
    def _table(self) -> str:
        return self.relation.qualified_name

    def _column(self, index: int) -> str:
        return f"{self._table}.{self.relation.columns[index].name}"

