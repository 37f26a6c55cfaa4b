"""The key index (pgcdc.index.key_index) and its key codes (pgcdc.index.key_codes), against plain Python models:
a dict for a keyed mirror, a multiset of locations per row for a keyless one. No Spark, no PostgreSQL.

Every model test runs with the C hash (where built) and with the numpy one, with the index's merge threshold
lowered so that merges and compactions happen within a few operations, and with keys given as plain, chunked
and sliced Arrow tables.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pgcdc.index import disk_runs, key_codes, key_index
from pgcdc.index.disk_runs import IndexDirectory
from pgcdc.index.key_codes import NULL_CODE, KeyCoder, hash_column
from pgcdc.index.key_index import KeyIndex, Located

HASHING = pytest.mark.parametrize("hashing", ["C", "numpy"])


@contextlib.contextmanager
def hashing_by(name: str) -> Iterator[None]:
    """Codes computed by the C module or by numpy (hypothesis tests cannot use function-scoped fixtures)."""
    saved = key_codes.accelerator
    if name == "numpy":
        key_codes.accelerator = None
    elif saved is None:
        pytest.skip("the C key hash (_keyhash) is not built here")
    try:
        yield
    finally:
        key_codes.accelerator = saved


@contextlib.contextmanager
def small_merges(threshold: int = 4) -> Iterator[None]:
    """Merges of the delta after a few entries, and scans in steps of a few entries."""
    saved = key_index._MIN_MERGE, key_index._SCAN_CHUNK
    key_index._MIN_MERGE, key_index._SCAN_CHUNK = threshold, 3
    try:
        yield
    finally:
        key_index._MIN_MERGE, key_index._SCAN_CHUNK = saved


@contextlib.contextmanager
def colliding_first_words() -> Iterator[None]:
    """Hashed codes whose first word keeps 2 bits: different keys share h1 all the time, so the paths that
    tell them apart by h2 (rare with real hashes) run on every operation."""
    original = KeyCoder.codes

    def codes(self: KeyCoder, keys: pa.Table) -> key_codes.Codes:
        k1, k2 = original(self, keys)
        return (k1, k2) if k2 is None else (k1 & np.uint64(3), k2)

    KeyCoder.codes = codes  # type: ignore[method-assign]
    try:
        yield
    finally:
        KeyCoder.codes = original  # type: ignore[method-assign]


def codes_of(array: pa.Array | pa.ChunkedArray) -> list[tuple[int, int]]:
    h1, h2 = hash_column(array)
    return list(zip(h1.tolist(), h2.tolist(), strict=True))


def nan_with_bits(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<Q", bits))[0]


NANS = [nan_with_bits(b) for b in (0x7FF8000000000000, 0x7FF8000000000001, 0xFFF8000000000000, 0x7FF4000000000000)]


# -- the hash itself --------------------------------------------------------------------------------------------

# MurmurHash3_x64_128 with seed 0, as the reference implementation (mmh3.hash_bytes) gives it: (h1, h2)
REFERENCE = [
    (b"", 0x0, 0x0),
    (b"a", 0x85555565F6597889, 0xE6B53A48510E895A),
    (b"hello", 0xCBD8A7B341BD9B02, 0x5B1E906A48AE1D19),
    (b"x" * 15, 0x1CFD62BAC822C29A, 0x381530A121EFA404),
    (b"y" * 16, 0x7B3C3ADA206564BB, 0x4DC79DA8BF408784),
    (b"z" * 17, 0x109FDF94706E89D5, 0x932D936FCDC86077),
    ("é".encode() * 20, 0x07B73EC7C6EAD59B, 0x0BFED999D2CC737D),
]


@HASHING
def test_the_hash_is_murmurhash3_x64_128(hashing):
    with hashing_by(hashing):
        assert codes_of(pa.array([v for v, _, _ in REFERENCE], pa.binary())) == [(a, b) for _, a, b in REFERENCE]
        # an integer is hashed as its 8 little-endian bytes, whatever its width
        assert codes_of(pa.array([5], pa.int16())) == [(0x0FD4C5F69B6C771B, 0x008A790318490B16)]
        assert codes_of(pa.array([None, "a"])) == [NULL_CODE, (0x85555565F6597889, 0xE6B53A48510E895A)]


binary_values = st.lists(st.one_of(st.none(), st.binary(max_size=40)), max_size=60)


@settings(max_examples=60, deadline=None)
@given(values=binary_values, data_type=st.sampled_from([pa.binary(), pa.large_binary(), pa.string()]),
       cut=st.data())
def test_c_and_numpy_agree_on_every_shape(values, data_type, cut):
    """The same numbers for plain, sliced and chunked arrays, every value length, NULLs anywhere."""
    if key_codes.accelerator is None:
        pytest.skip("the C key hash (_keyhash) is not built here")
    raw = values
    if pa.types.is_string(data_type):
        values = [None if v is None else v.decode("latin-1") for v in values]
    array = pa.array(values, data_type)
    start = cut.draw(st.integers(0, len(values)))
    shapes = [array, array.slice(start), pa.chunked_array([array.slice(0, start), array.slice(start)], data_type)]
    numbers = [None if v is None else int.from_bytes(v[:8].ljust(8, b"\0"), "little", signed=True) for v in raw]
    shapes += [pa.array(numbers, pa.int64()).slice(start),  # fixed width, read in place at an offset
               pa.array(numbers, pa.int64()).slice(start).cast(pa.int32(), safe=False),
               pa.array([None if v is None else v[:16].ljust(16, b"-") for v in raw], pa.binary(16)).slice(start),
               pa.array([None if v is None else float(len(v)) for v in raw]).slice(start)]
    for shaped in shapes:
        with hashing_by("C"):
            in_c = codes_of(shaped)
        with hashing_by("numpy"):
            in_numpy = codes_of(shaped)
        assert in_c == in_numpy


# -- what equal means -----------------------------------------------------------------------------------------


def rows_equal(arrays: list[pa.Array], first: int, second: int) -> bool:
    codes = key_codes.combine([hash_column(a) for a in arrays]) if len(arrays) > 1 else hash_column(arrays[0])
    return bool(codes[0][first] == codes[0][second] and codes[1][first] == codes[1][second])


EQUAL_PAIRS: list[tuple[str, list[pa.Array]]] = [
    ("-0.0 = 0.0", [pa.array([-0.0, 0.0])]),
    ("NaN = NaN, any payload", [pa.array([NANS[0], NANS[1]])]),
    ("negative NaN = NaN", [pa.array([NANS[2], NANS[3]])]),
    ("float32 NaN = float32 NaN", [pa.array(np.array([NANS[1], NANS[2]], np.float32))]),
    ("NULL = NULL", [pa.array([None, None], pa.string())]),
    ("NULL = NULL in a nested column", [pa.array([None, None], pa.list_(pa.int32()))]),
    ("-0.0 = 0.0 inside a list", [pa.array([[-0.0, 1.0], [0.0, 1.0]])]),
    ("NaN = NaN inside a struct", [pa.array([{"x": NANS[0]}, {"x": NANS[2]}])]),
    ("a whole row with NULLs", [pa.array([None, None], pa.int64()), pa.array(["a", "a"]),
                                pa.array([None, None], pa.float64())]),
    ("far dates inside a list", [pa.array([[2_000_000_000], [2_000_000_000]], pa.list_(pa.int32())).cast(
        pa.list_(pa.date32()))]),
]

UNEQUAL_PAIRS: list[tuple[str, list[pa.Array]]] = [
    ("('ab','c') vs ('a','bc')", [pa.array(["ab", "a"]), pa.array(["c", "bc"])]),
    ("(NULL,'a') vs ('a',NULL)", [pa.array([None, "a"]), pa.array(["a", None])]),
    ("NULL vs ''", [pa.array([None, ""])]),
    ("NULL vs 0", [pa.array([None, 0], pa.int64())]),
    ("NULL vs NaN", [pa.array([None, math.nan])]),
    ("NULL vs []", [pa.array([None, []], pa.list_(pa.int32()))]),
    ("[] vs [NULL]", [pa.array([[], [None]], pa.list_(pa.int32()))]),
    ("[1,2] vs [2,1]", [pa.array([[1, 2], [2, 1]])]),
    ("{a:NULL} vs NULL", [pa.array([{"a": None}, None], pa.struct([("a", pa.int32())]))]),
    ("0.0 vs NaN", [pa.array([0.0, math.nan])]),
    ("1 vs -1", [pa.array([1, -1], pa.int8())]),
    ("false vs NULL", [pa.array([False, None])]),
    ("1.00 vs 1.01", [pa.array([Decimal("1.00"), Decimal("1.01")], pa.decimal128(5, 2))]),
]


@HASHING
@pytest.mark.parametrize(("name", "arrays"), EQUAL_PAIRS, ids=[n for n, _ in EQUAL_PAIRS])
def test_values_postgresql_calls_equal_get_one_code(hashing, name, arrays):
    with hashing_by(hashing):
        assert rows_equal(arrays, 0, 1), name


@HASHING
@pytest.mark.parametrize(("name", "arrays"), UNEQUAL_PAIRS, ids=[n for n, _ in UNEQUAL_PAIRS])
def test_different_values_get_different_codes(hashing, name, arrays):
    with hashing_by(hashing):
        assert not rows_equal(arrays, 0, 1), name


@HASHING
def test_storage_widths_do_not_change_codes(hashing):
    with hashing_by(hashing):
        values = [0, 1, -1, 127, None]
        by_width = [codes_of(pa.array(values, t)) for t in (pa.int8(), pa.int16(), pa.int32(), pa.int64())]
        assert all(c == by_width[0] for c in by_width)
        texts = ["a", "", None, "ü" * 9]
        assert codes_of(pa.array(texts, pa.string())) == codes_of(pa.array(texts, pa.large_string()))
        assert codes_of(pa.array(texts, pa.string())) == codes_of(pa.array(texts, pa.string_view()))
        assert codes_of(pa.array(texts).dictionary_encode()) == codes_of(pa.array(texts))


def test_integer_keys_are_their_values():
    coder = KeyCoder.for_schema(pa.schema([("id", pa.int32())]), integer_allowed=True)
    assert coder.integer
    k1, k2 = coder.codes(pa.table({"id": pa.array([3, -7, 2**31 - 1], pa.int32())}))
    assert k2 is None and k1.tolist() == [3, -7, 2**31 - 1] and k1.dtype == np.int64
    day = KeyCoder.for_schema(pa.schema([("d", pa.date32())]), integer_allowed=True)
    far = pa.array([-2_451_545, 2_145_031_948], pa.int32()).cast(pa.date32())  # 4713 BC .. 5874897 AD
    assert day.codes(pa.table({"d": far}))[0].tolist() == [-2_451_545, 2_145_031_948]
    assert not KeyCoder.for_schema(pa.schema([("id", pa.int32())]), integer_allowed=False).integer
    assert not KeyCoder.for_schema(pa.schema([("a", pa.int32()), ("b", pa.int32())]), integer_allowed=True).integer
    with pytest.raises(ValueError, match="NULL"):
        coder.codes(pa.table({"id": pa.array([1, None], pa.int32())}))


def test_the_c_module_checks_every_buffer():
    accelerator = key_codes.accelerator
    if accelerator is None:
        pytest.skip("the C key hash (_keyhash) is not built here")
    out1, out2 = np.empty(4, np.uint64), np.empty(4, np.uint64)
    offsets = np.array([0, 1, 2, 3, 4], np.int32).tobytes()
    with pytest.raises(ValueError, match="offsets buffer"):
        accelerator.hash_binary(4, 1, None, offsets, 4, b"abcd", out1, out2)
    with pytest.raises(ValueError, match="outside the data buffer"):
        accelerator.hash_binary(4, 0, None, np.array([0, 1, 2, 3, 9], np.int32).tobytes(), 4, b"abcd", out1, out2)
    with pytest.raises(ValueError, match="outside the data buffer"):
        accelerator.hash_binary(2, 0, None, np.array([0, 3, 1], np.int64).tobytes(), 8, b"abcd", out1, out2)
    with pytest.raises(ValueError, match="outside the data buffer"):
        accelerator.hash_binary(1, 0, None, np.array([-1, 1], np.int32).tobytes(), 4, b"abcd", out1, out2)
    with pytest.raises(ValueError, match="validity"):
        accelerator.hash_binary(4, 5, b"\xff", offsets * 3, 4, b"abcd", out1, out2)
    with pytest.raises(ValueError, match="output"):
        accelerator.hash_binary(4, 0, None, offsets, 4, b"abcd", out1[:2], out2)
    with pytest.raises(ValueError, match="offset_width"):
        accelerator.hash_binary(4, 0, None, offsets, 2, b"abcd", out1, out2)
    with pytest.raises(ValueError, match="non-negative"):
        accelerator.hash_fixed(-1, 0, None, b"", 8, out1, out2)
    with pytest.raises(ValueError, match="data buffer"):
        accelerator.hash_fixed(4, 1, None, b"x" * 32, 8, out1, out2)
    with pytest.raises(ValueError, match="data buffer"):
        accelerator.hash_fixed(1, 2**62, None, b"x" * 32, 8, out1, out2)
    with pytest.raises((TypeError, BufferError)):
        accelerator.hash_fixed(1, 0, None, b"x" * 8, 8, b"read-only", out2)
    # a NULL's offsets are never read, however odd
    accelerator.hash_binary(2, 0, b"\x01", np.array([0, 1, 99], np.int32).tobytes(), 4, b"a", out1, out2)
    assert (int(out1[1]), int(out2[1])) == NULL_CODE


# -- keyed and multiset indexes against models ------------------------------------------------------------------


@dataclass(frozen=True)
class KeyKind:
    """One kind of key: Python values (``model`` turns them into what equality means) and their Arrow form."""

    name: str
    values: st.SearchStrategy
    to_arrow: Callable[[list[Any]], pa.Table]
    model: Callable[[Any], Any] = lambda value: value


def canonical(value: Any) -> Any:
    if isinstance(value, float):
        return "NaN" if math.isnan(value) else value + 0.0
    if isinstance(value, list | tuple):
        return tuple(canonical(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, canonical(v)) for k, v in value.items()))
    return value


def one_column(data_type: pa.DataType) -> Callable[[list[Any]], pa.Table]:
    return lambda values: pa.table({"k": pa.array(values, data_type)})


def int_column(data_type: pa.DataType) -> Callable[[list[Any]], pa.Table]:
    return lambda values: pa.table({"k": pa.array(values, pa.int64()).cast(pa.int32() if data_type == pa.date32()
                                                                          else pa.int64()).cast(data_type)})


def composite(values: list[tuple[int, str]]) -> pa.Table:
    return pa.table({"a": pa.array([v[0] for v in values], pa.int32()),
                     "b": pa.array([v[1] for v in values], pa.string())})


def whole_rows(values: list[tuple]) -> pa.Table:
    return pa.table({"n": pa.array([v[0] for v in values], pa.int16()),
                     "t": pa.array([v[1] for v in values], pa.string()),
                     "f": pa.array([v[2] for v in values], pa.float64()),
                     "l": pa.array([v[3] for v in values], pa.list_(pa.int16()))})


small_text = st.text(alphabet="ab\u00e9", max_size=3)
FLOATS = st.sampled_from([0.0, -0.0, 1.5, -1.5, math.inf, *NANS])
KEYED_KINDS = [
    KeyKind("bigint", st.integers(-3, 3) | st.sampled_from([-(2**63), 2**63 - 1]), one_column(pa.int64())),
    KeyKind("smallint", st.integers(-5, 5), one_column(pa.int16())),
    KeyKind("date", st.integers(-2_451_545, -2_451_540) | st.just(2_145_031_948), int_column(pa.date32())),
    KeyKind("timestamptz", st.sampled_from([0, 1, -1, 2**62, -(2**62)]), int_column(pa.timestamp("us", "UTC"))),
    KeyKind("text", small_text, one_column(pa.string())),
    KeyKind("large text", small_text, one_column(pa.large_string())),
    KeyKind("bytea", st.binary(max_size=2), one_column(pa.binary())),
    KeyKind("uuid", st.sampled_from([bytes([i]) * 16 for i in range(5)]), one_column(pa.binary(16))),
    KeyKind("numeric", st.sampled_from([Decimal("0.00"), Decimal("1.50"), Decimal("-1.50"), Decimal("12.34")]),
            one_column(pa.decimal128(6, 2))),
    KeyKind("float8", FLOATS, one_column(pa.float64()), canonical),
    KeyKind("boolean", st.booleans(), one_column(pa.bool_())),
    KeyKind("composite (int4, text)", st.tuples(st.integers(0, 2), st.sampled_from(["", "a", "ab", "b"])),
            composite),
    KeyKind("int4[]", st.lists(st.integers(0, 1), max_size=2), one_column(pa.list_(pa.int32())), canonical),
    KeyKind("composite type", st.fixed_dictionaries({"x": st.integers(0, 2), "y": FLOATS}),
            one_column(pa.struct([("x", pa.int32()), ("y", pa.float64())])), canonical),
]
MULTISET_KINDS = [
    KeyKind("whole rows with NULLs", st.tuples(st.none() | st.integers(0, 1), st.none() | st.sampled_from(["a", ""]),
                                               st.none() | FLOATS, st.none() | st.lists(st.integers(0, 1),
                                                                                        max_size=1)),
            whole_rows, canonical),
    KeyKind("one nullable int column", st.none() | st.integers(0, 2), one_column(pa.int32())),
    KeyKind("one text column", st.sampled_from(["x", "y", "z"]), one_column(pa.string())),
]


def shaped(table: pa.Table, how: int) -> pa.Table:
    """The same rows as the index may receive them: as is, in several chunks, or a slice of a larger table."""
    if how == 1 and table.num_rows > 1:
        middle = table.num_rows // 2
        return pa.Table.from_batches(table.slice(0, middle).to_batches() + table.slice(middle).to_batches())
    if how == 2:
        padded = pa.concat_tables([table.slice(0, 1), table, table.slice(0, 1)]) if table.num_rows else table
        return padded.slice(1, table.num_rows).combine_chunks() if table.num_rows else table
    return table


class Files:
    """Data files of the model: each add writes a new one (data files are immutable)."""

    def __init__(self) -> None:
        self.count = 0

    def new(self) -> str:
        self.count += 1
        return f"file:///warehouse/db/t/data/{self.count:05d}-0-part.parquet"


class Place:
    """Where a model test keeps its index: in memory, or on disk in tiny blocks with a tiny memory share (so that
    its runs span many blocks, large adds spill, and checkpoints rewrite the run), reopened from its manifest.
    On disk a run a checkpoint starts writing in the background is held unfinished until the test draws
    :meth:`finish_rewrite` (or the index itself waits for it): the changes drawn meanwhile are replayed onto it.
    On disk a run's locations are packed in 32 bits; with ``where="disk, mixed widths"`` the limit is lowered to
    6 bits, so that runs of one or two files with positions below 32 pack and the others keep 8-byte locations."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.directory: IndexDirectory | None = None
        self.gate = threading.Event()  # set: a run being written in the background may finish

    def new(self, *, multiset: bool) -> KeyIndex:
        if self.where == "memory":
            return KeyIndex(multiset=multiset)
        import tempfile
        from pathlib import Path

        if self.directory is not None:  # the previous example's index
            import shutil

            self.directory.close()
            shutil.rmtree(self.directory.path, ignore_errors=True)
        self.directory = IndexDirectory(Path(tempfile.mkdtemp(prefix="pgcdc-index-test-")))
        return KeyIndex(multiset=multiset, disk=self.directory, overlay_bytes=0)

    def reopened(self, index: KeyIndex, key_schema: pa.Schema, draw: Callable[[str], bool]) -> KeyIndex:
        """The index as a restart finds it: checkpointed (when asked) and opened from its manifest."""
        if self.directory is None:
            return index
        if draw("checkpoint"):
            index.checkpoint(7, [1], force=True)
            index.close()
            manifest = self.directory.read_manifest()
            assert manifest is not None and manifest.snapshot_id == 7
            return KeyIndex.opened(self.directory, manifest, key_schema, overlay_bytes=0)
        index.checkpoint(7, [1])
        return index

    def committed(self, index: KeyIndex, draw: Callable[[str], bool]) -> None:
        """After a change, perhaps the checkpoint a commit makes (which may start a run in the background)."""
        if self.directory is not None and draw("checkpoint after it"):
            index.checkpoint(7, [1])

    def finish_rewrite(self, index: KeyIndex) -> None:
        """Lets the run being written in the background (if any) finish, and waits until it has."""
        rewrite = index._rewriting
        if rewrite is not None:
            self.gate.set()
            rewrite.wait()
            self.gate.clear()

    @contextlib.contextmanager
    def blocks(self) -> Iterator[None]:
        saved = disk_runs.BLOCK, key_index._MIN_OVERLAY, disk_runs.PACKED_BITS
        merge, wait = key_index._merge_sources, key_index._Rewrite.wait
        gate = self.gate

        def held_merge(*args: Any, **kwargs: Any) -> Iterator[Any]:
            if threading.current_thread() is not threading.main_thread():
                gate.wait(timeout=60)
            yield from merge(*args, **kwargs)

        def waited(rewrite: Any) -> None:
            gate.set()  # the index waits for the run: it may finish now
            wait(rewrite)
            gate.clear()

        if self.where != "memory":
            # "disk": a share of 4 entries, so that most adds place their rows without spilling them (a spill
            # writes the run at once) and the runs written in the background see changes; otherwise 2
            disk_runs.BLOCK, key_index._MIN_OVERLAY = 3, 4 if self.where == "disk" else 2
            key_index._merge_sources, key_index._Rewrite.wait = held_merge, waited  # type: ignore[method-assign]
        if self.where == "disk, mixed widths":
            disk_runs.PACKED_BITS = 6
        try:
            yield
        finally:
            key_index._merge_sources, key_index._Rewrite.wait = merge, wait  # type: ignore[method-assign]
            gate.set()
            disk_runs.BLOCK, key_index._MIN_OVERLAY, disk_runs.PACKED_BITS = saved
            if self.directory is not None:
                import shutil

                self.directory.close()
                shutil.rmtree(self.directory.path, ignore_errors=True)


