"""Column values: PostgreSQL types (text and binary formats) to Arrow, columnar."""

from typing import TYPE_CHECKING

from pgcdc.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from pgcdc.types.convert import ConvertedRows, TableConverter
    from pgcdc.types.decoding import ConversionOptions
    from pgcdc.types.registry import SESSION_SETTINGS, PgType, TypeRegistry
    from pgcdc.types.temporal import INTERVAL_TYPE

__all__ = ["INTERVAL_TYPE", "SESSION_SETTINGS", "ConversionOptions", "ConvertedRows", "PgType", "TableConverter",
           "TypeRegistry"]

__getattr__ = lazy_exports(__name__, {
    "ConvertedRows": "pgcdc.types.convert", "TableConverter": "pgcdc.types.convert",
    "ConversionOptions": "pgcdc.types.decoding", "SESSION_SETTINGS": "pgcdc.types.registry",
    "PgType": "pgcdc.types.registry", "TypeRegistry": "pgcdc.types.registry", "INTERVAL_TYPE": "pgcdc.types.temporal",
})
