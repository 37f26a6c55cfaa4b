"""The server under test speaks the protocol pgcdc is built for: pgoutput 4, parallel streaming, two-phase."""

import select
import time

import psycopg2
import psycopg2.extras


def test_proto_4_streaming_parallel_two_phase_sends_bytes(pg):
    pg.server.require(16, "protocol version 4 and streaming 'parallel'")
    pg.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
    pg.execute("CREATE PUBLICATION pub FOR TABLE t")
    conn = psycopg2.connect(pg.dsn, connection_factory=psycopg2.extras.LogicalReplicationConnection)
    try:
        cur = conn.cursor()
        cur.execute("CREATE_REPLICATION_SLOT smoke LOGICAL pgoutput (TWO_PHASE true)")
        pg.execute("INSERT INTO t VALUES (1, 'one')")
        cur.start_replication(slot_name="smoke", decode=False, options={
            "proto_version": "4", "publication_names": "pub", "streaming": "parallel", "two_phase": "on",
        })
        received = []
        deadline = time.monotonic() + 30
        while len(received) < 4 and time.monotonic() < deadline:
            message = cur.read_message()
            if message is None:
                select.select([cur], [], [], 1)
                continue
            received.append(bytes(message.payload))
        types = [payload[:1] for payload in received]
        assert types == [b"B", b"R", b"I", b"C"]
        assert b"one" in received[2]
        slot = pg.execute("SELECT two_phase, plugin FROM pg_replication_slots WHERE slot_name = 'smoke'")
        assert slot == [(True, "pgoutput")]
    finally:
        conn.close()