def located_entries(index: KeyIndex, located: Located) -> list[tuple[str, int] | None]:
    return [None if f < 0 else (index.path(int(f)), int(p))
            for f, p in zip(located.file_ids.tolist(), located.positions.tolist(), strict=True)]


def without_hint(located: Located) -> Located:
    return Located(located.file_ids.copy(), located.positions.copy())


INTEGER_KINDS = {"bigint", "smallint", "date", "timestamptz"}  # not hashed: first words cannot collide
KEYED_CASES = [pytest.param(kind, collide, "memory",
                             id=f"{kind.name}-{'colliding first words' if collide else 'real hashes'}")
               for kind in KEYED_KINDS for collide in (False, True) if not (collide and kind.name in INTEGER_KINDS)]
ON_DISK = {"bigint", "text", "composite (int4, text)", "float8"}
ON_DISK_PLACES = {"disk": "on disk", "disk, mixed widths": "on disk, 4- and 8-byte locations"}
KEYED_CASES += [pytest.param(kind, collide, where,
                             id=f"{kind.name}-{'colliding first words' if collide else 'real hashes'}-{label}")
                for kind in KEYED_KINDS for collide in (False, True) for where, label in ON_DISK_PLACES.items()
                if kind.name in ON_DISK and not (collide and kind.name in INTEGER_KINDS)]


