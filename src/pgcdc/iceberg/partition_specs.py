"""Iceberg partition specs as users write them (``--partition-by``) and as Iceberg writes them (a spec's JSON):
which transform of which column makes each partition field, and the type of its values. The values of rows are
computed in :mod:`pgcdc.iceberg.partition_values`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

# -- what a user writes ---------------------------------------------------------------------------------------

_NAMES = {"identity": "identity", "year": "year", "years": "year", "month": "month", "months": "month",
          "day": "day", "days": "day", "date": "day", "hour": "hour", "hours": "hour", "date_hour": "hour",
          "bucket": "bucket", "truncate": "truncate"}
_CALL = re.compile(r"^\s*([A-Za-z_]+)\s*\((.*)\)\s*$", re.S)
_COLUMN = re.compile(r'^\s*(?:"((?:[^"]|"")+)"|`((?:[^`]|``)+)`|([A-Za-z_][A-Za-z0-9_$]*))\s*$')


@dataclass(frozen=True)
class PartitionTransform:
    """One field of a partition spec as a user names it: ``transform`` (identity, year, month, day, hour, bucket
    or truncate) of ``column``, with ``width`` for bucket (the number of buckets) and truncate (the width)."""

    transform: str
    column: str
    width: int | None = None

    def ddl(self) -> str:
        """The field in Spark's ``PARTITIONED BY`` (Iceberg's Spark DDL)."""
        column = "`" + self.column.replace("`", "``") + "`"
        if self.transform == "identity":
            return column
        if self.width is not None:
            return f"{self.transform}({self.width}, {column})"
        return f"{self.transform}s({column})"

    def __str__(self) -> str:
        if self.transform == "identity":
            return self.column
        return f"{self.transform}({self.width}, {self.column})" if self.width is not None else \
            f"{self.transform}({self.column})"


class PartitionSyntaxError(ValueError):
    """A partition transform that cannot be read."""


def parse_transform(text: str) -> PartitionTransform:
    """A transform as ``--partition-by`` takes it: ``column``, ``identity(column)``, ``years(column)`` (or
    ``year``), ``months``/``month``, ``days``/``day``/``date``, ``hours``/``hour``/``date_hour``,
    ``bucket(N, column)``, ``truncate(W, column)`` (or ``truncate(column, W)``); a column named in double quotes
    or backticks when it is not a plain name."""
    column = _column(text)
    if column is not None:
        return PartitionTransform("identity", column)
    call = _CALL.match(text)
    if call is None or call.group(1).lower() not in _NAMES:
        raise PartitionSyntaxError(f"{text.strip()!r} is not a partition transform: use a column, identity(c), "
                                   "years(c), months(c), days(c), hours(c), bucket(N, c) or truncate(W, c)")
    name = _NAMES[call.group(1).lower()]
    arguments = _arguments(call.group(2))
    if name in ("bucket", "truncate"):
        if len(arguments) == 2:
            first, second = arguments
            width_text, column_text = (first, second) if first.strip().isdigit() else (second, first)
            column = _column(column_text)
            if width_text.strip().isdigit() and column is not None:
                width = int(width_text)
                if width < 1 or width > 2**31 - 1:
                    raise PartitionSyntaxError(f"{text.strip()!r}: {name} takes a width of 1 to 2147483647")
                return PartitionTransform(name, column, width)
        raise PartitionSyntaxError(f"{text.strip()!r}: {name} takes a number and a column, e.g. {name}(16, id)")
    column = _column(arguments[0]) if len(arguments) == 1 else None
    if column is None:
        raise PartitionSyntaxError(f"{text.strip()!r}: {call.group(1)} takes one column, e.g. {call.group(1)}(c)")
    return PartitionTransform(name, column)


def parse_transforms(text: str) -> list[PartitionTransform]:
    """Transforms separated by commas (commas inside parentheses or quotes belong to their transform)."""
    parts = [part for part in _arguments(text) if part.strip()]
    if not parts:
        raise PartitionSyntaxError("no partition transform given")
    transforms = [parse_transform(part) for part in parts]
    seen: set[tuple[str, str]] = set()
    for transform in transforms:
        if (transform.transform, transform.column) in seen:
            raise PartitionSyntaxError(f"{transform} is given twice")
        seen.add((transform.transform, transform.column))
    return transforms


def _column(text: str) -> str | None:
    match = _COLUMN.match(text)
    if match is None:
        return None
    quoted, ticked, plain = match.groups()
    return quoted.replace('""', '"') if quoted is not None else ticked.replace("``", "`") if ticked is not None \
        else plain


def _arguments(text: str) -> list[str]:
    """``text`` split at the commas outside parentheses and quotes."""
    parts: list[str] = []
    current: list[str] = []
    depth, quote = 0, None
    for char in text:
        if quote is not None:
            quote = None if char == quote else quote
        elif char in "\"`":
            quote = char
        elif char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
        elif char == "," and depth == 0:
            parts.append("".join(current))
            current = []
            continue
        current.append(char)
    parts.append("".join(current))
    return parts


# -- a table's spec, as Iceberg wrote it ----------------------------------------------------------------------


@dataclass(frozen=True)
class PartitionField:
    """A field of a table's partition spec: its name, its transform as Iceberg writes it (``identity``,
    ``bucket[16]``, ``day``...), its source column and that column's Iceberg type, and the Iceberg type of the
    partition value."""

    name: str
    transform: str
    source: str
    source_type: str
    result_type: str


    def as_given(self) -> PartitionTransform:
        """The field as ``--partition-by`` would name it."""
        for kind in ("bucket", "truncate"):
            if self.transform.startswith(f"{kind}["):
                return PartitionTransform(kind, self.source, int(self.transform[len(kind) + 1:-1]))
        return PartitionTransform(self.transform, self.source)


class UnsupportedPartitioning(ValueError):
    """A partition spec this module cannot compute (a source column inside a struct, an unknown transform)."""


def spec_fields(spec: dict[str, Any], schema: dict[str, Any]) -> list[PartitionField]:
    """The fields of a partition spec's JSON (``PartitionSpecParser.toJson``), their sources in ``schema``'s JSON
    (``SchemaParser.toJson``): top-level columns only."""
    columns = {int(field["id"]): field for field in schema["fields"]}
    fields = []
    for field in spec["fields"]:
        source = columns.get(int(field["source-id"]))
        if source is None:
            raise UnsupportedPartitioning(f"partition field {field['name']} is of a nested column")
        source_type = source["type"] if isinstance(source["type"], str) else "nested"
        transform = str(field["transform"])
        fields.append(PartitionField(str(field["name"]), transform, str(source["name"]), source_type,
                                     _result_type(transform, source_type)))
    return fields


def _result_type(transform: str, source_type: str) -> str:
    if transform in ("identity", "void") or transform.startswith("truncate["):
        if transform.startswith("truncate[") and not _truncatable(source_type):
            raise UnsupportedPartitioning(f"truncate of a {source_type} column")
        return source_type
    if transform.startswith("bucket["):
        return "int"
    if transform == "day":
        return "date"
    if transform in ("year", "month", "hour"):
        return "int"
    raise UnsupportedPartitioning(f"partition transform {transform}")


def _truncatable(source_type: str) -> bool:
    return source_type in ("int", "long", "string", "binary") or source_type.startswith("decimal(")


