package pgcdc.iceberg;

import java.util.Map;
import org.apache.iceberg.HasTableOperations;
import org.apache.iceberg.Snapshot;
import org.apache.iceberg.SnapshotRef;
import org.apache.iceberg.Table;
import org.apache.iceberg.util.JsonUtil;

/**
 * What pgcdc reads of a table's metadata — its properties, refs and snapshots, each snapshot's summary cut to the
 * values asked for — as a metadata document of Iceberg's own shape, small enough to hand to Python at every read.
 * The whole metadata as JSON, the other way to have it in one call, costs a JVM just started tens of milliseconds a
 * table (every schema, spec, log entry and summary value written out), which a run paid for every mirror at its
 * start and at its first batch.
 */
public final class Facts {
  private Facts() {}

  /**
   * {"format-version", "current-snapshot-id", "properties", "refs", "snapshots": [{"snapshot-id",
   * "parent-snapshot-id", "timestamp-ms", "summary": {"operation", and those of {@code summaryKeys}
   * (comma-separated) the snapshot carries}}]} of {@code table} as it stands in memory.
   */
  public static String view(Table table, String summaryKeys) {
    String[] keys = summaryKeys.isEmpty() ? new String[0] : summaryKeys.split(",");
    int formatVersion =
        table instanceof HasTableOperations
            ? ((HasTableOperations) table).operations().current().formatVersion()
            : 2;
    return JsonUtil.generate(
        generator -> {
          generator.writeStartObject();
          generator.writeNumberField("format-version", formatVersion);
          Snapshot current = table.currentSnapshot();
          generator.writeNumberField("current-snapshot-id", current == null ? -1 : current.snapshotId());
          generator.writeObjectFieldStart("properties");
          for (Map.Entry<String, String> property : table.properties().entrySet()) {
            generator.writeStringField(property.getKey(), property.getValue());
          }
          generator.writeEndObject();
          generator.writeObjectFieldStart("refs");
          for (Map.Entry<String, SnapshotRef> ref : table.refs().entrySet()) {
            generator.writeObjectFieldStart(ref.getKey());
            generator.writeNumberField("snapshot-id", ref.getValue().snapshotId());
            generator.writeStringField("type", ref.getValue().isTag() ? "tag" : "branch");
            generator.writeEndObject();
          }
          generator.writeEndObject();
          generator.writeArrayFieldStart("snapshots");
          for (Snapshot snapshot : table.snapshots()) {
            generator.writeStartObject();
            generator.writeNumberField("snapshot-id", snapshot.snapshotId());
            if (snapshot.parentId() != null) {
              generator.writeNumberField("parent-snapshot-id", snapshot.parentId());
            }
            generator.writeNumberField("timestamp-ms", snapshot.timestampMillis());
            generator.writeObjectFieldStart("summary");
            if (snapshot.operation() != null) {
              generator.writeStringField("operation", snapshot.operation());
            }
            Map<String, String> summary = snapshot.summary();
            for (String key : keys) {
              String value = summary == null ? null : summary.get(key);
              if (value != null) {
                generator.writeStringField(key, value);
              }
            }
            generator.writeEndObject();
            generator.writeEndObject();
          }
          generator.writeEndArray();
          generator.writeEndObject();
        },
        false);
  }
}