@HASHING
@pytest.mark.parametrize(("kind", "collide", "where"), KEYED_CASES)
def test_keyed_index_against_a_dict(hashing, kind, collide, where):
    place = Place(where)

    @settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(data=st.data())
    def run(data):
        index = place.new(multiset=False)
        model: dict[Any, tuple[str, int]] = {}
        raw: dict[Any, Any] = {}  # a value of each key, as Arrow receives it
        files = Files()
        paths: list[str] = []
        answers: list[Located] = []  # find results, to forget later (perhaps after other changes)
        for _ in range(data.draw(st.integers(1, 14), label="operations")):
            op = data.draw(st.sampled_from(["add", "add", "find", "forget", "drop_file", "drop_positions",
                                            "restart", "finish rewrite"]))
            if op == "finish rewrite":
                place.finish_rewrite(index)
                answers.clear()  # the new run's slots
            elif op == "restart" and index.rows:
                index = place.reopened(index, kind.to_arrow([]).schema, lambda label: data.draw(st.booleans(),
                                                                                               label=label))
                answers.clear()  # a Located names slots and file ids of the index that answered it
            elif op == "add":
                values = data.draw(st.lists(kind.values, max_size=8), label="rows")
                path = files.new()
                positions = None
                if data.draw(st.booleans(), label="explicit positions"):
                    positions = np.array(sorted(data.draw(st.sets(st.integers(0, 50), min_size=len(values),
                                                                  max_size=len(values)))), np.int64)
                    positions = positions[data.draw(st.permutations(range(len(values))))] if values else positions
                index.add(path, shaped(kind.to_arrow(values), data.draw(st.integers(0, 2))), positions)
                paths.append(path)
                for row, value in enumerate(values):  # a later row of the same key wins
                    model[kind.model(value)] = (path, row if positions is None else int(positions[row]))
                    raw[kind.model(value)] = value
            elif op == "find":
                values = data.draw(st.lists(kind.values, max_size=8), label="queries")
                located = index.find(shaped(kind.to_arrow(values), data.draw(st.integers(0, 2))))
                assert located_entries(index, located) == [model.get(kind.model(v)) for v in values]
                answers.append(located)
            elif op == "forget" and answers:
                located = answers.pop(data.draw(st.integers(0, len(answers) - 1)))
                entries = {e for e in located_entries_safe(index, located) if e is not None}
                index.forget(located if data.draw(st.booleans(), label="with hint") else without_hint(located))
                for key in [k for k, at in model.items() if at in entries]:
                    del model[key]
            elif op == "drop_file" and paths:
                path = data.draw(st.sampled_from(paths))
                expected = [k for k, at in model.items() if at[0] == path]
                assert index.drop_file(path) == len(expected)
                for key in expected:
                    del model[key]
            elif op == "drop_positions" and paths:
                path = data.draw(st.sampled_from(paths))
                positions = data.draw(st.lists(st.integers(0, 50), max_size=6))
                expected = [k for k, at in model.items() if at[0] == path and at[1] in positions]
                assert index.drop_positions(path, np.array(positions, np.int64)) == len(expected)
                for key in expected:
                    del model[key]
            assert index.rows == len(model)
            place.committed(index, lambda label: data.draw(st.booleans(), label=label))
        everything = list(model)
        located = index.find(kind.to_arrow([raw[k] for k in everything]))
        assert located_entries(index, located) == [model[k] for k in everything]
        index.close()

    with hashing_by(hashing), small_merges(), place.blocks(), \
            colliding_first_words() if collide else contextlib.nullcontext():
        run()


