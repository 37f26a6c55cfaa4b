"""pgcdc: change data capture for PostgreSQL into Apache Iceberg with Spark."""

from pgcdc.errors import ConfigError, ConversionError, DecodeError, PgcdcError, ProtocolError
from pgcdc.lsn import Lsn

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "ConversionError",
    "DecodeError",
    "Destination",
    "Lsn",
    "PgcdcError",
    "Pipeline",
    "PipelineConfig",
    "ProtocolError",
    "__version__",
    "consistent_tables",
    "spark_settings",
]


def __getattr__(name: str):
    # the pipeline pulls in Spark, psycopg and pyarrow: load it only when asked for
    if name in ("Pipeline", "PipelineConfig"):
        from pgcdc import pipeline

        return getattr(pipeline, name)
    if name == "Destination":
        from pgcdc.spark.destination import Destination

        return Destination
    if name == "consistent_tables":
        from pgcdc.mirrors.consistent import consistent_tables

        return consistent_tables
    if name == "spark_settings":
        from pgcdc.spark.settings import spark_settings

        return spark_settings
    raise AttributeError(f"module 'pgcdc' has no attribute {name!r}")
