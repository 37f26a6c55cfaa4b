package pgcdc.iceberg;

import java.nio.ByteBuffer;
import java.util.List;
import org.apache.iceberg.PartitionSpec;
import org.apache.iceberg.StructLike;
import org.apache.iceberg.data.GenericRecord;
import org.apache.iceberg.types.Conversions;
import org.apache.iceberg.types.Types;

/**
 * A partition of a spec, from its values in Iceberg's single-value binary form (computed in Python by
 * {@code pgcdc.iceberg.partition_values}), each converted by Iceberg to the Java type its field holds.
 *
 * <p>Built here rather than over py4j, which hands every boxed value it returns to Python as a Python number and
 * sends a small number back as an {@code Integer}: a long or timestamp partition value would reach the record as
 * the wrong class, and Iceberg refuses it when it writes the file's partition.
 */
public final class Partitions {
  private Partitions() {}

  /** The partition of {@code spec} holding {@code values}, one per field (null: NULL). */
  public static StructLike of(PartitionSpec spec, List<byte[]> values) {
    Types.StructType type = spec.partitionType();
    List<Types.NestedField> fields = type.fields();
    if (values.size() != fields.size()) {
      throw new IllegalArgumentException(
          values.size() + " values for the " + fields.size() + " fields of partition spec " + spec.specId());
    }
    GenericRecord record = GenericRecord.create(type);
    for (int i = 0; i < fields.size(); i++) {
      byte[] value = values.get(i);
      if (value != null) {
        Object converted = Conversions.fromByteBuffer(fields.get(i).type(), ByteBuffer.wrap(value));
        // strings as String, which partitions compare and hash as Iceberg's own readers make them
        record.set(i, converted instanceof CharSequence ? converted.toString() : converted);
      }
    }
    return record;
  }
}
