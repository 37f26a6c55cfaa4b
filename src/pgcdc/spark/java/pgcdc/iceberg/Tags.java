package pgcdc.iceberg;

import org.apache.iceberg.ManageSnapshots;
import org.apache.iceberg.Snapshot;
import org.apache.iceberg.SnapshotRef;
import org.apache.iceberg.Table;
import org.apache.iceberg.Transaction;
import org.apache.iceberg.exceptions.CommitFailedException;

/**
 * The consistent tag's move on one mirror, in the JVM: a move over hundreds of mirrors every few seconds read each
 * mirror's whole metadata into Python as JSON (tens of milliseconds a mirror, holding Python's lock the applies
 * share). The rules are {@code pgcdc.mirrors.consistent}'s ({@code snapshot_at}, {@code move_tag}), which a test
 * holds both implementations to.
 */
public final class Tags {
  private static final int POINT_ATTEMPTS = 5; // a tag's commit made again after one lost to another commit

  private Tags() {}

  /**
   * The id of {@code table}'s snapshot holding exactly the source up to {@code lsn} (PostgreSQL's text form), or
   * -1 when it holds none: its current snapshot, when the position that snapshot holds is at or below {@code
   * lsn}. A snapshot holds the position in its summary's {@code positionKey}; a rewrite ({@code replace}) holds its
   * parent's, while the parent is still in the table.
   */
  public static long target(Table table, String positionKey, String lsn) {
    Snapshot current = table.currentSnapshot();
    if (current == null) {
      return -1;
    }
    Snapshot holder = current;
    while ("replace".equals(holder.operation()) && holder.parentId() != null) {
      Snapshot parent = table.snapshot(holder.parentId());
      if (parent == null) {
        break;
      }
      holder = parent;
    }
    String held = holder.summary().get(positionKey);
    if (held == null) {
      return -1;
    }
    return Long.compareUnsigned(parse(held), parse(lsn)) <= 0 ? current.snapshotId() : -1;
  }

  /**
   * The tag {@code tag} on {@code snapshotId} and the table property {@code property} set to {@code recorded}, in
   * one metadata commit; nothing when both already are. Returns whether it committed.
   *
   * <p>A commit landing meanwhile (a batch's, on another thread) makes the transaction fail rather than retry: the
   * tag's update keeps the metadata it was made from, which Iceberg's transaction does not refresh ("Table
   * metadata refresh is required"). The move is then made again on the table refreshed, a few times.
   */
  public static boolean point(
      Table table, String tag, long snapshotId, String property, String recorded) {
    for (int attempt = 1; ; attempt++) {
      SnapshotRef ref = table.refs().get(tag);
      if (ref != null && ref.snapshotId() == snapshotId && recorded.equals(table.properties().get(property))) {
        return false;
      }
      try {
        Transaction transaction = table.newTransaction();
        ManageSnapshots manage = transaction.manageSnapshots();
        manage = ref != null ? manage.replaceTag(tag, snapshotId) : manage.createTag(tag, snapshotId);
        manage.commit();
        transaction.updateProperties().set(property, recorded).commit();
        transaction.commitTransaction();
        return true;
      } catch (CommitFailedException e) {
        if (attempt >= POINT_ATTEMPTS) {
          throw e;
        }
        table.refresh();
      }
    }
  }

  private static long parse(String lsn) {
    int slash = lsn.indexOf('/');
    if (slash < 0) {
      throw new IllegalArgumentException("not an LSN: " + lsn);
    }
    return (Long.parseUnsignedLong(lsn.substring(0, slash).trim(), 16) << 32)
        | Long.parseUnsignedLong(lsn.substring(slash + 1).trim(), 16);
  }
}
