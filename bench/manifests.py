"""Manifest reading: pgcdc's Avro reader (pgcdc.iceberg.avro_files, through fastavro) beside the hand-written
pure-Python reader it replaced and PyIceberg's own manifest reader, on one large Iceberg manifest.

The manifest is written by PyIceberg's writer as Iceberg writes one (format v2): 10,000 data-file entries
(--quick: 2,000) of a table of 12 columns partitioned by day(ts) and bucket(16, id), each entry with its
nested data_file record, partition struct, column sizes, value, null and NaN counts, lower and upper bounds
(bytes) and split offsets, in blocks of about 64 KB as Java's Avro writer cuts them, in codec deflate
(Iceberg's default) and null. Each reader returns every record as a dict; times (wall clock, and the process's
CPU time) are the median of several reads (a warm-up read apart) with their spread (the machine is shared).
The hand-written reader is the one pgcdc had before fastavro, loaded from git history (commit HANDWRITTEN);
"fastavro_bare" is fastavro's own reader alone: without pgcdc's checks (record counts, whole blocks, snappy
checksums) and with its logical-type conversions (the day partition comes back as a date). "pyiceberg" is
PyIceberg's manifest reader as its scans call it, ManifestFile.fetch_manifest_entry (its Avro decoder, compiled
with Cython where the wheel has it, and its resolver): it returns ManifestEntry and DataFile records rather
than dicts, and is handed the same bytes through an in-memory FileIO.
Last line: one JSON object of the figures.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import io
import json
import statistics
import subprocess
import sys
import tempfile
import time
import types
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import fastavro
import pyiceberg
from pyiceberg.avro.file import AvroOutputFile
from pyiceberg.io import FileIO, InputFile, InputStream, OutputFile
from pyiceberg.io.pyarrow import PyArrowFileIO
from pyiceberg.manifest import (
    DEFAULT_READ_VERSION,
    DataFile,
    DataFileContent,
    FileFormat,
    ManifestContent,
    ManifestEntry,
    ManifestEntryStatus,
    ManifestFile,
    data_file_with_partition,
    manifest_entry_schema_with_data_file,
)
from pyiceberg.partitioning import PartitionField, PartitionSpec
from pyiceberg.schema import Schema
from pyiceberg.transforms import BucketTransform, DayTransform
from pyiceberg.typedef import Record
from pyiceberg.types import (
    BooleanType,
    DateType,
    DecimalType,
    DoubleType,
    IntegerType,
    LongType,
    NestedField,
    StringType,
    TimestamptzType,
)

from pgcdc.iceberg.avro_files import read_container

ROOT = Path(__file__).resolve().parents[1]
HANDWRITTEN = "939266174e332bbf777f2e3a3fa1fd21ff4b4a2d"  # the last commit with the hand-written Avro reader
BLOCK_BYTES = 64_000  # Java Avro's default sync interval: a block is cut once it holds this much
TABLE = Schema(
    NestedField(1, "id", LongType(), required=True),
    NestedField(2, "ts", TimestamptzType(), required=True),
    NestedField(3, "name", StringType()),
    NestedField(4, "email", StringType()),
    NestedField(5, "amount", DecimalType(12, 2)),
    NestedField(6, "score", DoubleType()),
    NestedField(7, "quantity", IntegerType()),
    NestedField(8, "active", BooleanType()),
    NestedField(9, "born", DateType()),
    NestedField(10, "country", StringType()),
    NestedField(11, "payload", StringType()),
    NestedField(12, "version", LongType()),
)
SPEC = PartitionSpec(PartitionField(2, 1000, DayTransform(), "ts_day"),
                     PartitionField(1, 1001, BucketTransform(16), "id_bucket"), spec_id=0)


def data_file(number: int) -> DataFile:
    """A Parquet data file's entry as Iceberg's writers fill it: partition values, and a size, counts and
    bounds (Iceberg's single-value serialization: 8-byte longs, 16-byte truncated strings...) per column."""
    day, bucket = 19_700 + number // 160, number % 16
    rows = 50_000 + number * 37 % 20_000
    columns = range(1, len(TABLE.fields) + 1)
    low, high = number * 1_000_000, number * 1_000_000 + rows
    bounds_low = {1: low.to_bytes(8, "little"), 2: (day * 86_400_000_000).to_bytes(8, "little"),
                  3: b"Aaron Abbott", 4: b"aaron@example.co", 5: (0).to_bytes(1, "big"),
                  6: (-1.5e3).hex().encode()[:8], 7: (0).to_bytes(4, "little"), 8: b"\x00",
                  9: (-20_000).to_bytes(4, "little", signed=True), 10: b"AD", 12: (1).to_bytes(8, "little")}
    bounds_high = {1: high.to_bytes(8, "little"), 2: ((day + 1) * 86_400_000_000 - 1).to_bytes(8, "little"),
                   3: b"Zygmunt Zielinsk", 4: b"zygmunt@example.", 5: (10**9).to_bytes(4, "big"),
                   6: (9.9e6).hex().encode()[:8], 7: (10_000).to_bytes(4, "little"), 8: b"\x01",
                   9: (20_000).to_bytes(4, "little"), 10: b"ZW", 12: (9).to_bytes(8, "little")}
    path = (f"s3://warehouse/db/events/data/ts_day=2023-{1 + day % 12:02d}-{1 + day % 28:02d}/"
            f"id_bucket={bucket}/00{number % 1000:03d}-{number}-{uuid.UUID(int=number * 7919)}-00001.parquet")
    return DataFile.from_args(
        content=DataFileContent.DATA, file_path=path, file_format=FileFormat.PARQUET,
        partition=Record(day, bucket), record_count=rows, file_size_in_bytes=rows * 41,
        column_sizes={c: rows * (c % 5 + 1) for c in columns}, value_counts=dict.fromkeys(columns, rows),
        null_value_counts={c: (0 if c <= 2 else number % 97 * c) for c in columns},
        nan_value_counts={6: 0}, lower_bounds=bounds_low, upper_bounds=bounds_high, key_metadata=None,
        split_offsets=[4], equality_ids=None, sort_order_id=0)


def manifest(path: Path, entries: int, codec: str) -> bytes:
    """A format v2 manifest of ``entries`` data files written by PyIceberg's Avro writer, in blocks of about
    BLOCK_BYTES as Java's writer cuts them (PyIceberg's own ManifestWriter writes one entry per block)."""
    partition_type = SPEC.partition_type(TABLE)
    file_schema = manifest_entry_schema_with_data_file(2, data_file_with_partition(partition_type, 2))
    record_schema = manifest_entry_schema_with_data_file(
        DEFAULT_READ_VERSION, data_file_with_partition(partition_type, DEFAULT_READ_VERSION))
    metadata = {"schema": TABLE.model_dump_json(), "partition-spec-id": "0", "format-version": "2",
                "content": "data", "avro.codec": codec}
    made = [ManifestEntry.from_args(status=ManifestEntryStatus.ADDED if number % 3 else ManifestEntryStatus.EXISTING,
                                    snapshot_id=8_000_000_000_000 + number // 500, sequence_number=1 + number // 500,
                                    file_sequence_number=1 + number // 500, data_file=data_file(number))
            for number in range(entries)]
    per_block = max(1, BLOCK_BYTES // 600)  # an entry takes about 600 bytes uncompressed
    with AvroOutputFile[ManifestEntry](PyArrowFileIO().new_output(str(path)), file_schema, "manifest_entry",
                                       record_schema=record_schema, metadata=metadata) as output:
        for start in range(0, entries, per_block):
            output.write_block(made[start:start + per_block])
    return path.read_bytes()


def handwritten_reader() -> Callable[[bytes, str], Any] | str:
    """The hand-written reader's read_container from git history, or why it cannot be had."""
    try:
        source = subprocess.run(["git", "-C", str(ROOT), "show", f"{HANDWRITTEN}:src/pgcdc/iceberg/avro_files.py"],
                                capture_output=True, check=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        return f"the hand-written reader cannot be loaded from git history ({exc})"
    module = types.ModuleType("pgcdc_handwritten_avro")
    exec(compile(source, "handwritten avro_files.py", "exec"), module.__dict__)
    return module.read_container


def fastavro_bare(data: bytes, location: str) -> list[dict[str, Any]]:
    return list(fastavro.reader(io.BytesIO(data)))


class MemoryInput(InputFile):
    """Bytes in memory as PyIceberg's FileIO hands a file to its readers."""

    def __init__(self, location: str, data: bytes) -> None:
        super().__init__(location)
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def exists(self) -> bool:
        return True

    def open(self, seekable: bool = True) -> InputStream:
        return io.BytesIO(self.data)


class MemoryFileIO(FileIO):
    """A FileIO over one file in memory: PyIceberg reads the manifest without touching the disk."""

    def __init__(self, location: str, data: bytes) -> None:
        super().__init__()
        self.location, self.data = location, data

    def new_input(self, location: str) -> InputFile:
        assert location == self.location, location
        return MemoryInput(location, self.data)

    def new_output(self, location: str) -> OutputFile:
        raise NotImplementedError("the bench only reads")

    def delete(self, location: str | InputFile | OutputFile) -> None:
        raise NotImplementedError("the bench only reads")


def pyiceberg_reader(data: bytes, location: str) -> list[ManifestEntry]:
    """Every entry (deleted ones too) of the manifest ``data``, read as PyIceberg's scans read one."""
    listed = ManifestFile.from_args(manifest_path=location, manifest_length=len(data), partition_spec_id=0,
                                    content=ManifestContent.DATA, sequence_number=1, min_sequence_number=1,
                                    added_snapshot_id=8_000_000_000_000)
    return listed.fetch_manifest_entry(MemoryFileIO(location, data), discard_deleted=False)


def pgcdc_key(record: dict[str, Any]) -> tuple[Any, ...]:
    """What the readers are checked to agree on, of one entry read by pgcdc."""
    file = record["data_file"]
    return (record["status"], record["snapshot_id"], record["sequence_number"], file["file_path"],
            tuple(file["partition"].values()), file["record_count"], file["file_size_in_bytes"])


def pyiceberg_key(entry: ManifestEntry) -> tuple[Any, ...]:
    """The same of one entry read by PyIceberg."""
    file, partition = entry.data_file, entry.data_file.partition
    return (entry.status.value, entry.snapshot_id, entry.sequence_number, file.file_path,
            tuple(partition[position] for position in range(len(partition))), file.record_count,
            file.file_size_in_bytes)


def spread(values: list[float], scale: float = 1.0) -> dict[str, float]:
    return {"median": round(statistics.median(values) * scale, 2), "min": round(min(values) * scale, 2),
            "max": round(max(values) * scale, 2)}


def measure(read: Callable[[bytes, str], Any], data: bytes, repeat: int) -> tuple[list[float], list[float]]:
    """Seconds of each of ``repeat`` reads of the whole file into records, after one warm-up read: wall clock,
    and this process's CPU time (steadier on a shared machine)."""
    read(data, "bench.avro")
    wall, cpu = [], []
    for _ in range(repeat):
        # every read from the same heap: the objects the ones before left would otherwise set when the collector
        # passes, and how often (the spread was mostly that)
        gc.collect()
        started, started_cpu = time.perf_counter(), time.process_time()
        kept = read(data, "bench.avro")
        wall.append(time.perf_counter() - started)
        cpu.append(time.process_time() - started_cpu)
        del kept
    return wall, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="2,000 entries, 3 reads (well under 2 minutes)")
    parser.add_argument("--entries", type=int, default=None)
    args = parser.parse_args()
    entries = args.entries or (2_000 if args.quick else 10_000)
    repeat = 3 if args.quick else 7
    readers: dict[str, Callable[[bytes, str], Any] | str] = {
        "handwritten": handwritten_reader(), "fastavro": read_container, "fastavro_bare": fastavro_bare,
        "pyiceberg": pyiceberg_reader}
    notes = {name: reader for name, reader in readers.items() if isinstance(reader, str)}
    results: dict[str, dict[str, dict[str, float]]] = {}
    cpu: dict[str, dict[str, dict[str, float]]] = {}
    sizes = {}
    with tempfile.TemporaryDirectory(prefix="pgcdc-manifests-") as directory:
        for codec in ("deflate", "null"):
            data = manifest(Path(directory) / f"{codec}.avro", entries, codec)
            sizes[codec] = len(data)
            expected = read_container(data, "bench.avro")[1]
            assert len(expected) == entries
            results[codec], cpu[codec] = {}, {}
            for name, reader in readers.items():
                if isinstance(reader, str):
                    continue
                if name == "handwritten":
                    assert reader(data, "bench.avro")[1] == expected, "the two readers disagree"
                if name == "pyiceberg":
                    read = reader(data, "bench.avro")
                    assert len(read) == entries, f"PyIceberg read {len(read)} entries of {entries}"
                    assert ([pyiceberg_key(entry) for entry in read]
                            == [pgcdc_key(record) for record in expected]), "PyIceberg and pgcdc disagree"
                    del read  # not kept alive while it is timed
                wall, used = measure(reader, data, repeat)
                results[codec][name], cpu[codec][name] = spread(wall, 1e3), spread(used, 1e3)

    print(f"reading an Iceberg manifest of {entries:,} data-file entries (format v2, PyIceberg's writer, blocks "
          f"of ~{BLOCK_BYTES // 1000} KB); ms per read: median [min-max] of {repeat} reads after a warm-up")
    print(f"{'codec':<8} {'bytes':>10} {'reader':<14} {'ms':>24} {'entries/s':>11} {'vs handwritten':>15} "
          f"{'vs pyiceberg':>13} {'CPU ms':>24} {'vs handwritten':>15} {'vs pyiceberg':>13}")
    for codec, timed in results.items():
        for name, figure in timed.items():
            used = cpu[codec][name]
            ratio = (f"{timed['handwritten']['median'] / figure['median']:.2f}x" if "handwritten" in timed else "")
            cpu_ratio = (f"{cpu[codec]['handwritten']['median'] / used['median']:.2f}x"
                         if "handwritten" in timed else "")
            ratio_pyiceberg = f"{timed['pyiceberg']['median'] / figure['median']:.2f}x"
            cpu_ratio_pyiceberg = f"{cpu[codec]['pyiceberg']['median'] / cpu[codec][name]['median']:.2f}x"
            cell = f"{figure['median']:.1f} [{figure['min']:.1f}-{figure['max']:.1f}]"
            cpu_cell = f"{used['median']:.1f} [{used['min']:.1f}-{used['max']:.1f}]"
            print(f"{codec:<8} {sizes[codec]:>10,} {name:<14} {cell:>24} "
                  f"{entries / figure['median'] * 1e3:>11,.0f} {ratio:>15} {ratio_pyiceberg:>13} "
                  f"{cpu_cell:>24} {cpu_ratio:>15} {cpu_ratio_pyiceberg:>13}")
    for name, note in notes.items():
        print(f"{name}: n/a ({note})")

    figures: dict[str, object] = {"entries": entries, "reads": repeat, "fastavro_version": fastavro.__version__,
                                  "fastavro_compiled": fastavro.read.reader.__module__ == "fastavro._read",
                                  "pyiceberg_version": pyiceberg.__version__,
                                  "pyiceberg_decoder_compiled": importlib.util.find_spec(
                                      "pyiceberg.avro.decoder_fast") is not None}
    for codec, timed in results.items():
        figures[f"{codec}_file_bytes"] = sizes[codec]
        for name, figure in timed.items():
            figures[f"{codec}_{name}_ms"] = figure["median"]
            figures[f"{codec}_{name}_ms_min"] = figure["min"]
            figures[f"{codec}_{name}_ms_max"] = figure["max"]
            figures[f"{codec}_{name}_entries_per_s"] = round(entries / figure["median"] * 1e3)
            figures[f"{codec}_{name}_cpu_ms"] = cpu[codec][name]["median"]
        if "handwritten" in timed:
            figures[f"{codec}_ratio_fastavro_vs_handwritten"] = round(
                timed["handwritten"]["median"] / timed["fastavro"]["median"], 2)
            figures[f"{codec}_cpu_ratio_fastavro_vs_handwritten"] = round(
                cpu[codec]["handwritten"]["median"] / cpu[codec]["fastavro"]["median"], 2)
        figures[f"{codec}_ratio_vs_pyiceberg"] = round(
            timed["pyiceberg"]["median"] / timed["fastavro"]["median"], 2)
        figures[f"{codec}_cpu_ratio_vs_pyiceberg"] = round(
            cpu[codec]["pyiceberg"]["median"] / cpu[codec]["fastavro"]["median"], 2)
    figures["notes"] = notes
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
