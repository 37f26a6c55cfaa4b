"""What a pipeline is told (:class:`PipelineConfig`) and what it reports (:class:`Progress`)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from pgcdc.errors import ConfigError
from pgcdc.iceberg.partition_specs import PartitionTransform, parse_transforms
from pgcdc.lsn import Lsn
from pgcdc.mirrors.maintenance import MaintenancePolicy
from pgcdc.replication.slots import slot_name_problem
from pgcdc.secrets import parse_dsn
from pgcdc.spark.destination import Destination

# mirrors of a batch applied at once by default: measured over 60 tables at 200 transactions/s on 2 cores, 4
# side by side applied a batch in 0.87 s at the median against 2.29 s one after another (docs/benchmarks.md); most
# of a commit waits on storage and the catalog
DEFAULT_APPLY_WORKERS = 4

_NAME_PART = r'(?:"((?:[^"]|"")+)"|([^".\s]+))'
_QUALIFIED = re.compile(rf"^\s*{_NAME_PART}\.{_NAME_PART}\s*$")


def source_table(name: str) -> tuple[str, str]:
    """A published table's name as users write it, ``schema.table`` (a part in double quotes when it holds a dot,
    a quote or capitals: ``"Sales"."Order Lines"``), as (schema, table) as PostgreSQL names them."""
    match = _QUALIFIED.match(name)
    if match is None:
        raise ValueError(f"{name!r} is not a table named with its schema, e.g. public.orders")
    schema_quoted, schema_plain, table_quoted, table_plain = match.groups()
    schema = schema_quoted.replace('""', '"') if schema_quoted is not None else schema_plain.lower()
    table = table_quoted.replace('""', '"') if table_quoted is not None else table_plain.lower()
    return schema, table


@dataclass
class PipelineConfig:
    """Everything a pipeline needs; validated before anything touches a server or the JVM.

    ``dsn`` is a libpq connection string or URI for the source database (TLS settings such as ``sslmode`` pass
    through); ``destination`` says where the mirrors go (:class:`pgcdc.Destination`: the warehouse, its catalog
    and namespace, Spark's settings and master).
    """

    dsn: str
    publication: str
    slot: str = "pgcdc"
    destination: Destination = field(default_factory=Destination)
    # a batch goes once it holds this many changes, or its converted changes take this many bytes: as large as the
    # apply lets it grow under load, since each mirror it touches costs a commit whatever its rows (a backlog over
    # 100 tables caught up in 200,000-change batches paid 5 commits a mirror for what one batch holds)
    batch_max_rows: int = 1_000_000
    batch_max_bytes: int = 256 << 20
    # the batch clock: a batch goes to the apply thread this long after the one before it at the latest, the moment
    # that one is applied (pgcdc.pipeline.streaming.hand_over_due); sub-second, for mirrors fresh within a second
    batch_max_seconds: float = 0.5
    changelog: bool = False
    snapshot: bool = True
    binary: bool = False
    proto_version: int | None = None
    streaming: str | None = None
    two_phase: bool | None = None
    origin: str | None = None
    numeric: str = "string"
    memory_limit_bytes: int = 256 << 20
    heartbeat_seconds: float | None = None
    spill_dir: str | None = None
    resnapshot: bool = False
    receive_timeout_seconds: float = 60.0
    snapshot_writer: str = "auto"
    apply_writer: str = "delta"  # "delta": Iceberg row deltas written from Arrow; "merge": a Spark MERGE per batch
    # how the row-delta writer removes rows: "position" (every reader reads them; a key index per mirror) or
    # "equality" (no index; PyIceberg cannot read them)
    deletes: str = "position"
    index_memory_mb: int | None = None  # what the key indexes may take together (None: a quarter of the memory; 0:
    # every index kept on disk)
    index_dir: str | None = None  # where indexes that do not fit are kept on disk (None: ~/.cache/pgcdc/index)
    # the partition spec of the mirrors pgcdc makes, by source table: {"shop.orders": "days(created_at), ..."}
    partition_by: dict[str, str] = field(default_factory=dict)
    # how many mirrors of a batch are applied at once (1: one after another; None: DEFAULT_APPLY_WORKERS, or 1 with
    # the change log). Not side by side with --changelog: there, with someone else's compaction committing beside
    # the stream, a test lost deletes of a mirror (1 run in 3 or 4; never one after another, nor side by side
    # without the change log); until that is understood the combination is refused
    apply_workers: int | None = None
    # how often at most the consistent tags move to the last batch applied (0: every batch; None: never)
    consistent_seconds: float | None = 10.0
    snapshot_rows_per_task: int = 250_000  # rows of a copy task (a page range); more tasks than executors
    copy_workers: int = 4  # tables copied side by side in the initial copy (and in later copies)
    on_conversion_error: str = "stop"  # or "quarantine": changes that cannot be converted go to <table>__rejects
    # a table whose replica identity changes while streaming: "copy" it again keyed on the new identity while the
    # others stream, or "stop" (IdentityChangedError)
    on_identity_change: str = "copy"
    maintenance: MaintenancePolicy = field(default_factory=MaintenancePolicy)  # compaction, expiry, orphan files

    def __post_init__(self) -> None:
        problems = []
        try:
            parse_dsn(self.dsn)
        except ConfigError as exc:
            problems.append(str(exc))
        if not self.publication or "\0" in self.publication or len(self.publication.encode()) > 63:
            problems.append(f"publication {self.publication!r} must be a PostgreSQL name: 1-63 bytes, no NUL")
        slot_problem = slot_name_problem(self.slot)
        if slot_problem:
            problems.append(str(slot_problem))
        if self.batch_max_rows < 1:
            problems.append("batch_max_rows must be at least 1")
        if self.batch_max_bytes < 1:
            problems.append("batch_max_bytes must be at least 1 (--batch-mb: at least 1)")
        if self.batch_max_seconds <= 0:
            problems.append("batch_max_seconds must be positive")
        if self.receive_timeout_seconds <= 0:
            problems.append("receive_timeout_seconds must be positive")
        if self.heartbeat_seconds is not None and self.heartbeat_seconds <= 0:
            problems.append("heartbeat_seconds must be positive")
        if self.proto_version is not None and self.proto_version not in (1, 2, 3, 4):
            problems.append(f"proto_version {self.proto_version} is not one of 1, 2, 3, 4")
        if self.streaming not in (None, "off", "on", "parallel"):
            problems.append(f"streaming {self.streaming!r} must be off, on or parallel")
        if self.origin not in (None, "any", "none"):
            problems.append(f"origin {self.origin!r} must be any or none")
        if self.numeric not in ("string", "decimal38"):
            problems.append(f"numeric policy {self.numeric!r} must be string or decimal38")
        if self.on_conversion_error not in ("stop", "quarantine"):
            problems.append(f"on_conversion_error {self.on_conversion_error!r} must be stop or quarantine")
        if self.on_identity_change not in ("copy", "stop"):
            problems.append(f"on_identity_change {self.on_identity_change!r} must be copy or stop")
        if self.snapshot_writer not in ("auto", "arrow", "spark"):
            problems.append(f"snapshot writer {self.snapshot_writer!r} must be auto, arrow or spark")
        if self.apply_writer not in ("delta", "merge"):
            problems.append(f"apply writer {self.apply_writer!r} must be delta or merge")
        if self.deletes not in ("position", "equality"):
            problems.append(f"deletes {self.deletes!r} must be position or equality")
        if self.consistent_seconds is not None and self.consistent_seconds < 0:
            problems.append("consistent_seconds must be 0 or more")
        if self.index_memory_mb is not None and self.index_memory_mb < 0:
            problems.append("index_memory_mb must be 0 (every key index on disk) or more")
        if self.apply_workers is not None and not 1 <= self.apply_workers <= 64:
            problems.append(f"apply workers {self.apply_workers} must be 1 to 64")
        elif self.apply_workers is not None and self.apply_workers > 1 and self.changelog:
            problems.append(f"--apply-workers {self.apply_workers} cannot be used with --changelog yet (mirrors "
                            "applied side by side with a change log are not proven safe beside another writer's "
                            "compaction); use --apply-workers 1, or drop --changelog")
        if not 1 <= self.copy_workers <= 64:
            problems.append(f"copy workers {self.copy_workers} must be 1 to 64")
        if self.snapshot_rows_per_task < 1:
            problems.append(f"snapshot rows per task {self.snapshot_rows_per_task} must be at least 1")
        problems += self._partition_problems()
        problems += self.maintenance.problems()
        if problems:
            raise ConfigError("; ".join(problems))


    @property
    def mirror_workers(self) -> int:
        """How many mirrors of a batch are applied at once: ``apply_workers``, else the default (1 with the change
        log)."""
        if self.apply_workers is not None:
            return self.apply_workers
        return 1 if self.changelog else DEFAULT_APPLY_WORKERS

    def _partition_problems(self) -> list[str]:
        problems = []
        named: dict[tuple[str, str], str] = {}
        for table, transforms in self.partition_by.items():
            try:
                source = source_table(table)
                parse_transforms(transforms)
            except ValueError as exc:
                problems.append(f"--partition-by {table}={transforms}: {exc}")
                continue
            if source in named:  # one table under two spellings (Shop.Orders, shop.orders)
                problems.append(f"--partition-by names {named[source]} and {table}, one table: give its "
                                "transforms once")
            named[source] = table
        return problems

    @property
    def partition_specs(self) -> dict[tuple[str, str], list[PartitionTransform]]:
        """``partition_by`` read: the transforms of each source (schema, table)."""
        return {source_table(table): parse_transforms(transforms) for table, transforms in self.partition_by.items()}

    @property
    def index_memory_bytes(self) -> int:
        """What the key indexes may take together: ``index_memory_mb``, else a quarter of the machine's memory."""
        if self.index_memory_mb is not None:
            return self.index_memory_mb << 20
        import psutil

        return int(psutil.virtual_memory().total) // 4


@dataclass
class Progress:
    """A snapshot of what the pipeline has done, for status lines and metrics."""

    phase: str = "starting"
    rows_applied: int = 0
    transactions_applied: int = 0
    batches_applied: int = 0
    applied_lsn: Lsn | None = None
    confirmed_lsn: Lsn | None = None
    received_lsn: Lsn | None = None  # end of the last whole transaction received
    applying_rows: int = 0  # changes of the batch being merged now (0: none)
    server_lsn: Lsn | None = None
    wal_retained_bytes: int | None = None
    wal_status: str | None = None
    rows_per_s: float = 0.0
    last_batch_seconds: float = 0.0
    snapshot_rows: dict[str, int] = field(default_factory=dict)
    snapshot_estimates: dict[str, int] = field(default_factory=dict)  # pg_class.reltuples of each table to copy
    reconnections: int = 0  # replication connections lost and re-established
    rows_rejected: int = 0  # changes set aside in <table>__rejects (--on-conversion-error quarantine)
    stop_signal: int | None = None  # the signal (SIGINT, SIGTERM) that asked the pipeline to stop
    # tables copied again while streaming: (schema.table, the kind of reason, the reason)
    copies_again: list[tuple[str, str, str]] = field(default_factory=list)
    consistent_lsn: Lsn | None = None  # where the mirrors' consistent tags stand (pgcdc.mirrors.consistent)
    # what runs beside the batches, each a share of the lag: maintenance turns on the apply thread (turns that
    # maintained a table; seconds of every turn, the looks at tables included), moves of the consistent tags, and
    # the catalog read before each batch on the stream's thread (rewrites and publication changes)
    maintenance_turns: int = 0
    maintenance_seconds: float = 0.0
    tag_moves: int = 0
    tag_move_seconds: float = 0.0
    catalog_checks: int = 0
    catalog_check_seconds: float = 0.0
    # where the applies' time went, summed over the run: wall seconds per step (pgcdc.apply.steps)
    apply_step_seconds: dict[str, float] = field(default_factory=dict)

    @property
    def lag_bytes(self) -> int | None:
        if self.server_lsn is None or self.applied_lsn is None:
            return None
        return max(0, int(self.server_lsn) - int(self.applied_lsn))
