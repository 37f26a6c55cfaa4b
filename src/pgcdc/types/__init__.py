"""Column values: PostgreSQL types (text and binary formats) to Arrow, columnar."""

from pgcdc.types.convert import ConvertedRows, TableConverter
from pgcdc.types.decoding import ConversionOptions
from pgcdc.types.registry import SESSION_SETTINGS, PgType, TypeRegistry
from pgcdc.types.temporal import INTERVAL_TYPE

__all__ = ["INTERVAL_TYPE", "SESSION_SETTINGS", "ConversionOptions", "ConvertedRows", "PgType", "TableConverter",
           "TypeRegistry"]