def located_entries_safe(index: KeyIndex, located: Located) -> list[tuple[str, int] | None]:
    """Entries of a Located whose files may have been dropped since (their ids no longer resolve)."""
    out: list[tuple[str, int] | None] = []
    for f, p in zip(located.file_ids.tolist(), located.positions.tolist(), strict=True):
        try:
            out.append(None if f < 0 else (index.path(f), p))
        except KeyError:
            out.append(None)
    return out


@HASHING
@pytest.mark.parametrize("where", ["memory", *ON_DISK_PLACES], ids=["in memory", *ON_DISK_PLACES.values()])
@pytest.mark.parametrize("collide", [False, True], ids=["real hashes", "colliding first words"])
@pytest.mark.parametrize("kind", MULTISET_KINDS, ids=[k.name for k in MULTISET_KINDS])
def test_multiset_index_against_a_multiset(hashing, collide, kind, where):
    place = Place(where)

    @settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(data=st.data())
    def run(data):
        index = place.new(multiset=True)
        model: dict[tuple[str, int], Any] = {}  # location -> row
        raw: dict[Any, Any] = {}  # a value of each row, as Arrow receives it
        files = Files()
        paths: list[str] = []
        for _ in range(data.draw(st.integers(1, 14), label="operations")):
            op = data.draw(st.sampled_from(["add", "add", "take", "take", "drop_file", "drop_positions",
                                            "restart", "finish rewrite"]))
            if op == "finish rewrite":
                place.finish_rewrite(index)
            elif op == "restart" and index.rows:
                index = place.reopened(index, kind.to_arrow([]).schema, lambda label: data.draw(st.booleans(),
                                                                                               label=label))
            elif op == "add":
                values = data.draw(st.lists(kind.values, max_size=8), label="rows")
                path = files.new()
                index.add(path, shaped(kind.to_arrow(values), data.draw(st.integers(0, 2))))
                paths.append(path)
                model.update({(path, row): kind.model(v) for row, v in enumerate(values)})
                raw.update({kind.model(v): v for v in values})
            elif op == "take":
                values = data.draw(st.lists(kind.values, max_size=6), label="rows to take")
                counts = np.array(data.draw(st.lists(st.integers(0, 3), min_size=len(values),
                                                     max_size=len(values))), np.int64)
                located = index.take(shaped(kind.to_arrow(values), data.draw(st.integers(0, 2))), counts)
                entries = located_entries(index, located)
                assert len(set(entries)) == len(entries), "an entry handed out twice"
                # rows take from their key's entries in row order: row i gets what earlier rows left
                available = Counter(model.values())
                start = 0
                for value, count in zip(values, counts.tolist(), strict=True):
                    key = kind.model(value)
                    got = min(count, available[key])
                    available[key] -= got
                    assert all(model.get(e) == key for e in entries[start:start + got])  # type: ignore[arg-type]
                    start += got
                assert start == len(entries)
                if data.draw(st.booleans(), label="forget them"):
                    index.forget(located if data.draw(st.booleans(), label="with hint") else without_hint(located))
                    for entry in entries:
                        del model[entry]  # type: ignore[arg-type]
            elif op == "drop_file" and paths:
                path = data.draw(st.sampled_from(paths))
                expected = [at for at in model if at[0] == path]
                assert index.drop_file(path) == len(expected)
                for at in expected:
                    del model[at]
            elif op == "drop_positions" and paths:
                path = data.draw(st.sampled_from(paths))
                positions = data.draw(st.lists(st.integers(0, 9), max_size=6))
                expected = [at for at in model if at[0] == path and at[1] in positions]
                assert index.drop_positions(path, np.array(positions, np.int64)) == len(expected)
                for at in expected:
                    del model[at]
            assert index.rows == len(model)
            place.committed(index, lambda label: data.draw(st.booleans(), label=label))
        # at the end every entry can be taken, each exactly once
        held = Counter(model.values())
        if held:
            keys = list(held)
            located = index.take(kind.to_arrow([raw[k] for k in keys]), np.array([held[k] + 1 for k in keys]))
            assert sorted(located_entries(index, located)) == sorted(model)  # type: ignore[type-var]
        index.close()

    with hashing_by(hashing), small_merges(), place.blocks(), \
            colliding_first_words() if collide else contextlib.nullcontext():
        run()


