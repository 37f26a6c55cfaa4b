package pgcdc.hadoop;

import java.io.FileNotFoundException;
import java.io.IOException;
import java.nio.file.Files;
import java.nio.file.NoSuchFileException;
import java.nio.file.attribute.PosixFilePermission;
import java.util.EnumSet;
import java.util.Set;
import org.apache.hadoop.fs.Path;
import org.apache.hadoop.fs.permission.FsPermission;

/**
 * Hadoop's local file system (checksums included) whose permissions are set in the JVM.
 *
 * <p>Without Hadoop's native library, which pip's pyspark does not ship, {@code RawLocalFileSystem} sets the
 * permissions of every file and directory it creates by starting a {@code chmod} process: two per file written
 * to a local warehouse (the file and its checksum), a few milliseconds of CPU each, more than the write itself.
 * This one sets the same bits with {@code java.nio}; modes {@code java.nio} cannot express (sticky, setuid and
 * setgid bits) and file systems without POSIX permissions go the original way.
 */
public class LocalFileSystem extends org.apache.hadoop.fs.LocalFileSystem {
  public LocalFileSystem() {
    super(new RawLocalFileSystem());
  }

  /** The file system under the checksums: Hadoop's own, but for {@link #setPermission}. */
  public static class RawLocalFileSystem extends org.apache.hadoop.fs.RawLocalFileSystem {
    // bit i of a mode (other execute = bit 0 ... owner read = bit 8)
    private static final PosixFilePermission[] MODE_BITS = {
      PosixFilePermission.OTHERS_EXECUTE, PosixFilePermission.OTHERS_WRITE, PosixFilePermission.OTHERS_READ,
      PosixFilePermission.GROUP_EXECUTE, PosixFilePermission.GROUP_WRITE, PosixFilePermission.GROUP_READ,
      PosixFilePermission.OWNER_EXECUTE, PosixFilePermission.OWNER_WRITE, PosixFilePermission.OWNER_READ,
    };

    @Override
    public void setPermission(Path path, FsPermission permission) throws IOException {
      int mode = permission.toShort();
      if ((mode & ~0777) != 0) {
        super.setPermission(path, permission);
        return;
      }
      Set<PosixFilePermission> bits = EnumSet.noneOf(PosixFilePermission.class);
      for (int bit = 0; bit < MODE_BITS.length; bit++) {
        if ((mode & (1 << bit)) != 0) {
          bits.add(MODE_BITS[bit]);
        }
      }
      try {
        Files.setPosixFilePermissions(pathToFile(path).toPath(), bits);
      } catch (NoSuchFileException missing) {
        throw new FileNotFoundException("File " + path + " does not exist");
      } catch (UnsupportedOperationException notPosix) {
        super.setPermission(path, permission);
      }
    }
  }
}
