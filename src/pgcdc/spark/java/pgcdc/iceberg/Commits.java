package pgcdc.iceberg;

import java.io.IOException;
import java.io.UncheckedIOException;
import java.util.ArrayList;
import java.util.List;
import java.util.Map;
import java.util.TreeMap;
import org.apache.iceberg.ContentFile;
import org.apache.iceberg.DataFile;
import org.apache.iceberg.DeleteFile;
import org.apache.iceberg.HasTableOperations;
import org.apache.iceberg.ManifestFile;
import org.apache.iceberg.ManifestFiles;
import org.apache.iceberg.ManifestReader;
import org.apache.iceberg.RowDelta;
import org.apache.iceberg.Snapshot;
import org.apache.iceberg.Table;
import org.apache.iceberg.Transaction;
import org.apache.iceberg.UpdateProperties;
import org.apache.iceberg.relocated.com.google.common.util.concurrent.MoreExecutors;

/**
 * A batch's row delta on one mirror, in one call into the JVM. Over py4j each step of the commit (the transaction,
 * each validation, each file, each summary entry, each property, the snapshot read back) was a round trip of its
 * own, about thirty a mirror: a batch over hundreds of mirrors paid them for each. The rules are {@code
 * pgcdc.apply.row_delta}'s, whose Python path a session without pgcdc's jar takes.
 */
public final class Commits {
  private static final char SEPARATOR = '\0'; // between the entries of a summary or of a list of paths

  private Commits() {}

  /**
   * {@code added} and {@code deletes} committed in one row delta of {@code table}, with {@code removed} and
   * {@code removedDeletes} leaving it, the entries of {@code summary} in its snapshot summary and those of {@code
   * tableProperties} set on the table, all in one metadata commit. Each of the four files is null (none), one
   * file, or a {@code List} of them: py4j converts a list with a round trip an element, and a batch's commit has
   * one file of each at most, most of the time. {@code summary} and {@code tableProperties} hold keys and values,
   * each followed by {@code '\0'}.
   *
   * <p>Conflicts are validated from {@code validateFrom} (-1: none): every data file of {@code referenced} (the
   * files the position deletes name, {@code '\0'}-separated; null: none) must still be live; a commit that
   * removes files also needs no data or delete file added since, and every file it removes still live. The commit's
   * steps run in the calling thread when {@code inCallingThread}, else on Iceberg's worker pool.
   *
   * <p>With {@code readBack}, the one data file and the one delete file it adds are read back from the snapshot's
   * manifests: read that way a file knows the manifest listing it, and a commit that removes it (the next batch's
   * fold) reads that manifest alone, where one removing a file built in memory reads every manifest of the table
   * that may list it (up to a hundred before Iceberg merges them).
   */
  public static Committed rowDelta(
      Table table,
      long validateFrom,
      String referenced,
      Object added,
      Object deletes,
      Object removed,
      Object removedDeletes,
      String summary,
      String tableProperties,
      boolean inCallingThread,
      boolean readBack) {
    boolean removesFiles = removed != null || removedDeletes != null;
    Transaction transaction = table.newTransaction();
    RowDelta delta = transaction.newRowDelta();
    if (validateFrom != -1) {
      delta = delta.validateFromSnapshot(validateFrom);
    }
    if (referenced != null && !referenced.isEmpty()) {
      delta = delta.validateDataFilesExist(split(referenced)).validateDeletedFiles();
    }
    if (removesFiles) {
      delta = delta.validateNoConflictingDataFiles().validateNoConflictingDeleteFiles().validateDeletedFiles();
    }
    for (DataFile file : files(removed, DataFile.class)) {
      delta = delta.removeRows(file);
    }
    for (DeleteFile file : files(removedDeletes, DeleteFile.class)) {
      delta = delta.removeDeletes(file);
    }
    for (DataFile file : files(added, DataFile.class)) {
      delta = delta.addRows(file);
    }
    for (DeleteFile file : files(deletes, DeleteFile.class)) {
      delta = delta.addDeletes(file);
    }
    if (inCallingThread) {
      delta = delta.scanManifestsWith(MoreExecutors.newDirectExecutorService());
    }
    List<String> entries = split(summary);
    for (int i = 0; i + 1 < entries.size(); i += 2) {
      delta = delta.set(entries.get(i), entries.get(i + 1));
    }
    delta.commit();
    List<String> properties = split(tableProperties);
    if (!properties.isEmpty()) {
      UpdateProperties update = transaction.updateProperties();
      for (int i = 0; i + 1 < properties.size(); i += 2) {
        update = update.set(properties.get(i), properties.get(i + 1));
      }
      update.commit();
    }
    transaction.commitTransaction();
    // the transaction's own view names the snapshot it committed, wherever the table has moved on since
    Snapshot committed = transaction.table().currentSnapshot();
    Long parent = committed.parentId();
    DataFile dataFile = null;
    DeleteFile deleteFile = null;
    if (readBack) {
      dataFile = readBack(table, committed, added, DataFile.class);
      deleteFile = readBack(table, committed, deletes, DeleteFile.class);
    }
    return new Committed(
        committed.snapshotId() + " " + (parent == null ? -1 : parent), dataFile, deleteFile);
  }

