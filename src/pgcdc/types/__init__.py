"""Column values: PostgreSQL types (text and binary formats) to Arrow and Spark, columnar."""

from pgcdc.types.convert import (
    INTERVAL_TYPE,
    ConversionOptions,
    ConvertedRows,
    TableConverter,
    spark_type,
)
from pgcdc.types.registry import SESSION_SETTINGS, PgType, TypeRegistry

__all__ = ["INTERVAL_TYPE", "SESSION_SETTINGS", "ConversionOptions", "ConvertedRows", "PgType", "TableConverter",
           "TypeRegistry", "spark_type"]
