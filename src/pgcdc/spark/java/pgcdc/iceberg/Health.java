package pgcdc.iceberg;

import java.util.Map;
import org.apache.iceberg.Snapshot;
import org.apache.iceberg.Table;

/**
 * What a table's current metadata says of its health, in one call: a look at whether a mirror is due for
 * maintenance runs every few seconds over hundreds of mirrors, and over py4j each figure would cost a round trip
 * (the table's whole metadata as JSON, the other way to have them at once, costs tens of milliseconds a table).
 */
public final class Health {
  private Health() {}

  /**
   * "snapshots,data files,delete files,records,bytes of files,current snapshot id,has a current snapshot (1 or
   * 0),orphans removed at (epoch seconds, or -1 when never),position deletes,data files after the newest rewrite
   * (-1 when none is kept)" of {@code table} as it stands in memory (a string: py4j
   * hands a Java array back element by element, a round trip each).
   */
  public static String of(Table table, String orphansProperty) {
    long snapshots = 0;
    Snapshot rewrite = null; // the newest compaction's ("replace"): what a table holds since is what changed
    for (Snapshot snapshot : table.snapshots()) {
      snapshots++;
      if ("replace".equals(snapshot.operation())
          && (rewrite == null || snapshot.timestampMillis() > rewrite.timestampMillis())) {
        rewrite = snapshot;
      }
    }
    long compacted = rewrite == null ? -1 : total(rewrite.summary(), "total-data-files");
    String removed = table.properties().get(orphansProperty);
    long removedAt = removed == null ? -1 : (long) Double.parseDouble(removed);
    Snapshot current = table.currentSnapshot();
    if (current == null) {
      return join(new long[] {snapshots, 0, 0, 0, 0, 0, 0, removedAt, 0, compacted});
    }
    Map<String, String> summary = current.summary();
    return join(new long[] {
      snapshots,
      total(summary, "total-data-files"),
      total(summary, "total-delete-files"),
      total(summary, "total-records"),
      total(summary, "total-files-size"),
      current.snapshotId(),
      1,
      removedAt,
      total(summary, "total-position-deletes"),
      compacted
    });
  }

  private static String join(long[] figures) {
    StringBuilder joined = new StringBuilder();
    for (long figure : figures) {
      if (joined.length() > 0) {
        joined.append(',');
      }
      joined.append(figure);
    }
    return joined.toString();
  }

  private static long total(Map<String, String> summary, String key) {
    String value = summary.get(key);
    return value == null ? 0 : Long.parseLong(value);
  }
}
