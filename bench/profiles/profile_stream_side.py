import sys, time, os
ROOT = os.environ.get("TREE", "/work/wt-stream")
sys.path.insert(0, ROOT + "/bench")
sys.path.insert(0, ROOT + "/src")
import psycopg
from capture import TABLE, fill, batched_drain
from pgcdc.embedded import EmbeddedPostgres
rows = int(sys.argv[1]) if len(sys.argv) > 1 else 300_000
binary = len(sys.argv) > 2 and sys.argv[2] == "binary"
with EmbeddedPostgres(settings={"max_wal_size": "8GB"}) as server:
    with psycopg.connect(server.dsn, autocommit=True) as conn:
        conn.execute(TABLE)
        conn.execute("SELECT pg_create_logical_replication_slot('s', 'pgoutput')")
        fill(conn, rows, 10_000)
    from pgcdc.pipeline import PipelineConfig
    from pgcdc.pipeline.batcher import Batch, Batcher
    from pgcdc.pipeline.tables import SourceTables
    from pgcdc.replication import LogicalReplicationStream, ReplicationOptions
    from pgcdc.transactions import TransactionReader
    import pgcdc.types.convert
    print("READY", flush=True)
    open("/tmp/sp/ready", "w").write(str(os.getpid()))
    seconds, cpu, changes = batched_drain(server.dsn, "s", rows // 10_000, binary=binary)
    print(f"{changes} changes, {cpu * 1e6 / changes:.2f} µs/change CPU, {seconds:.1f}s")
