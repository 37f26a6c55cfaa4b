"""The Spark types of pgcdc's Arrow columns: what a mirror table's schema is made of."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pyarrow as pa

from pgcdc.errors import ConversionError

if TYPE_CHECKING:
    from pyspark.sql.types import DataType, StructType


# Arrow's flat types and the name of the Spark type each becomes
_FLAT = ((pa.types.is_boolean, "BooleanType"), (pa.types.is_int16, "ShortType"), (pa.types.is_int32, "IntegerType"),
         (pa.types.is_int64, "LongType"), (pa.types.is_float32, "FloatType"), (pa.types.is_float64, "DoubleType"),
         (pa.types.is_string, "StringType"), (pa.types.is_binary, "BinaryType"), (pa.types.is_date32, "DateType"))


def spark_type(arrow_type: pa.DataType) -> DataType:
    """The Spark type of a column of ``arrow_type`` (timestamps with a zone: TimestampType, without:
    TimestampNTZType)."""
    from pyspark.sql import types as T

    for matches, name in _FLAT:
        if matches(arrow_type):
            return getattr(T, name)()
    if pa.types.is_decimal(arrow_type):
        return T.DecimalType(arrow_type.precision, arrow_type.scale)
    if pa.types.is_timestamp(arrow_type):
        return T.TimestampType() if arrow_type.tz else T.TimestampNTZType()
    if pa.types.is_list(arrow_type):
        return T.ArrayType(spark_type(arrow_type.value_type))
    if pa.types.is_struct(arrow_type):
        return spark_schema(arrow_type)
    raise ConversionError(f"no Spark type for Arrow type {arrow_type}")


def spark_schema(arrow_schema: pa.Schema | pa.StructType) -> StructType:
    """A converter's ``arrow_schema`` (or an Arrow struct) as a Spark schema."""
    from pyspark.sql.types import StructField, StructType

    return StructType([StructField(f.name, spark_type(f.type)) for f in arrow_schema])