# -- the rules, one by one ------------------------------------------------------------------------------------


def ids(values: list[int]) -> pa.Table:
    return pa.table({"id": pa.array(values, pa.int64())})


def test_a_keyed_add_of_a_held_key_replaces_its_entry():
    index = KeyIndex(multiset=False)
    index.add("a.parquet", ids([1, 2, 3]))
    index.add("b.parquet", ids([2]), np.array([7]))
    assert located_entries(index, index.find(ids([1, 2, 3]))) == [("a.parquet", 0), ("b.parquet", 7),
                                                                   ("a.parquet", 2)]
    assert index.rows == 3
    index.find(ids([0]))  # placed
    index.add("c.parquet", ids([2, 2]))  # one file holding a key twice: its later row wins
    assert located_entries(index, index.find(ids([2]))) == [("c.parquet", 1)]
    assert index.rows == 3


def test_a_forgotten_key_that_comes_back_takes_its_old_slot():
    index = KeyIndex(multiset=False)
    index.add("a.parquet", ids(list(range(100))))
    index.forget(index.find(ids([5, 6])))
    assert index.rows == 98
    index.add("b.parquet", ids([5, 6]))
    assert located_entries(index, index.find(ids([5, 6]))) == [("b.parquet", 0), ("b.parquet", 1)]
    assert index.rows == 100 and len(index._main) + len(index._delta) == 100  # no new slot


def test_take_never_hands_out_an_entry_twice_nor_more_than_exist():
    index = KeyIndex(multiset=True)
    rows = pa.table({"a": pa.array([1, 1, 1, None], pa.int32()), "b": pa.array(["x", "x", "x", None])})
    index.add("a.parquet", rows)
    same = pa.table({"a": pa.array([1, 1, None, None], pa.int32()), "b": pa.array(["x", "x", None, None])})
    located = index.take(same, np.array([2, 5, 1, 1]))
    assert located_entries(index, located) == [("a.parquet", 0), ("a.parquet", 1), ("a.parquet", 2),
                                               ("a.parquet", 3)]
    index.forget(located)
    assert index.rows == 0
    assert len(index.take(same, np.array([1, 1, 1, 1]))) == 0


def test_take_works_for_a_keyed_index_too():
    index = KeyIndex(multiset=False)
    index.add("a.parquet", ids([10, 20]))
    assert located_entries(index, index.take(ids([20, 30, 20, 10]), np.ones(4, np.int64))) == [
        ("a.parquet", 1), ("a.parquet", 0)]


def test_forget_after_entries_moved_still_removes_exactly_them():
    index = KeyIndex(multiset=False)
    index.add("a.parquet", ids(list(range(10))))
    located = index.find(ids([3, 4]))
    with small_merges(1):
        index.add("b.parquet", ids(list(range(100, 200))))  # placed at the next read: the slots move
        index.find(ids([0]))
    index.forget(located)
    assert located_entries(index, index.find(ids([3, 4, 5]))) == [None, None, ("a.parquet", 5)]
    assert index.rows == 108


def test_forget_skips_entries_a_later_add_moved():
    index = KeyIndex(multiset=False)
    index.add("a.parquet", ids([1, 2]))
    old = index.find(ids([1, 2]))
    index.add("b.parquet", ids([1]))  # key 1 moved on before its old row's delete was committed
    index.find(ids([0]))  # placed: key 1's slot now holds b.parquet's row (no entry changed slots)
    index.forget(old)
    assert located_entries(index, index.find(ids([1, 2]))) == [("b.parquet", 0), None]
    assert index.rows == 1


def test_files_ids_and_paths():
    index = KeyIndex(multiset=False)
    path = "s3a://bucket/warehouse/db/t/data/00000-1-4d7a.parquet"
    index.add(path, ids([1, 2]))
    file_id = index.file_id(path)
    assert file_id is not None and index.path(file_id) == path
    assert index.drop_file(path) == 2
    assert index.file_id(path) is None
    with pytest.raises(KeyError):
        index.path(file_id)
    index.add(path, ids([1]))
    assert index.file_id(path) != file_id  # an id is never given to another file
    assert index.drop_file("never-added.parquet") == 0
    assert index.drop_positions("never-added.parquet", np.array([1])) == 0


