package pgcdc.iceberg;

import java.io.ByteArrayInputStream;
import java.io.IOException;
import java.io.UncheckedIOException;
import java.util.stream.Stream;
import org.apache.iceberg.DataFile;
import org.apache.iceberg.DataFiles;
import org.apache.iceberg.DeleteFile;
import org.apache.iceberg.FileFormat;
import org.apache.iceberg.FileMetadata;
import org.apache.iceberg.Metrics;
import org.apache.iceberg.MetricsConfig;
import org.apache.iceberg.PartitionSpec;
import org.apache.iceberg.StructLike;
import org.apache.iceberg.parquet.ParquetUtil;
import org.apache.iceberg.shaded.org.apache.parquet.format.converter.ParquetMetadataConverter;

/**
 * The Iceberg entry of a Parquet file pgcdc wrote with Arrow, in one call: its column metrics read from the
 * footer the writer holds (as {@code ParquetUtil.fileMetrics} reads them, without opening the file again), then
 * the builder's steps. Over py4j each step is a round trip, a dozen a file, and a batch over hundreds of mirrors,
 * or over a mirror of many partitions, writes two files for each.
 */
public final class Files {
  private Files() {}

  /** A data file of {@code spec}, in {@code partition} (null: unpartitioned). */
  public static DataFile dataFile(
      PartitionSpec spec, StructLike partition, String path, long size, byte[] footer, MetricsConfig config) {
    DataFiles.Builder builder =
        DataFiles.builder(spec)
            .withPath(path)
            .withFormat(FileFormat.PARQUET)
            .withFileSizeInBytes(size)
            .withMetrics(metrics(footer, config));
    if (partition != null) {
      builder = builder.withPartition(partition);
    }
    return builder.build();
  }

  /**
   * A position-delete file of {@code spec}, in {@code partition} (null: unpartitioned), naming the data file
   * {@code referenced} alone when not null (readers that match delete files to data files go straight to it).
   */
  public static DeleteFile positionDeletes(
      PartitionSpec spec,
      StructLike partition,
      String path,
      long size,
      byte[] footer,
      MetricsConfig config,
      String referenced) {
    FileMetadata.Builder builder =
        FileMetadata.deleteFileBuilder(spec)
            .ofPositionDeletes()
            .withPath(path)
            .withFormat(FileFormat.PARQUET)
            .withFileSizeInBytes(size)
            .withMetrics(metrics(footer, config));
    if (partition != null) {
      builder = builder.withPartition(partition);
    }
    if (referenced != null) {
      builder = builder.withReferencedDataFile(referenced);
    }
    return builder.build();
  }

  /** An equality-delete file of an unpartitioned {@code spec} on the fields {@code fieldIds}. */
  public static DeleteFile equalityDeletes(
      PartitionSpec spec, String path, long size, byte[] footer, MetricsConfig config, int[] fieldIds) {
    return FileMetadata.deleteFileBuilder(spec)
        .ofEqualityDeletes(fieldIds)
        .withPath(path)
        .withFormat(FileFormat.PARQUET)
        .withFileSizeInBytes(size)
        .withMetrics(metrics(footer, config))
        .build();
  }

  private static Metrics metrics(byte[] footer, MetricsConfig config) {
    try {
      return ParquetUtil.footerMetrics(
          new ParquetMetadataConverter().readParquetMetadata(new ByteArrayInputStream(footer)),
          Stream.empty(),
          config);
    } catch (IOException e) {
      throw new UncheckedIOException("the footer of a Parquet file pgcdc wrote cannot be read", e);
    }
  }
}