  /** What {@link #rowDelta} committed. */
  public static final class Committed {
    private final String ids;
    private final DataFile dataFile;
    private final DeleteFile deleteFile;

    Committed(String ids, DataFile dataFile, DeleteFile deleteFile) {
      this.ids = ids;
      this.dataFile = dataFile;
      this.deleteFile = deleteFile;
    }

    /** The snapshot committed and its parent (-1: none), as {@code "<id> <parent>"}. */
    public String ids() {
      return ids;
    }

    /** The one data file added, read back from its manifest (null: not asked, or not one file). */
    public DataFile dataFile() {
      return dataFile;
    }

    /** The one delete file added, read back from its manifest (null: not asked, or not one file). */
    public DeleteFile deleteFile() {
      return deleteFile;
    }
  }

  /**
   * The file of {@code given} (when it is one file of {@code type}) as read from the manifest {@code snapshot} wrote
   * for the files it added: read with the table's partition specs, each manifest is opened once, where the
   * snapshot's own {@code addedDataFiles} opens each of its manifests twice (once for the header's spec and schema,
   * parsed again each time) and reads the manifests it rewrote too — a request each on object stores.
   */
  private static <T extends ContentFile<T>> T readBack(
      Table table, Snapshot snapshot, Object given, Class<T> type) {
    if (!type.isInstance(given)) {
      return null;
    }
    String location = ((ContentFile<?>) given).location();
    boolean data = type == DataFile.class;
    List<ManifestFile> manifests =
        data ? snapshot.dataManifests(table.io()) : snapshot.deleteManifests(table.io());
    for (ManifestFile manifest : manifests) {
      if (!Long.valueOf(snapshot.snapshotId()).equals(manifest.snapshotId())
          || !manifest.hasAddedFiles()) {
        continue;
      }
      try (ManifestReader<?> reader =
          data
              ? ManifestFiles.read(manifest, table.io(), table.specs())
              : ManifestFiles.readDeleteManifest(manifest, table.io(), table.specs())) {
        for (ContentFile<?> file : reader) {
          if (file.location().equals(location)) {
            return type.cast(file.copy());
          }
        }
      } catch (IOException e) {
        throw new UncheckedIOException(e);
      }
    }
    return null;
  }

  /**
   * What a writer of {@code table}'s files reads from its metadata, and keeps while this stays the same: its format
   * version, schema, partition spec, sort order, location, and properties other than pgcdc's own (which its commits
   * set every time). One call, where reading them again took a dozen round trips a mirror every batch.
   */
  public static String shape(Table table) {
    StringBuilder properties = new StringBuilder();
    for (Map.Entry<String, String> entry : new TreeMap<>(table.properties()).entrySet()) {
      if (!entry.getKey().startsWith("pgcdc.")) {
        properties.append(entry.getKey()).append(SEPARATOR).append(entry.getValue()).append(SEPARATOR);
      }
    }
    int formatVersion =
        table instanceof HasTableOperations
            ? ((HasTableOperations) table).operations().current().formatVersion()
            : -1;
    return formatVersion
        + " "
        + table.schema().schemaId()
        + " "
        + table.spec().specId()
        + " "
        + table.sortOrder().orderId()
        + " "
        + table.location()
        + SEPARATOR
        + properties;
  }

  /**
   * {@code table} refreshed, and what a batch asks of it before it writes, in one call (it took seven round trips
   * a mirror every batch): {@code "<current snapshot id, -1 for none> <1 when its total of equality-delete files is
   * above 0, else 0> <manifests the current snapshot lists>\0<shape>"}, the shape as {@link #shape} gives it.
   * Counting the manifests reads the snapshot's manifest list, which its next commit reads anyway (the snapshot
   * keeps what it read).
   */
  public static String refreshed(Table table) {
    table.refresh();
    Snapshot current = table.currentSnapshot();
    boolean equalityDeletes = false;
    if (current != null && current.summary() != null) {
      equalityDeletes =
          Long.parseLong(current.summary().getOrDefault("total-equality-deletes", "0")) > 0;
    }
    return (current == null ? -1 : current.snapshotId())
        + " "
        + (equalityDeletes ? 1 : 0)
        + " "
        + (current == null ? 0 : manifests(table, current))
        + SEPARATOR
        + shape(table);
  }

  /** How many manifests {@code snapshot} of {@code table} lists, data and deletes. */
  public static int manifests(Table table, Snapshot snapshot) {
    return snapshot.allManifests(table.io()).size();
  }

  private static <T> List<T> files(Object given, Class<T> type) {
    if (given == null) {
      return List.of();
    }
    if (given instanceof List) {
      List<T> files = new ArrayList<>();
      for (Object file : (List<?>) given) {
        files.add(type.cast(file));
      }
      return files;
    }
    return List.of(type.cast(given));
  }

  private static List<String> split(String joined) {
    List<String> parts = new ArrayList<>();
    if (joined == null || joined.isEmpty()) {
      return parts;
    }
    int start = 0;
    for (int end = joined.indexOf(SEPARATOR); end != -1; end = joined.indexOf(SEPARATOR, start)) {
      parts.add(joined.substring(start, end));
      start = end + 1;
    }
    if (start < joined.length()) {
      parts.add(joined.substring(start));
    }
    return parts;
  }
}
