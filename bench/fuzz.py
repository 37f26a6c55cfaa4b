"""Hostile bytes: a mutation fuzz run of the pgoutput decoder (C tuple parser and pure Python).

Seeds are the 9,000+ messages PostgreSQL 18 really sent (tests/pgoutput/fixtures/pg18.jsonl,
every message type of protocols 1-4). Each input is a seed mutated the way broken networks,
buggy proxies and attackers do: flipped bits, truncations, appended or inserted bytes, length
and count fields overwritten with extreme values, two messages spliced, or random bytes after a
valid type tag. Every input is decoded in both stream states under its protocol version.

It passes when every input either decodes or raises DecodeError (nothing else escapes), no
single input takes long (no hang, no quadratic blow-up) and memory stays flat (no allocation
sized by a hostile length field). Last line: one JSON object of the figures.
"""

from __future__ import annotations

import argparse
import importlib
import json
import random
import resource
import struct
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from pgcdc.errors import DecodeError
from pgcdc.pgoutput import decode

ROOT = Path(__file__).resolve().parents[1]

decode_module = importlib.import_module("pgcdc.pgoutput.decode")  # the module, where the C parser is switched

FIXTURES = ROOT / "tests" / "pgoutput" / "fixtures" / "pg18.jsonl"
EXTREMES = (0, 1, 0x7F, 0x80, 0xFF, 0x7FFF, 0x8000, 0xFFFF, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF)


def seeds() -> list[tuple[bytes, int]]:
    """(message bytes, protocol version) of every captured message, deduplicated."""
    found = {}
    for line in FIXTURES.read_text().splitlines():
        record = json.loads(line)
        for entry in record["messages"]:
            found[bytes.fromhex(entry["hex"])] = record["proto_version"]
    return list(found.items())


def mutate(rng: random.Random, data: bytes, pool: list[tuple[bytes, int]]) -> bytes:
    buf = bytearray(data)
    choice = rng.randrange(8)
    if choice == 0 and buf:  # flip bits
        for _ in range(rng.randint(1, 4)):
            buf[rng.randrange(len(buf))] ^= 1 << rng.randrange(8)
    elif choice == 1:  # truncate
        del buf[rng.randrange(len(buf) + 1):]
    elif choice == 2:  # append
        buf += rng.randbytes(rng.randint(1, 16))
    elif choice == 3 and len(buf) > 1:  # insert in the middle
        at = rng.randrange(1, len(buf))
        buf[at:at] = rng.randbytes(rng.randint(1, 8))
    elif choice in (4, 5) and len(buf) > 5:  # an extreme 16- or 32-bit field (lengths, counts, oids)
        width = 2 if choice == 4 else 4
        at = rng.randrange(1, len(buf) - width + 1)
        value = rng.choice(EXTREMES) & (0xFFFF if width == 2 else 0xFFFFFFFF)
        buf[at:at + width] = struct.pack(">H" if width == 2 else ">I", value)
    elif choice == 6:  # splice two messages
        other = rng.choice(pool)[0]
        buf = buf[:rng.randrange(len(buf) + 1)] + other[rng.randrange(len(other) + 1):]
    else:  # random body behind a valid tag
        buf = buf[:1] + rng.randbytes(rng.randint(0, 64))
    return bytes(buf)


def run(inputs: int, seed: int) -> dict:
    pool = seeds()
    rng = random.Random(seed)
    parsers = {"C": decode_module._parse_change_c, "python": None}
    if parsers["C"] is None:
        del parsers["C"]
    outcomes = {"decoded": 0, "decode_error": 0}
    escaped: list[str] = []
    slowest = 0.0
    slowest_input = b""
    started = time.perf_counter()
    rss_start = None
    for index in range(inputs):
        data, proto = rng.choice(pool)
        mutated = mutate(rng, data, pool)
        name = "C" if index % 2 == 0 or "python" not in parsers else "python"
        decode_module._parse_change_c = parsers.get(name)
        for in_stream in (False, True):
            t0 = time.perf_counter()
            try:
                decode(mutated, proto_version=proto, in_stream=in_stream)
                outcomes["decoded"] += 1
            except DecodeError:
                outcomes["decode_error"] += 1
            except Exception as exc:  # the finding this run exists for
                if len(escaped) < 20:
                    escaped.append(f"{type(exc).__name__}: {exc} ({name}, proto {proto}, in_stream {in_stream}, "
                                   f"bytes {mutated.hex()})")
            elapsed = time.perf_counter() - t0
            if elapsed > slowest:
                slowest, slowest_input = elapsed, mutated
        if index == 10_000:  # after warm-up: caches, interned strings, allocator arenas
            rss_start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    decode_module._parse_change_c = parsers.get("C")
    seconds = time.perf_counter() - started
    rss_end = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "inputs": inputs,
        "decodes": 2 * inputs,
        "seeds": len(pool),
        "parsers": sorted(parsers),
        "decoded": outcomes["decoded"],
        "decode_errors": outcomes["decode_error"],
        "other_exceptions": len(escaped),
        "examples": escaped,
        "slowest_input_ms": round(slowest * 1000, 3),
        "slowest_input_len": len(slowest_input),
        "peak_rss_mb": round(rss_end / 1024, 1),
        "rss_growth_after_warmup_mb": round((rss_end - (rss_start or rss_end)) / 1024, 1),
        "inputs_per_s": round(inputs / seconds),
        "seconds": round(seconds, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--inputs", type=int, default=1_000_000)
    parser.add_argument("--seed", type=int, default=20261122)
    parser.add_argument("--quick", action="store_true", help="100,000 inputs")
    args = parser.parse_args()
    result = run(100_000 if args.quick else args.inputs, args.seed)
    print(f"{result['inputs']:,} mutated inputs ({result['decodes']:,} decodes, parsers {result['parsers']}): "
          f"{result['decoded']:,} decoded, {result['decode_errors']:,} DecodeError, "
          f"{result['other_exceptions']} other exceptions; slowest input {result['slowest_input_ms']} ms; "
          f"peak RSS {result['peak_rss_mb']} MB (+{result['rss_growth_after_warmup_mb']} MB after warm-up); "
          f"{result['inputs_per_s']:,} inputs/s", file=sys.stderr)
    for example in result["examples"]:
        print("  " + example, file=sys.stderr)
    print(json.dumps(result))
    if result["other_exceptions"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