@contextlib.contextmanager
def held_background_runs(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """Runs written in the background wait for the event before they start (the index waiting for one sets it)."""
    gate = threading.Event()
    merge, wait = key_index._merge_sources, key_index._Rewrite.wait

    def held_merge(*args: Any, **kwargs: Any) -> Iterator[Any]:
        if threading.current_thread() is not threading.main_thread():  # a run written now is not held
            gate.wait(timeout=60)
        yield from merge(*args, **kwargs)

    def waited(rewrite: Any) -> None:
        gate.set()
        wait(rewrite)

    monkeypatch.setattr(key_index, "_merge_sources", held_merge)
    monkeypatch.setattr(key_index._Rewrite, "wait", waited)
    monkeypatch.setattr(key_index, "_MIN_OVERLAY", 8)  # a share of 8 entries: a run is written past 8 changes
    try:
        yield gate
    finally:
        gate.set()


def saved_snapshot(directory: IndexDirectory) -> int | None:
    manifest = directory.read_manifest()
    assert manifest is not None
    return manifest.snapshot_id


def adopted(index: KeyIndex, directory: IndexDirectory, gate: threading.Event, snapshot: int) -> None:
    """Lets the run being written finish, and checkpoints until the index has taken it (its manifest saved)."""
    gate.set()
    for _ in range(6000):
        index.checkpoint(snapshot, [1])
        if saved_snapshot(directory) != 1:
            return
        time.sleep(0.01)
    raise AssertionError("the run written in the background was never taken")


def test_a_keyed_index_replays_onto_a_run_written_in_the_background_what_changed_meanwhile(tmp_path, monkeypatch):
    """A checkpoint past the index's share starts the new run in the background from the index as it stands; the
    batches go on, and once the run is written the changes made meanwhile are replayed onto it. The run and its
    manifest describe the snapshot it was started at, exactly: a restart from them re-applies what followed."""
    with held_background_runs(monkeypatch) as gate:
        directory = IndexDirectory(tmp_path / "index")
        index = KeyIndex(multiset=False, disk=directory, overlay_bytes=0)
        index.add("a.parquet", ids(list(range(100))))
        index.checkpoint(1, [1], force=True)
        index.add("b.parquet", ids(list(range(8))))  # eight keys move and one goes: past the share
        index.forget(index.find(ids([20])))
        at_two = {key: ("b.parquet", key) if key < 8 else ("a.parquet", key) for key in range(100) if key != 20}
        index.checkpoint(2, [1])  # the run of snapshot 2 starts in the background, held
        assert saved_snapshot(directory) == 1
        # meanwhile: a key deleted, one deleted and back, one moved twice, a new one, a delete by position, a key
        # of a file added since the freeze deleted
        index.forget(index.find(ids([5, 6])))
        index.add("c.parquet", ids([6, 7, 100, 30]))
        index.add("d.parquet", ids([7]))
        assert index.drop_positions("a.parquet", np.array([50, 51])) == 2
        index.forget(index.find(ids([30])))
        index.checkpoint(3, [1])
        assert saved_snapshot(directory) == 1  # the run is not written yet: the manifest still names the old one
        now = dict(at_two)
        del now[5], now[50], now[51], now[30]
        now.update({6: ("c.parquet", 0), 7: ("d.parquet", 0), 100: ("c.parquet", 2)})
        everything = list(range(102))
        assert located_entries(index, index.find(ids(everything))) == [now.get(key) for key in everything]

        adopted(index, directory, gate, 3)
        assert saved_snapshot(directory) == 2
        assert located_entries(index, index.find(ids(everything))) == [now.get(key) for key in everything]
        assert index.rows == len(now)
        index.add("e.parquet", ids([8]))  # the index goes on from the new run
        now[8] = ("e.parquet", 0)
        assert located_entries(index, index.find(ids(everything))) == [now.get(key) for key in everything]
        index.close()
        # what a restart opens: snapshot 2, exactly
        manifest = directory.read_manifest()
        assert manifest is not None
        reopened = KeyIndex.opened(directory, manifest, ids([]).schema, overlay_bytes=0)
        assert located_entries(reopened, reopened.find(ids(everything))) == [at_two.get(key) for key in everything]
        reopened.close()
        names = {path.name.split(".")[0] for path in directory.path.iterdir()} - {"index", "lock"}
        assert names == {manifest.run.name}  # the old run is gone, nothing left half-written


def test_a_multiset_replays_onto_a_run_written_in_the_background_what_changed_meanwhile(tmp_path, monkeypatch):
    with held_background_runs(monkeypatch) as gate:
        directory = IndexDirectory(tmp_path / "index")
        index = KeyIndex(multiset=True, disk=directory, overlay_bytes=0)
        index.add("a.parquet", ids([1, 1, 1, 2, 2, 3] * 3))
        index.checkpoint(1, [1], force=True)
        index.add("b.parquet", ids([1, 2, 4, 1, 2, 4, 1, 2]))
        index.forget(index.take(ids([3]), np.array([1])))  # nine changes: past the share
        index.checkpoint(2, [1])
        assert saved_snapshot(directory) == 1
        at_two = Counter({1: 12, 2: 9, 3: 2, 4: 2})
        # meanwhile: copies of the run taken, copies added since taken, copies added and kept, a file dropped
        index.forget(index.take(ids([1, 3]), np.array([2, 1])))
        index.add("c.parquet", ids([3, 5, 5]))
        index.forget(index.take(ids([5]), np.array([1])))
        assert index.drop_file("b.parquet") == 8
        now = at_two - Counter({1: 2 + 3, 3: 1, 2: 3, 4: 2}) + Counter({3: 1, 5: 1})

        def held(index: KeyIndex) -> Counter[int]:
            located = index.take(ids(list(range(7))), np.full(7, 100))
            entries = located_entries(index, located)
            assert len(set(entries)) == len(entries)  # never an entry twice
            return Counter(owner[entry] for entry in entries if entry is not None)

        owner: dict[tuple[str, int], int] = {}
        for path, values in [("a.parquet", [1, 1, 1, 2, 2, 3] * 3), ("b.parquet", [1, 2, 4, 1, 2, 4, 1, 2]),
                             ("c.parquet", [3, 5, 5])]:
            owner.update({(path, row): value for row, value in enumerate(values)})
        adopted(index, directory, gate, 3)
        assert saved_snapshot(directory) == 2
        assert index.rows == sum(now.values())
        assert held(index) == now
        index.close()
        manifest = directory.read_manifest()
        assert manifest is not None
        reopened = KeyIndex.opened(directory, manifest, ids([]).schema, overlay_bytes=0)
        assert held(reopened) == at_two  # the run describes snapshot 2
        reopened.close()


KILLED_WHILE_WRITING = """
import os, sys
import numpy as np, pyarrow as pa
from pathlib import Path
from pgcdc.index import disk_runs, key_index
from pgcdc.index.disk_runs import IndexDirectory
from pgcdc.index.key_index import KeyIndex

key_index._MIN_OVERLAY = 8
ids = lambda values: pa.table({"id": pa.array(values, pa.int64())})
index = KeyIndex(multiset=False, disk=IndexDirectory(Path(sys.argv[1])), overlay_bytes=0)
index.add("a.parquet", ids(list(range(100))))
index.checkpoint(1, [1], force=True)
append = disk_runs.RunWriter.append

def killed(self, *args):
    append(self, *args)
    os._exit(9)  # the process dies with the run half-written: no cleanup, as a SIGKILL

disk_runs.RunWriter.append = killed
index.add("b.parquet", ids(list(range(8))))
index.forget(index.find(ids([20])))
index.checkpoint(2, [1])  # the run of snapshot 2 starts in the background
index.add("c.parquet", ids([200]))
index._rewriting.wait()
"""


def test_a_kill_while_a_run_is_written_in_the_background_leaves_the_saved_index(tmp_path):
    """The manifest names a run only once it is written: a kill while the background writes one leaves the last
    saved run and its snapshot (what followed is read again from the table), and the half-written files go at the
    next save."""
    import subprocess
    import sys

    finished = subprocess.run([sys.executable, "-c", KILLED_WHILE_WRITING, str(tmp_path / "index")], check=False)
    assert finished.returncode == 9
    directory = IndexDirectory(tmp_path / "index")
    manifest = directory.read_manifest()
    assert manifest is not None and manifest.snapshot_id == 1
    left = {path.name.split(".")[0] for path in directory.path.iterdir()} - {"index", "lock"}
    assert len(left) == 2  # the saved run, and the one half-written
    index = KeyIndex.opened(directory, manifest, ids([]).schema, overlay_bytes=0)
    assert located_entries(index, index.find(ids([0, 20, 99, 200]))) == [
        ("a.parquet", 0), ("a.parquet", 20), ("a.parquet", 99), None]
    index.add("b.parquet", ids([0]))
    index.checkpoint(3, [1], force=True)
    manifest = directory.read_manifest()
    assert manifest is not None and manifest.snapshot_id == 3
    assert {path.name.split(".")[0] for path in directory.path.iterdir()} - {"index", "lock"} == {manifest.run.name}
    index.close()


def test_changes_that_outrun_a_background_run_wait_for_it(tmp_path, monkeypatch):
    """What sits in memory beside the run stays bounded however slow the disk: past two shares of changes while a
    run is being written, the next change waits for that run and takes it."""
    with held_background_runs(monkeypatch):
        directory = IndexDirectory(tmp_path / "index")
        index = KeyIndex(multiset=False, disk=directory, overlay_bytes=0)
        index.add("a.parquet", ids(list(range(1000))))
        index.checkpoint(1, [1], force=True)
        index.add("b.parquet", ids(list(range(8))))
        index.forget(index.find(ids([20])))
        index.checkpoint(2, [1])
        assert saved_snapshot(directory) == 1
        for number in range(40):  # no checkpoint: the batches go on
            index.add(f"c{number}.parquet", ids([100 + number]))
            index.find(ids([0]))
        assert saved_snapshot(directory) == 2  # taken by a change, without a checkpoint
        assert index.memory_bytes < 1 << 20
        assert located_entries(index, index.find(ids([0, 100, 139]))) == [
            ("b.parquet", 0), ("c0.parquet", 0), ("c39.parquet", 0)]
        index.close()


@pytest.mark.parametrize("where", ["memory", "disk"])
def test_a_rewritten_file_is_retired_once_its_keys_moved(tmp_path, where):
    """A file whose rows a compaction or a fold wrote elsewhere leaves a keyed index without a pass over it: its
    live keys were added to the new file first (their entries moved), its deleted ones forgotten. A multiset's
    copies do not move: its retired files are dropped by a pass."""
    from pgcdc.index.disk_runs import IndexDirectory

    disk = IndexDirectory(tmp_path / "index") if where == "disk" else None
    index = KeyIndex(multiset=False, disk=disk, overlay_bytes=1 << 20)
    index.add("a.parquet", ids(list(range(10))))
    index.checkpoint(1, [1], force=True)  # on disk: a.parquet is named by the run itself
    index.forget(index.find(ids([3])))
    index.add("b.parquet", ids([0, 1, 2, 4, 5, 6, 7, 8, 9]))  # the rewrite of a.parquet's live rows
    index.retire_files(["a.parquet"])
    assert index.file_id("a.parquet") is None and index.rows == 9
    assert located_entries(index, index.find(ids([0, 3, 9]))) == [("b.parquet", 0), None, ("b.parquet", 8)]
    copies = KeyIndex(multiset=True)
    row = pa.table({"v": pa.array(["x", "x"])})
    copies.add("a.parquet", row)
    copies.add("b.parquet", row)  # the same two copies, rewritten
    copies.retire_files(["a.parquet"])
    assert copies.rows == 2
    assert located_entries(copies, copies.take(row.slice(0, 1), np.array([5]))) == [("b.parquet", 0),
                                                                                    ("b.parquet", 1)]


def test_arguments_are_checked_before_anything_changes():
    index = KeyIndex(multiset=False)
    index.add("a.parquet", ids([1]))
    with pytest.raises(ValueError, match="kinds"):
        index.add("b.parquet", pa.table({"id": pa.array(["1"])}))
    with pytest.raises(ValueError, match="kinds"):
        index.find(pa.table({"id": pa.array([1]), "other": pa.array([2])}))
    with pytest.raises(ValueError, match="2 positions for 1 key rows"):
        index.add("b.parquet", ids([1]), np.array([1, 2]))
    with pytest.raises(ValueError, match=r"\[0, 2\*\*32\)"):
        index.add("b.parquet", ids([1]), np.array([-1]))
    with pytest.raises(ValueError, match="repeat"):
        index.add("b.parquet", ids([1, 2]), np.array([3, 3]))
    with pytest.raises(ValueError, match="NULL"):
        index.add("b.parquet", ids([None]))  # type: ignore[list-item]
    with pytest.raises(ValueError, match="non-empty"):
        index.add("", ids([1]))
    with pytest.raises(TypeError, match="Arrow table"):
        index.find({"id": [1]})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="take"):
        KeyIndex(multiset=True).find(ids([1]))
    with pytest.raises(ValueError, match="counts"):
        index.take(ids([1, 2]), np.array([1]))
    with pytest.raises(ValueError, match="negative"):
        index.take(ids([1]), np.array([-1]))
    assert index.file_id("b.parquet") is None and index.rows == 1


