package pgcdc.iceberg;

import java.util.List;
import java.util.Map;
import java.util.concurrent.ExecutorService;
import org.apache.iceberg.ManifestFile;
import org.apache.iceberg.RewriteManifests;
import org.apache.iceberg.Snapshot;
import org.apache.iceberg.Table;

/**
 * A small table's data manifests rewritten into one per partition spec, by Iceberg's own {@code RewriteManifests}
 * in this JVM: Spark's action plans jobs over every manifest entry, seconds in a JVM started minutes ago, for a
 * table whose manifests hold a handful of entries.
 *
 * <p>The cluster function is Java's: over py4j, a Python one would cost a callback per data file.
 */
public final class Manifests {
  private Manifests() {}

  /**
   * Rewrite the current snapshot's data manifests of {@code table} when it has more than one, in one commit
   * carrying {@code summary} in its snapshot summary, its manifests read on {@code executor}; returns how many
   * manifests were rewritten (0: no commit).
   */
  public static int rewrite(Table table, Map<String, String> summary, ExecutorService executor) {
    Snapshot current = table.currentSnapshot();
    if (current == null) {
      return 0;
    }
    List<ManifestFile> data = current.dataManifests(table.io());
    if (data.size() <= 1) {
      return 0;
    }
    RewriteManifests rewrite = table.rewriteManifests().clusterBy(file -> "").scanManifestsWith(executor);
    for (Map.Entry<String, String> entry : summary.entrySet()) {
      rewrite = rewrite.set(entry.getKey(), entry.getValue());
    }
    rewrite.commit();
    return data.size();
  }
}
