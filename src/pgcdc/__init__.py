"""pgcdc: change data capture for PostgreSQL into Apache Iceberg with Spark."""

from pgcdc.errors import ConfigError, ConversionError, DecodeError, PgcdcError, ProtocolError
from pgcdc.lsn import Lsn

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "ConversionError",
    "DecodeError",
    "Lsn",
    "PgcdcError",
    "ProtocolError",
    "__version__",
]
