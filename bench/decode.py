"""Decode throughput: pgcdc's pgoutput decoder beside the Python peers on PyPI, on the same captured bytes.

A real PostgreSQL 18 (embedded) produces the stream: inserts and updates of a 10-column table, text
mode, protocol 1 (what every peer can read). Each decoder turns every message into its message object.
Last line: one JSON object of the figures.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import psycopg

from pgcdc.embedded import EmbeddedPostgres
from pgcdc.pgoutput import decode

TABLE = """
CREATE TABLE bench (id bigint PRIMARY KEY, a int, b text, c numeric(12, 2), d timestamptz, e bool,
                    f float8, g uuid, h jsonb, i date);
CREATE PUBLICATION bench_pub FOR TABLE bench;
"""


def capture(messages: int) -> list[bytes]:
    """At least ``messages`` pgoutput messages (inserts, then updates of most rows) from a real server."""
    rows = int(messages * 0.55)
    with EmbeddedPostgres() as server, psycopg.connect(server.dsn, autocommit=True) as conn:
        conn.execute(TABLE)
        conn.execute("SELECT pg_create_logical_replication_slot('bench', 'pgoutput')")
        for start in range(0, rows, 1000):  # transactions of 1000 rows
            conn.execute(
                "INSERT INTO bench SELECT i, i %% 1000, 'name ' || i, i * 1.25, now(), i %% 2 = 0, i / 3.0, "
                "md5(i::text)::uuid, jsonb_build_object('k', i), date '2024-01-01' + (i %% 365)::int "
                "FROM generate_series(%s::bigint, %s::bigint) i", (start, min(rows, start + 1000) - 1))
        conn.execute("UPDATE bench SET a = a + 1, b = b || '!' WHERE id % 5 <> 0")
        data = conn.execute("SELECT data FROM pg_logical_slot_get_binary_changes('bench', NULL, NULL, "
                            "'proto_version', '1', 'publication_names', 'bench_pub')").fetchall()
    return [bytes(d) for (d,) in data]


def pgcdc_decoder() -> Callable[[bytes], object]:
    return lambda payload: decode(payload, proto_version=1, in_stream=False)


def pypgoutput_decoder() -> Callable[[bytes], object] | str:
    try:
        from pypgoutput import decoders
    except ImportError as exc:
        return f"pypgoutput is not installed ({exc})"
    classes = {ord("B"): decoders.Begin, ord("C"): decoders.Commit, ord("R"): decoders.Relation,
               ord("I"): decoders.Insert, ord("U"): decoders.Update, ord("D"): decoders.Delete,
               ord("T"): decoders.Truncate}
    return lambda payload: classes[payload[0]](payload)


def pgoutput_decoder_decoder() -> Callable[[bytes], object] | str:
    try:
        import pgoutput_decoder  # type: ignore[import-not-found]
    except ImportError:
        return ("pgoutput-decoder is not installable here: PyPI has only its source distribution, whose Rust "
                "build fetches crates from crates.io, which this machine cannot reach")
    parse = getattr(pgoutput_decoder, "decode_message", None) or getattr(pgoutput_decoder, "parse", None)
    if parse is None:
        return f"pgoutput-decoder {getattr(pgoutput_decoder, '__version__', '?')} exposes no per-message decoder"
    return parse


def measure(decoder: Callable[[bytes], object], payloads: list[bytes], repeat: int) -> float:
    """Best time to decode every payload, keeping the results (as a consumer does), with the same garbage
    collector settings for every decoder (pgcdc's streaming ones)."""
    from pgcdc.runtime import streaming_gc

    best = float("inf")
    with streaming_gc():
        for _ in range(repeat):
            started = time.perf_counter()
            kept = [decoder(payload) for payload in payloads]
            best = min(best, time.perf_counter() - started)
            del kept
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a smaller stream (under 2 minutes)")
    parser.add_argument("--messages", type=int, default=None)
    args = parser.parse_args()
    target = args.messages or (30_000 if args.quick else 120_000)
    payloads = capture(target)
    megabytes = sum(len(p) for p in payloads) / 1e6
    repeat = 2 if args.quick else 3
    peers = {"pgcdc": pgcdc_decoder(), "pypgoutput": pypgoutput_decoder(),
             "pgoutput-decoder": pgoutput_decoder_decoder()}
    rates: dict[str, float | None] = {}
    notes: dict[str, str] = {}
    for name, decoder in peers.items():
        if isinstance(decoder, str):
            rates[name] = None
            notes[name] = decoder
            continue
        seconds = measure(decoder, payloads, repeat)
        rates[name] = len(payloads) / seconds
    print(f"decoding {len(payloads):,} pgoutput messages ({megabytes:.1f} MB; inserts and updates of a 10-column "
          "table, text mode, protocol 1), best of", repeat)
    print(f"{'decoder':<18} {'messages/s':>12} {'MB/s':>8} {'pgcdc is':>10}")
    for name, rate in rates.items():
        if rate is None:
            print(f"{name:<18} {'n/a':>12} {'n/a':>8} {'':>10}  ({notes[name]})")
            continue
        ratio = rates["pgcdc"] / rate  # type: ignore[operator]
        print(f"{name:<18} {rate:>12,.0f} {rate * megabytes / len(payloads):>8.1f} {ratio:>9.1f}x")
    pgcdc_rate = rates["pgcdc"]
    assert pgcdc_rate is not None
    figures = {
        "messages": len(payloads),
        "pgcdc_msgs_per_s": round(pgcdc_rate),
        "pgcdc_mb_per_s": round(pgcdc_rate * megabytes / len(payloads), 1),
        "pypgoutput_msgs_per_s": round(rates["pypgoutput"]) if rates["pypgoutput"] else None,
        "pgoutput_decoder_msgs_per_s": round(rates["pgoutput-decoder"]) if rates["pgoutput-decoder"] else None,
        "ratio_vs_pypgoutput": round(pgcdc_rate / rates["pypgoutput"], 2) if rates["pypgoutput"] else None,
        "ratio_vs_pgoutput_decoder": (round(pgcdc_rate / rates["pgoutput-decoder"], 2)
                                      if rates["pgoutput-decoder"] else None),
        "notes": notes,
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