def test_record_batches_are_keys_too():
    index = KeyIndex(multiset=False)
    index.add("a.parquet", ids([4, 5]).to_batches()[0])
    assert located_entries(index, index.find(ids([5]).to_batches()[0])) == [("a.parquet", 1)]


@pytest.mark.parametrize(("key", "bytes_per_entry"), [(pa.int64(), 16), (pa.string(), 24)])
def test_memory_per_entry(key, bytes_per_entry):
    index = KeyIndex(multiset=False)
    rows = 200_000
    keys = pa.array(np.arange(rows, dtype=np.int64)).cast(key)
    for part in range(4):
        index.add(f"part-{part}.parquet", pa.table({"k": keys.slice(part * rows // 4, rows // 4)}))
    assert index.rows == rows
    assert bytes_per_entry * rows <= index.memory_bytes < (bytes_per_entry + 1) * rows


@pytest.mark.parametrize(("key", "bytes_per_entry"), [(pa.int64(), 12), (pa.string(), 16)])
def test_disk_bytes_per_entry(tmp_path, key, bytes_per_entry):
    """On disk an entry takes 12 bytes for an integer key and 16 for a hashed one (96 bits of code, locations
    packed in 32 bits), plus the fence's 8 bytes per 512 entries and 8 bytes per data file."""
    directory = IndexDirectory(tmp_path / "index")
    index = KeyIndex(multiset=False, disk=directory, overlay_bytes=1 << 20)
    rows = 200_000
    keys = pa.array(np.arange(rows, dtype=np.int64)).cast(key)
    for part in range(4):
        index.add(f"part-{part}.parquet", pa.table({"k": keys.slice(part * rows // 4, rows // 4)}))
    index.checkpoint(1, [1], force=True)
    assert index.rows == rows
    assert bytes_per_entry * rows < index.disk_bytes < (bytes_per_entry + 0.05) * rows
    index.close()
    directory.close()


def test_on_disk_a_hashed_code_is_96_bits_wherever_its_entry_sits(tmp_path):
    """Kept on disk, two keys whose 128-bit codes differ only in the low 32 bits of the second word are one key,
    whether the entry sits in the run or in memory beside it (an answer never depends on where an entry is);
    in memory they stay two."""
    original = KeyCoder.codes

    def codes(self: KeyCoder, keys: pa.Table) -> key_codes.Codes:
        k1, k2 = original(self, keys)
        assert k2 is not None
        values = keys.column(0).to_pylist()
        shared = np.array([v.startswith("a") for v in values], bool)  # "a", "aa": codes differ in the low bits
        k1[shared] = 11
        k2[shared] = np.array([(22 << 32) | len(v) for v in values], np.uint64)[shared]
        return k1, k2

    def text(values: list[str]) -> pa.Table:
        return pa.table({"k": pa.array(values, pa.string())})

    KeyCoder.codes = codes  # type: ignore[method-assign]
    try:
        memory = KeyIndex(multiset=False)
        memory.add("1.parquet", text(["a", "b"]))
        memory.add("2.parquet", text(["aa"]))
        assert memory.rows == 3
        directory = IndexDirectory(tmp_path / "index")
        for checkpoint in (False, True):
            disk = KeyIndex(multiset=False, disk=directory, overlay_bytes=0)
            disk.add("1.parquet", text(["a", "b"]))
            if checkpoint:  # "a" in the run, "aa" in memory beside it
                disk.checkpoint(1, [1], force=True)
            disk.add("2.parquet", text(["aa"]))
            assert disk.rows == 2
            assert located_entries(disk, disk.find(text(["a", "aa", "b"]))) == [("2.parquet", 0)] * 2 + [
                ("1.parquet", 1)]
            disk.close()
        directory.close()
    finally:
        KeyCoder.codes = original  # type: ignore[method-assign]


def test_large_builds_merge_and_compact():
    with small_merges(16):
        index = KeyIndex(multiset=False)
        for part in range(30):
            index.add(f"{part}.parquet", ids(list(range(part * 50, part * 50 + 60))))  # 10 keys overlap
            index.find(ids([0]))
        assert index.rows == 29 * 50 + 60
        for part in range(0, 30, 2):
            index.drop_file(f"{part}.parquet")
        expected = {k: (f"{p}.parquet", k - p * 50) for p in range(30) for k in range(p * 50, p * 50 + 60)}
        expected = {k: at for k, at in expected.items() if int(at[0].split(".")[0]) % 2}
        # a key whose last file was dropped is gone, even when an earlier file held it
        alive = {k: at for k, at in expected.items()
                 if int(at[0].split(".")[0]) == max(p for p in range(30) if p * 50 <= k < p * 50 + 60)}
        everything = list(range(30 * 50 + 10))
        found = dict(zip(everything, located_entries(index, index.find(ids(everything))), strict=True))
        assert {k: at for k, at in found.items() if at is not None} == alive


# -- the sort behind every build -------------------------------------------------------------------------------


@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_the_packed_sort_is_a_stable_argsort(data):
    size = data.draw(st.integers(0, 300))
    shape = data.draw(st.sampled_from(["small", "full int64", "full uint64", "shared top bits"]))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    if shape == "small":
        values = rng.integers(-5, 5, size)
    elif shape == "full int64":
        values = rng.integers(-(2**63), 2**63 - 1, size, dtype=np.int64, endpoint=True)
    elif shape == "full uint64":
        values = rng.integers(0, 2**64 - 1, size, dtype=np.uint64, endpoint=True)
    else:  # keys that differ only below the bits the packed sort keeps: every run needs the exact fix-up
        values = (rng.integers(0, 3, size, dtype=np.uint64) << np.uint64(62)) | rng.integers(0, 4, size,
                                                                                                 dtype=np.uint64)
    order, sorted_values = key_index._stable_order(values)
    expected = np.argsort(values, kind="stable")
    assert order.tolist() == expected.tolist()
    assert sorted_values.tolist() == values[expected].tolist() and sorted_values.dtype == values.dtype


def test_a_keyed_build_keeps_the_last_row_of_each_key_among_many_files():
    index = KeyIndex(multiset=False)
    rng = np.random.default_rng(7)
    model: dict[str, tuple[str, int]] = {}
    for part in range(12):
        keys = [f"user-{k}" for k in rng.integers(0, 300, 200)]
        index.add(f"{part}.parquet", pa.table({"k": keys}))
        model.update({k: (f"{part}.parquet", row) for row, k in enumerate(keys)})
    everything = sorted(model)
    assert located_entries(index, index.find(pa.table({"k": everything}))) == [model[k] for k in everything]


def test_dates_and_nested_values_far_outside_pythons_range():
    index = KeyIndex(multiset=True)
    days = pa.array([2_145_031_948, -2_451_545], pa.int32()).cast(pa.date32())
    nested = pa.array([[2_145_031_948], [-2_451_545]], pa.list_(pa.int32())).cast(pa.list_(pa.date32()))
    micros = pa.array([9_000_000_000_000_000_000, -9_000_000_000_000_000_000], pa.int64()).cast(
        pa.timestamp("us", "UTC"))
    rows = pa.table({"d": days, "l": nested, "t": micros})
    index.add("a.parquet", rows)
    assert located_entries(index, index.take(rows.slice(1), np.array([3]))) == [("a.parquet", 1)]


def test_times_and_intervals_key_too():
    index = KeyIndex(multiset=True)
    rows = pa.table({"t": pa.array([datetime.time(1, 2), datetime.time(1, 2)]),
                     "i": pa.array([pa.MonthDayNano([1, 2, 3]), pa.MonthDayNano([1, 2, 4])],
                                   pa.month_day_nano_interval())})
    index.add("a.parquet", rows)
    assert len(index.take(rows.slice(0, 1), np.array([2]))) == 1


def test_the_index_never_imports_spark():
    import subprocess
    import sys

    code = "import sys, pgcdc.index.key_index; sys.exit('pyspark' in sys.modules or 'py4j' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_a_compaction_adds_the_new_file_then_drops_the_old_ones():
    index = KeyIndex(multiset=False)
    index.add("a.parquet", ids([1, 2, 3]))
    index.add("b.parquet", ids([4, 5]))
    index.forget(index.find(ids([2])))  # deleted before the compaction, so not in its output
    slots = len(index._main) + len(index._delta)
    index.add("c.parquet", ids([5, 4, 3, 1]))
    assert index.drop_file("a.parquet") == 0 and index.drop_file("b.parquet") == 0
    assert located_entries(index, index.find(ids([1, 2, 3, 4, 5]))) == [
        ("c.parquet", 3), None, ("c.parquet", 2), ("c.parquet", 1), ("c.parquet", 0)]
    assert len(index._main) + len(index._delta) == slots  # every key moved within its slot
