"""The ``pgcdc`` command line.

Settings come from flags, then ``PGCDC_*`` environment variables, then a TOML
file (``--config pgcdc.toml``, top-level keys named like the flags with
underscores), then defaults. Errors are one sentence with the fix; ``--debug``
adds the traceback.

Exit codes: 0 success, 1 runtime failure, 2 bad usage or configuration (a malformed or unreachable
``--dsn`` included, from every command), 3 the source is not ready (``pgcdc check`` found problems),
130 interrupted.

Global options (``--log-format``, ``--log-level``, ``--debug``, ``--config``, ``--connect-timeout``) may come
before or after the command.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import json
import logging
import os
import re
import signal
import sys
import threading
import tomllib
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.padding import Padding
from rich.panel import Panel
from rich.table import Table
from rich.text import Text
from typer.core import TyperCommand

from pgcdc.errors import ConfigError, PgcdcError
from pgcdc.mirrors.maintenance import MaintenancePolicy
from pgcdc.observability import configure_logging, redact, redact_dsn
from pgcdc.pipeline.config import PipelineConfig
from pgcdc.secrets import holds_secret, parse_dsn, register_conf_secrets
from pgcdc.spark.destination import Destination
from pgcdc.spark.settings import DEFAULT_CATALOG, DEFAULT_NAMESPACE, DEFAULT_WAREHOUSE

EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_SOURCE_NOT_READY = 3
EXIT_INTERRUPTED = 130

console = Console(stderr=True)
out = Console(width=None if sys.stdout.isatty() else 140)  # piped output: wide enough for the tables
log = logging.getLogger("pgcdc.cli")

# the panels of a command's --help, one per kind of setting (an option's rich_help_panel), named alike in every
# command that has them and shown in this order, after the command's own options
PANEL_SOURCE = "Source and slot"
PANEL_COPY = "Copy (initial snapshot)"
PANEL_BATCHES = "Batches"
PANEL_DESTINATION = "Destination"
PANEL_MAINTENANCE = "Maintenance"
PANEL_FAILURES = "Failure policies"
PANEL_OBSERVABILITY = "Observability"
PANELS = ("Arguments", "Options", PANEL_SOURCE, PANEL_COPY, PANEL_BATCHES, PANEL_DESTINATION, PANEL_MAINTENANCE,
          PANEL_FAILURES, PANEL_OBSERVABILITY)


class PanelledHelp(TyperCommand):
    """A command whose --help shows each panel's options in two columns: the names with the value's metavar, then
    the description, with the env var, default and range under it. Typer's own table gives each option five columns
    besides its description (required mark, names, short names, --no- names, type), which at 80 columns left the
    description 17 characters wide and cut long names and env vars short."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.help:  # the docstring's lines joined: typer's list of commands (pgcdc --help) would keep its breaks
            paragraphs = inspect.cleandoc(self.help).partition("\f")[0].split("\n\n")
            self.help = "\n\n".join(" ".join(paragraph.split()) for paragraph in paragraphs)

    def format_help(self, ctx: Any, formatter: Any) -> None:
        if self.rich_markup_mode is None or not getattr(typer.core, "HAS_RICH", True):  # click's plain help
            super().format_help(ctx, formatter)
            return
        terminal_width = os.environ.get("TERMINAL_WIDTH", "")  # as typer's own help reads it
        console = Console(width=int(terminal_width) if terminal_width.isdigit() else None)
        usage = self.get_usage(ctx).removeprefix("Usage:")
        console.print(Padding(Text.assemble(("Usage:", "yellow"), (usage, "bold")), 1))
        first, *more = (self.help or "").split("\n\n")
        text = Text(first)
        for paragraph in more:
            text.append("\n\n" + paragraph, style="dim")
        if text:
            console.print(Padding(text, (0, 1, 1, 1)))
        panels: dict[str, list[tuple[str, str, list[str]]]] = {}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is None:  # hidden
                continue
            title = getattr(param, "rich_help_panel", None) or (
                "Arguments" if param.param_type_name == "argument" else "Options")
            panels.setdefault(title, []).append((record[0], *_help_and_bracket(getattr(param, "help", None) or "",
                                                                               record[1])))
        names = [row[0] for rows in panels.values() for row in rows]
        # as wide as the longest names, or a third of the panel if that is less, but never cutting a word
        names_width = min(max(map(len, names)), max(max(len(word) for name in names for word in name.split()),
                                                     (console.width - 4) // 3))
        description_width = console.width - 4 - names_width - 2
        for title in sorted(panels, key=lambda name: PANELS.index(name) if name in PANELS else len(PANELS)):
            table = Table.grid(padding=(0, 2), expand=True)
            table.add_column(width=names_width, overflow="fold")
            table.add_column(ratio=1)
            for name, description, bracket in panels[title]:
                shown = Text(description)
                for line in _bracket_lines(bracket, description_width):
                    shown.append(("\n" if shown else "") + line, style="dim")
                table.add_row(_names_text(name), shown)
            console.print(Panel(table, title=title, title_align="left", border_style="dim"))
        if self.epilog:
            console.print(Padding(Text(" ".join(self.epilog.split())), 1))


def _names_text(names: str) -> Text:
    """A parameter's names (``-p, --publication NAME``) styled as typer styles them: options, then the metavar."""
    return Text.assemble(*((part, "bold cyan" if part.startswith("-") else "yellow" if part.strip(" ,/") else "")
                           for part in re.split(r"(\s+|,)", names) if part))


def _help_and_bracket(own: str, shown: str) -> tuple[str, list[str]]:
    """A parameter's help text and the items of the bracket click adds after it (env var, default, range,
    required)."""
    own, shown = " ".join(own.split()), " ".join(shown.split())
    bracket = shown[len(own):].strip() if shown.startswith(own) else ""
    if not (bracket.startswith("[") and bracket.endswith("]")):
        return shown, []
    return own, bracket[1:-1].split("; ")


def _bracket_lines(items: list[str], width: int) -> list[str]:
    """The bracket's items, as many to a line as fit in ``width``: none is broken across two lines."""
    lines: list[list[str]] = []
    for item in items:
        if lines and len("; ".join([*lines[-1], item])) + 2 <= width:
            lines[-1].append(item)
        else:
            lines.append([item])
    return [f"[{'; '.join(line)}]" for line in lines]


app = typer.Typer(
    name="pgcdc",
    help="Change data capture for PostgreSQL: stream a logical replication slot (pgoutput, protocol 1-4) "
         "into Apache Iceberg tables with Spark, exactly once.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110},
)
slot_app = typer.Typer(help="Create, drop and list logical replication slots.", no_args_is_help=True)
embedded_app = typer.Typer(help="A throwaway PostgreSQL 18 to try pgcdc without one of your own.",
                           no_args_is_help=True)
app.add_typer(slot_app, name="slot")
app.add_typer(embedded_app, name="embedded")

_state: dict[str, Any] = {"debug": False}

def _defaults(settings: type) -> SimpleNamespace:
    """The defaults of a settings dataclass, which the options take rather than restate."""
    return SimpleNamespace(**{f.name: f.default for f in dataclasses.fields(settings)
                              if f.default is not dataclasses.MISSING})


_CONFIG = _defaults(PipelineConfig)
_POLICY = MaintenancePolicy()


def _valid_dsn(dsn: str | None) -> str | None:
    if dsn is not None:
        parse_dsn(dsn)
    return dsn


Dsn = Annotated[str, typer.Option(
    "--dsn", envvar="PGCDC_DSN", show_envvar=True, callback=_valid_dsn, metavar="DSN", rich_help_panel=PANEL_SOURCE,
    help="Source database: libpq string or URI, e.g. 'host=db dbname=shop user=cdc' (sslmode, sslrootcert, ... "
         "pass through).")]
Publication = Annotated[str, typer.Option(
    "--publication", "-p", envvar="PGCDC_PUBLICATION", show_envvar=True, metavar="NAME", rich_help_panel=PANEL_SOURCE,
    help="Publication whose tables are mirrored.")]
SlotName = Annotated[str, typer.Option(
    "--slot", envvar="PGCDC_SLOT", show_envvar=True, metavar="NAME", rich_help_panel=PANEL_SOURCE,
    help="Logical replication slot pgcdc owns.")]
Warehouse = Annotated[str, typer.Option(
    "--warehouse", envvar="PGCDC_WAREHOUSE", show_envvar=True, metavar="DIR|URI", rich_help_panel=PANEL_DESTINATION,
    help="Where the mirrors' files go: a directory, or a URI such as s3a://bucket/prefix (jars and settings: "
         "docs/pipeline.md).")]
CatalogType = Annotated[str | None, typer.Option(
    "--catalog-type", envvar="PGCDC_CATALOG_TYPE", show_envvar=True, metavar="hadoop|jdbc|rest",
    rich_help_panel=PANEL_DESTINATION,
    help="Iceberg catalog: hadoop (default: the warehouse itself), jdbc or rest (both need --catalog-uri).")]
CatalogUri = Annotated[str | None, typer.Option(
    "--catalog-uri", envvar="PGCDC_CATALOG_URI", show_envvar=True, metavar="URI", rich_help_panel=PANEL_DESTINATION,
    help="The catalog's address: jdbc:postgresql://host/db for jdbc, https://host/path for rest.")]
Catalog = Annotated[str, typer.Option(
    "--catalog", envvar="PGCDC_CATALOG", show_envvar=True, metavar="NAME", rich_help_panel=PANEL_DESTINATION,
    help="Spark catalog name for the mirrors.")]
Namespace = Annotated[str, typer.Option(
    "--namespace", envvar="PGCDC_NAMESPACE", show_envvar=True, metavar="NAME", rich_help_panel=PANEL_DESTINATION,
    help="Iceberg namespace holding the mirrors.")]
Master = Annotated[str | None, typer.Option(
    "--master", envvar="PGCDC_SPARK_MASTER", show_envvar=True, metavar="URL", rich_help_panel=PANEL_DESTINATION,
    help="Spark master, e.g. local[4], spark://host:7077, yarn.")]


def _spark_flags(ctx: typer.Context, param: typer.CallbackParam, value: list[str] | None) -> list[str] | None:
    """``--conf`` flags typed on the command line: each wins over the config file's ``[spark]`` entry of its key
    (the rest of the table stays), and those that carry a secret are named in a warning, never their values:
    every user of the machine reads a process's command line."""
    name = param.name or "conf"
    source = ctx.get_parameter_source(name)  # click's ParameterSource, or the one of the click typer ships
    if ctx.resilient_parsing or getattr(source, "name", None) != "COMMANDLINE":
        return value
    exposed = [key.strip() for key, sep, setting in (pair.partition("=") for pair in value or [])
               if sep and holds_secret(key.strip(), setting)]
    if exposed and not _state.get("warned_of_secret_flags"):
        _state["warned_of_secret_flags"] = True
        log.warning("--conf %s on pgcdc's command line can be read by every user of this machine (ps, "
                    "/proc/<pid>/cmdline); give secrets in the config file's [spark] table instead (--config FILE, "
                    "a file only you can read, chmod 600 FILE) or in the environment (for S3: AWS_ACCESS_KEY_ID, "
                    "AWS_SECRET_ACCESS_KEY)", ", ".join(dict.fromkeys(exposed)))
    from_file = (ctx.default_map or {}).get(name) or []
    return [*([from_file] if isinstance(from_file, str) else from_file), *(value or [])]


SparkConf = Annotated[list[str] | None, typer.Option(
    "--conf", "-c", callback=_spark_flags, metavar="KEY=VALUE", rich_help_panel=PANEL_DESTINATION,
    help="Spark setting, repeatable (e.g. spark.sql.catalog.pgcdc.type=rest); added to the config file's [spark] "
         "table. Secrets go in that table or the environment: other users can read a command line.")]
JavaOptions = Annotated[str, typer.Option(
    "--java-options", envvar="PGCDC_JAVA_OPTIONS", show_envvar=True, metavar="OPTIONS",
    rich_help_panel=PANEL_DESTINATION, help="Options for Spark's driver and executor JVMs (e.g. -Xmx8g).")]

# the destination's options, declared once for every command that reaches the mirrors: (name, type, default)
_DESTINATION_OPTIONS: tuple[tuple[str, Any, Any], ...] = (
    ("warehouse", Warehouse, DEFAULT_WAREHOUSE),
    ("catalog", Catalog, DEFAULT_CATALOG),
    ("catalog_type", CatalogType, None),
    ("catalog_uri", CatalogUri, None),
    ("namespace", Namespace, DEFAULT_NAMESPACE),
    ("master", Master, None),
    ("conf", SparkConf, None),
    ("java_options", JavaOptions, ""),
)


def _grouped(target: str, options: tuple[tuple[str, Any, Any], ...], build: Callable[..., Any],
             replaced: dict[str, tuple[Any, Any]] | None = None) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A decorator: the command gets ``options`` (name, type, default) as options of its own and receives them
    built into one object (``build(**values)``) in its ``target`` parameter; ``replaced`` gives some of them
    another type and default for this command."""

    def decorate(command: Callable[..., Any]) -> Callable[..., Any]:
        own = [parameter.replace(kind=inspect.Parameter.KEYWORD_ONLY)
               for name, parameter in inspect.signature(command, eval_str=True).parameters.items()
               if name != target]
        added = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY,
                                   annotation=(replaced or {}).get(name, (annotation, default))[0],
                                   default=(replaced or {}).get(name, (annotation, default))[1])
                 for name, annotation, default in options]

        @functools.wraps(command)
        def run_with_options(**values: Any) -> Any:
            values[target] = build(**{name: values.pop(name) for name, _, _ in options})
            return command(**values)

        parameters = [*own, *added]
        run_with_options.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]
        run_with_options.__annotations__ = {p.name: p.annotation for p in parameters}
        return run_with_options

    return decorate


def with_destination(*, optional_warehouse: str | None = None) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A command that reaches the mirrors gets the destination's options (:data:`_DESTINATION_OPTIONS`) and
    receives them as one :class:`pgcdc.Destination` in its ``destination`` parameter. With ``optional_warehouse``
    (its help text) the warehouse is asked for only when the command has a use for it: ``destination.warehouse``
    is then None when it is not given."""
    replaced = None if optional_warehouse is None else {"warehouse": (Annotated[str | None, typer.Option(
        "--warehouse", envvar="PGCDC_WAREHOUSE", metavar="DIR|URI", rich_help_panel=PANEL_DESTINATION,
        help=optional_warehouse)], None)}
    return _grouped("destination", _DESTINATION_OPTIONS, _destination, replaced)


def _destination(*, warehouse: str | None, catalog: str, catalog_type: str | None, catalog_uri: str | None,
                 namespace: str, master: str | None, conf: list[str] | None, java_options: str) -> Destination:
    return Destination(warehouse=warehouse, catalog=catalog, catalog_type=catalog_type, catalog_uri=catalog_uri,
                       namespace=namespace, conf=_key_values(conf), master=master, java_options=java_options)


Resnapshot = Annotated[bool, typer.Option(
    "--resnapshot", rich_help_panel=PANEL_COPY,
    help="Drop the slot (if any) and copy every table again at a new consistent point: the way out after a lost "
         "or invalidated slot.")]
SnapshotWriter = Annotated[str, typer.Option(
    "--snapshot-writer", envvar="PGCDC_SNAPSHOT_WRITER", show_envvar=True, metavar="auto|arrow|spark",
    rich_help_panel=PANEL_COPY,
    help="How the copy is written: arrow (tasks write Parquet files, one commit; needs a local or mounted "
         "warehouse), spark (Spark's Iceberg writer: any storage), auto (arrow where it can).")]
ApplyWriter = Annotated[str, typer.Option(
    "--apply", envvar="PGCDC_APPLY", show_envvar=True, metavar="delta|merge", rich_help_panel=PANEL_BATCHES,
    help="How batches reach the mirrors: delta (a data file and a delete file per mirror, one Iceberg row-delta "
         "commit, no Spark query) or merge (a Spark MERGE INTO per mirror).")]
Deletes = Annotated[str, typer.Option(
    "--deletes", envvar="PGCDC_DELETES", show_envvar=True, metavar="position|equality", rich_help_panel=PANEL_BATCHES,
    help="How delta removes rows: position (every reader reads them, PyIceberg included; a key index per mirror "
         "in memory) or equality (no index; PyIceberg cannot read a mirror until it is compacted).")]
ConsistentEvery = Annotated[float | None, typer.Option(
    "--consistent-every", envvar="PGCDC_CONSISTENT_EVERY", show_envvar=True, min=0, metavar="SECONDS",
    rich_help_panel=PANEL_BATCHES,
    help="Most seconds between two moves of the consistent tags (pgcdc_consistent: every mirror at one moment of "
         "the source); 0: every batch.")]
NoConsistentTags = Annotated[bool, typer.Option(
    "--no-consistent-tags", envvar="PGCDC_NO_CONSISTENT_TAGS", rich_help_panel=PANEL_BATCHES,
    help="Do not keep the consistent tags.")]
SpillDir = Annotated[str | None, typer.Option(
    "--spill-dir", envvar="PGCDC_SPILL_DIR", metavar="DIR", rich_help_panel=PANEL_BATCHES,
    help="Where transactions larger than --memory-limit spill (default: the system's temporary directory).")]
MemoryLimit = Annotated[int, typer.Option(
    "--memory-limit", envvar="PGCDC_MEMORY_LIMIT_MB", min=1, metavar="MB", rich_help_panel=PANEL_BATCHES,
    help="Changes held in memory per open transaction before it spills.")]
ReceiveTimeout = Annotated[float, typer.Option(
    "--receive-timeout", envvar="PGCDC_RECEIVE_TIMEOUT", metavar="SECONDS", rich_help_panel=PANEL_FAILURES,
    help="Silence from the server after which the connection counts as lost.")]
OnConversionError = Annotated[str, typer.Option(
    "--on-conversion-error", envvar="PGCDC_ON_CONVERSION_ERROR", metavar="stop|quarantine",
    rich_help_panel=PANEL_FAILURES,
    help="At a value pgcdc cannot mirror: stop, or quarantine (set the change aside, whole and raw, in "
         "<table>__rejects and go on).")]
OnIdentityChange = Annotated[str, typer.Option(
    "--on-identity-change", envvar="PGCDC_ON_IDENTITY_CHANGE", metavar="copy|stop", rich_help_panel=PANEL_FAILURES,
    help="When a table's replica identity changes: copy it again, keyed on the new identity, while the others "
         "stream; or stop there (exit 1).")]
ApplyWorkers = Annotated[int | None, typer.Option(
    "--apply-workers", envvar="PGCDC_APPLY_WORKERS", show_envvar=True, min=1, max=64, metavar="N",
    rich_help_panel=PANEL_BATCHES,
    help="Mirrors of a batch applied at once (default 4; with --changelog 1, one after another, the only choice "
         "there yet).")]
IndexMemory = Annotated[int | None, typer.Option(
    "--index-memory-mb", envvar="PGCDC_INDEX_MEMORY_MB", show_envvar=True, min=0, metavar="MB",
    rich_help_panel=PANEL_BATCHES,
    help="Memory for all mirrors' key indexes (default: a quarter of the machine's); an index that does not fit "
         "is kept on disk in --index-dir, holding a share of it (0: every index on disk).")]
IndexDir = Annotated[str | None, typer.Option(
    "--index-dir", envvar="PGCDC_INDEX_DIR", metavar="DIR", rich_help_panel=PANEL_BATCHES,
    help="Where key indexes kept on disk live, one directory per mirror, reopened at a restart (default: "
         "~/.cache/pgcdc/index).")]
PartitionBy = Annotated[list[str] | None, typer.Option(
    "--partition-by", metavar="SCHEMA.TABLE=TRANSFORMS", rich_help_panel=PANEL_DESTINATION,
    help="Partition the mirror pgcdc makes of a table, e.g. 'shop.orders=days(created_at), bucket(16, tenant)' "
         "(transforms: column, years, months, days, hours, bucket(N, c), truncate(W, c)); repeat per table.")]
CopyWorkers = Annotated[int, typer.Option(
    "--copy-workers", envvar="PGCDC_COPY_WORKERS", show_envvar=True, min=1, max=64, metavar="N",
    rich_help_panel=PANEL_COPY,
    help="Tables copied at once, each in the same exported snapshot (the largest first); each commits on its own.")]
SnapshotRowsPerTask = Annotated[int, typer.Option(
    "--snapshot-rows-per-task", envvar="PGCDC_SNAPSHOT_ROWS_PER_TASK", show_envvar=True, min=1, metavar="ROWS",
    rich_help_panel=PANEL_COPY,
    help="Rows per task of the copy (a range of the table's pages, read by one COPY); a table is copied by as "
         "many tasks at once as the cluster has executor cores.")]
JsonFlag = Annotated[bool, typer.Option("--json", help="Machine-readable JSON output.")]
SnapshotRetention = Annotated[float, typer.Option(
    "--snapshot-retention-minutes", envvar="PGCDC_SNAPSHOT_RETENTION_MINUTES", min=0, metavar="MINUTES",
    rich_help_panel=PANEL_MAINTENANCE,
    help="Expire mirror snapshots older than this (time travel reaches this far back) ...")]
SnapshotsKept = Annotated[int, typer.Option(
    "--snapshots-kept", envvar="PGCDC_SNAPSHOTS_KEPT", min=1, metavar="N", rich_help_panel=PANEL_MAINTENANCE,
    help="... but always keep the newest this many.")]
OrphanAge = Annotated[float, typer.Option(
    "--orphan-age-hours", envvar="PGCDC_ORPHAN_AGE_HOURS", min=1, metavar="HOURS", rich_help_panel=PANEL_MAINTENANCE,
    help="Delete files no snapshot references once older than this (at least 1: files of a commit in flight are "
         "not referenced yet).")]


MaintenanceOn = Annotated[bool, typer.Option(
    "--maintenance/--no-maintenance", envvar="PGCDC_MAINTENANCE", rich_help_panel=PANEL_MAINTENANCE,
    help="Maintain the mirrors while streaming: compact data and delete files, expire snapshots, remove orphan "
         "files, rewrite manifests.")]
MaintenanceInterval = Annotated[float, typer.Option(
    "--maintenance-interval", envvar="PGCDC_MAINTENANCE_INTERVAL", min=0, metavar="SECONDS",
    rich_help_panel=PANEL_MAINTENANCE,
    help="Least time between two maintenances of a mirror (four times the last one's duration if longer); a "
         "mirror unchanged this long is compacted of its last delete files.")]
CompactDataFiles = Annotated[int, typer.Option(
    "--compact-data-files", envvar="PGCDC_COMPACT_DATA_FILES", min=1, metavar="N", rich_help_panel=PANEL_MAINTENANCE,
    help="Compact a mirror once it has this many data files (a large mirror: added since its last compaction) ...")]
CompactDeleteFiles = Annotated[int, typer.Option(
    "--compact-delete-files", envvar="PGCDC_COMPACT_DELETE_FILES", min=1, metavar="N",
    rich_help_panel=PANEL_MAINTENANCE, help="... or this many delete files.")]

# what a maintenance keeps (pgcdc maintain, pgcdc run), and when the pipeline maintains (pgcdc run): (name, type,
# default), the defaults MaintenancePolicy's
_RETENTION_OPTIONS: tuple[tuple[str, Any, Any], ...] = (
    ("snapshot_retention_minutes", SnapshotRetention, _POLICY.snapshot_max_age_seconds / 60),
    ("snapshots_kept", SnapshotsKept, _POLICY.snapshots_kept),
    ("orphan_age_hours", OrphanAge, _POLICY.orphan_age_seconds / 3600),
)
_SCHEDULE_OPTIONS: tuple[tuple[str, Any, Any], ...] = (
    ("maintenance", MaintenanceOn, _POLICY.enabled),
    ("maintenance_interval", MaintenanceInterval, _POLICY.interval_seconds),
    ("compact_data_files", CompactDataFiles, _POLICY.data_files),
    ("compact_delete_files", CompactDeleteFiles, _POLICY.delete_files),
)


def _policy(*, snapshot_retention_minutes: float, snapshots_kept: int, orphan_age_hours: float,
            maintenance: bool = True, maintenance_interval: float = _POLICY.interval_seconds,
            compact_data_files: int = _POLICY.data_files,
            compact_delete_files: int = _POLICY.delete_files) -> MaintenancePolicy:
    policy = MaintenancePolicy(enabled=maintenance, interval_seconds=maintenance_interval,
                               data_files=compact_data_files, delete_files=compact_delete_files,
                               snapshot_max_age_seconds=snapshot_retention_minutes * 60,
                               snapshots_kept=snapshots_kept, orphan_age_seconds=orphan_age_hours * 3600)
    problems = policy.problems()
    if problems:
        raise ConfigError("; ".join(problems))
    return policy


def with_maintenance(*, schedule: bool) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A command that maintains mirrors gets the options of what a maintenance keeps (and with ``schedule``, of
    when the pipeline maintains) and receives them as one MaintenancePolicy in its ``policy`` parameter."""
    return _grouped("policy", _RETENTION_OPTIONS + (_SCHEDULE_OPTIONS if schedule else ()), _policy)


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
GLOBAL_OPTIONS = {"--config": True, "--log-format": True, "--log-level": True, "--connect-timeout": True,
                  "--debug": False}  # option: takes a value


def _show_version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            installed = version("pgcdc")
        except PackageNotFoundError:
            installed = "unknown (not installed)"
        out.print(f"pgcdc {installed}")
        raise typer.Exit(0)


@app.callback()
def main_options(
    config: Annotated[Path | None, typer.Option("--config", envvar="PGCDC_CONFIG", show_envvar=True,
                                                help="TOML file of settings (keys named like the flags).")] = None,
    connect_timeout: Annotated[float, typer.Option(
        "--connect-timeout", envvar="PGCDC_CONNECT_TIMEOUT", show_envvar=True, rich_help_panel=PANEL_SOURCE,
        help="Seconds to wait for PostgreSQL to answer a connection attempt (a DSN's own connect_timeout, or "
             "PGCONNECT_TIMEOUT, wins).")] = 10.0,
    log_format: Annotated[str, typer.Option("--log-format", envvar="PGCDC_LOG_FORMAT",
                                            rich_help_panel=PANEL_OBSERVABILITY,
                                            help="text or json (JSON lines on stderr).")] = "text",
    log_level: Annotated[str, typer.Option("--log-level", envvar="PGCDC_LOG_LEVEL", rich_help_panel=PANEL_OBSERVABILITY,
                                           help="debug, info, warning, error or critical.")] = "INFO",
    debug: Annotated[bool, typer.Option("--debug", rich_help_panel=PANEL_OBSERVABILITY,
                                        help="Show tracebacks of errors.")] = False,
    version: Annotated[bool, typer.Option("--version", is_eager=True, callback=_show_version,
                                          help="Print pgcdc's version and exit.")] = False,
) -> None:
    """Stream PostgreSQL changes into Iceberg. Start with `pgcdc demo`, or `pgcdc check --dsn ... -p ...`."""
    if log_format not in ("text", "json"):
        raise ConfigError(f"--log-format must be text or json, not {log_format!r}")
    if log_level.upper() not in LOG_LEVELS:
        raise ConfigError(f"--log-level must be one of {', '.join(level.lower() for level in LOG_LEVELS)}, "
                          f"not {log_level!r}")
    if connect_timeout <= 0:
        raise ConfigError(f"--connect-timeout must be a positive number of seconds, not {connect_timeout}")
    # libpq reads this default for every connection without its own connect_timeout: psycopg and psycopg2 alike
    os.environ.setdefault("PGCONNECT_TIMEOUT", str(max(1, round(connect_timeout))))
    _state["debug"] = debug
    _state["log_format"] = log_format
    configure_logging(log_format, "DEBUG" if debug else log_level)


def _key_values(pairs: list[str] | None) -> dict[str, str]:
    """KEY=VALUE options (Spark settings, postgresql.conf settings) as a dict."""
    conf = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"{pair!r} must look like KEY=VALUE")
        conf[key.strip()] = value
    register_conf_secrets(conf)  # before anything can fail and quote them
    return conf


def _partition_specs(pairs: list[str] | None) -> dict[str, str]:
    """``--partition-by SCHEMA.TABLE=TRANSFORMS`` flags as {table: transforms} (checked by the pipeline's config)."""
    specs: dict[str, str] = {}
    for pair in pairs or []:
        table, sep, transforms = pair.partition("=")
        if not sep or not table.strip() or not transforms.strip():
            raise ConfigError(f"--partition-by {pair!r}: give SCHEMA.TABLE=TRANSFORMS, e.g. "
                              "'shop.orders=days(created_at)'")
        if table.strip() in specs:
            raise ConfigError(f"--partition-by names {table.strip()} twice: give all its transforms in one, "
                              "separated by commas")
        specs[table.strip()] = transforms.strip()
    return specs


def _pipeline_config(**kwargs: Any):
    from pgcdc.pipeline import PipelineConfig
    from pgcdc.warehouse import require_writable_warehouse

    config = PipelineConfig(**kwargs)
    if config.destination.warehouse:
        require_writable_warehouse(config.destination.warehouse)
    return config


@app.command(cls=PanelledHelp)
@with_destination()
@with_maintenance(schedule=True)
def run(
    dsn: Dsn,
    publication: Publication,
    slot: SlotName = "pgcdc",
    until_caught_up: Annotated[bool, typer.Option(
        "--until-caught-up", help="Exit once the mirrors reach the server's WAL position at start.")] = False,
    batch_rows: Annotated[int, typer.Option(
        "--batch-rows", envvar="PGCDC_BATCH_ROWS", metavar="N", rich_help_panel=PANEL_BATCHES,
        help="Apply a batch at this many changes ...")] = _CONFIG.batch_max_rows,
    batch_mb: Annotated[int, typer.Option(
        "--batch-mb", envvar="PGCDC_BATCH_MB", metavar="MIB", rich_help_panel=PANEL_BATCHES,
        help="... or once its changes take this many MiB in memory ...")] = _CONFIG.batch_max_bytes >> 20,
    batch_seconds: Annotated[float, typer.Option(
        "--batch-seconds", envvar="PGCDC_BATCH_SECONDS", metavar="SECONDS", rich_help_panel=PANEL_BATCHES,
        help="... or this long after the batch before it, once that one is applied (the batch clock).")
                     ] = _CONFIG.batch_max_seconds,
    changelog: Annotated[bool, typer.Option("--changelog", envvar="PGCDC_CHANGELOG", rich_help_panel=PANEL_BATCHES,
                                            help="Also append every change to <table>__changes.")] = False,
    no_snapshot: Annotated[bool, typer.Option("--no-snapshot", rich_help_panel=PANEL_COPY,
                                              help="Do not copy existing rows first.")] = False,
    binary: Annotated[bool, typer.Option("--binary", envvar="PGCDC_BINARY", rich_help_panel=PANEL_SOURCE,
                                         help="Ask the server for binary column values.")] = False,
    proto_version: Annotated[int | None, typer.Option(
        "--proto-version", min=1, max=4, metavar="N", rich_help_panel=PANEL_SOURCE,
        help="pgoutput protocol version (default: the server's highest).")] = None,
    streaming: Annotated[str | None, typer.Option(
        "--streaming", metavar="off|on|parallel", rich_help_panel=PANEL_SOURCE,
        help="Receive transactions in progress (default: the most the protocol allows).")] = None,
    two_phase: Annotated[bool | None, typer.Option("--two-phase/--no-two-phase", rich_help_panel=PANEL_SOURCE,
                                                   help="Decode prepared transactions at PREPARE.")] = None,
    origin: Annotated[str | None, typer.Option("--origin", metavar="any|none", rich_help_panel=PANEL_SOURCE,
                                               help="none: skip changes replicated into this server (default: any).")] = None,
    numeric: Annotated[str, typer.Option("--numeric", metavar="string|decimal38", rich_help_panel=PANEL_BATCHES,
                                         help="Mirror unconstrained numeric as string or decimal38.")] = "string",
    metrics_port: Annotated[int | None, typer.Option(
        "--metrics-port", envvar="PGCDC_METRICS_PORT", metavar="PORT", rich_help_panel=PANEL_OBSERVABILITY,
        help="Serve Prometheus metrics on this port.")] = None,
    heartbeat_seconds: Annotated[float | None, typer.Option(
        "--heartbeat-seconds", envvar="PGCDC_HEARTBEAT_SECONDS", metavar="SECONDS", rich_help_panel=PANEL_SOURCE,
        help="When idle, emit a logical message this often so a quiet slot keeps advancing.")] = None,
    resnapshot: Resnapshot = False,
    snapshot_writer: SnapshotWriter = "auto",
    apply: ApplyWriter = _CONFIG.apply_writer,
    deletes: Deletes = _CONFIG.deletes,
    index_memory_mb: IndexMemory = None,
    index_dir: IndexDir = None,
    partition_by: PartitionBy = None,
    apply_workers: ApplyWorkers = None,
    consistent_every: ConsistentEvery = _CONFIG.consistent_seconds,
    no_consistent_tags: NoConsistentTags = False,
    snapshot_rows_per_task: SnapshotRowsPerTask = _CONFIG.snapshot_rows_per_task,
    copy_workers: CopyWorkers = _CONFIG.copy_workers,
    spill_dir: SpillDir = None,
    memory_limit: MemoryLimit = _CONFIG.memory_limit_bytes >> 20,
    receive_timeout: ReceiveTimeout = _CONFIG.receive_timeout_seconds,
    on_conversion_error: OnConversionError = _CONFIG.on_conversion_error,
    on_identity_change: OnIdentityChange = _CONFIG.on_identity_change,
    *,
    destination: Destination,
    policy: MaintenancePolicy,
) -> None:
    """Snapshot if needed, then stream changes into the Iceberg mirrors until stopped (Ctrl-C stops cleanly)."""
    from pgcdc.pipeline import Pipeline

    config = _pipeline_config(
        dsn=dsn, publication=publication, slot=slot, destination=destination, batch_max_rows=batch_rows,
        batch_max_bytes=batch_mb << 20,
        batch_max_seconds=batch_seconds, changelog=changelog, snapshot=not no_snapshot, binary=binary,
        proto_version=proto_version, streaming=streaming, two_phase=two_phase, origin=origin, numeric=numeric,
        heartbeat_seconds=heartbeat_seconds, resnapshot=resnapshot, spill_dir=spill_dir,
        snapshot_writer=snapshot_writer, apply_writer=apply, deletes=deletes, index_memory_mb=index_memory_mb,
        index_dir=index_dir, partition_by=_partition_specs(partition_by), apply_workers=apply_workers,
        consistent_seconds=None if no_consistent_tags else consistent_every,
        snapshot_rows_per_task=snapshot_rows_per_task, copy_workers=copy_workers,
        memory_limit_bytes=memory_limit << 20, receive_timeout_seconds=receive_timeout,
        on_conversion_error=on_conversion_error, on_identity_change=on_identity_change, maintenance=policy)
    from pgcdc.observability import MetricsServer, StatusLine

    metrics = MetricsServer(metrics_port) if metrics_port else None
    with StatusLine(console) as status:
        def on_progress(progress):
            status.update(progress)
            if metrics:
                metrics.update(progress)

        progress = Pipeline(config, on_progress=on_progress).run(until_caught_up=until_caught_up)
    out.print(f"applied {progress.rows_applied} changes in {progress.transactions_applied} transactions; "
              f"confirmed {progress.confirmed_lsn or 'nothing new'}")
    if progress.stop_signal == signal.SIGINT:  # stopped in order, at the user's Ctrl-C: say so in the exit code
        raise typer.Exit(EXIT_INTERRUPTED)


@app.command(cls=PanelledHelp)
@with_destination()
def snapshot(
    dsn: Dsn,
    publication: Publication,
    slot: SlotName = "pgcdc",
    resnapshot: Resnapshot = False,
    snapshot_writer: SnapshotWriter = "auto",
    snapshot_rows_per_task: SnapshotRowsPerTask = _CONFIG.snapshot_rows_per_task,
    copy_workers: CopyWorkers = _CONFIG.copy_workers,
    partition_by: PartitionBy = None,
    *,
    destination: Destination,
) -> None:
    """Create the slot and copy the published tables into Iceberg, consistent with the slot's start."""
    from pgcdc.observability import SnapshotProgress
    from pgcdc.pipeline import Pipeline

    config = _pipeline_config(dsn=dsn, publication=publication, slot=slot, destination=destination,
                              resnapshot=resnapshot,
                              snapshot_writer=snapshot_writer, snapshot_rows_per_task=snapshot_rows_per_task,
                              copy_workers=copy_workers, partition_by=_partition_specs(partition_by))
    with SnapshotProgress(console) as bars:
        copied = Pipeline(config, on_progress=bars.update).snapshot()
    if not copied:
        out.print("every published table already has its mirror; nothing to copy")
    for table, rows in copied.items():
        out.print(f"{table}: {rows} rows")


@app.command(cls=PanelledHelp)
@with_destination()
@with_maintenance(schedule=False)
def maintain(
    table: Annotated[list[str] | None, typer.Option(
        "--table", "-t", metavar="SCHEMA.TABLE",
        help="Only the mirror of this source table, with its change log and rejects; repeatable. Default: every "
             "mirror in the namespace.")] = None,
    as_json: JsonFlag = False,
    *,
    destination: Destination,
    policy: MaintenancePolicy,
) -> None:
    """Maintain the mirrors now: compact data and delete files, rewrite manifests, expire snapshots, remove orphan
    files. Safe beside a running pipeline: positions are kept, and a commit conflict is retried by the pipeline."""
    from pgcdc.mirrors.catalog import MirrorCatalog
    from pgcdc.mirrors.maintenance import maintain_table
    from pgcdc.spark.session import spark_session
    from pgcdc.warehouse import require_existing_warehouse

    if destination.warehouse:
        require_existing_warehouse(destination.warehouse)
    spark = spark_session(destination)
    mirrors = MirrorCatalog(spark, destination)
    tables = mirrors.all_tables()
    if table:
        wanted = set()
        for name in table:
            schema_name, dot, table_name = name.partition(".")
            if not dot or not table_name:
                raise ConfigError(f"--table {name!r} must be schema.table")
            mirror = mirrors.identifier_for(schema_name, table_name)
            if mirror not in {identifier for identifier, _ in tables}:
                raise ConfigError(f"no mirror of {name} in namespace {destination.namespace!r} of "
                                  f"{destination.warehouse}")
            wanted |= {mirror, mirrors.changelog_identifier_for(schema_name, table_name),
                       mirrors.rejects_identifier_for(schema_name, table_name)}
        tables = [(identifier, rejects) for identifier, rejects in tables if identifier in wanted]
    results = [maintain_table(spark, identifier, mirrors.positions.carried(identifier, rejects=rejects), policy)
               for identifier, rejects in tables]
    rows = [{"table": r.identifier, **{step: r.steps.get(step, 0) for step in r.steps},
             "snapshots": r.after.snapshots if r.after else None, "data_files": r.after.data_files if r.after else None,
             "delete_files": r.after.delete_files if r.after else None, "seconds": round(r.seconds, 2)}
            for r in results]
    if as_json:
        out.print_json(json.dumps(rows))
        return
    summary = Table(title="maintained")
    for column in ("table", "compacted", "deletes", "manifests", "expired", "orphans", "snapshots", "data files",
                   "delete files", "seconds"):
        summary.add_column(column)
    for r in results:
        summary.add_row(escape(r.identifier), *(str(r.steps.get(step, 0)) for step in
                                                ("compact-data", "compact-deletes", "rewrite-manifests", "expire",
                                                 "remove-orphans")),
                        *(str(getattr(r.after, name)) if r.after else "" for name in
                          ("snapshots", "data_files", "delete_files")), f"{r.seconds:.1f}")
    out.print(summary)
    if not results:
        out.print(f"no mirrors in namespace {destination.namespace!r}")


@app.command(cls=PanelledHelp)
@with_destination(optional_warehouse="Also show the mirrors in this warehouse.")
def status(
    dsn: Dsn,
    slot: Annotated[str | None, typer.Option("--slot", envvar="PGCDC_SLOT", metavar="NAME",
                                             rich_help_panel=PANEL_SOURCE, help="Only this slot.")] = None,
    as_json: JsonFlag = False,
    *,
    destination: Destination,
) -> None:
    """Slots (confirmed LSN, lag, WAL retained, wal_status) and, with --warehouse, each mirror's position."""
    from pgcdc.status import gone_source_warnings, idle_slot_warnings, mirror_status, slot_status

    if destination.warehouse:
        from pgcdc.warehouse import require_existing_warehouse

        require_existing_warehouse(destination.warehouse)
    slots = slot_status(dsn, slot)
    warnings = idle_slot_warnings(slots)
    mirrors = mirror_status(destination) if destination.warehouse else []
    warnings += gone_source_warnings(dsn, slots, mirrors) if mirrors else []
    if as_json:
        out.print_json(json.dumps({"slots": slots, "mirrors": mirrors, "warnings": warnings}, default=str))
        return
    table = Table(title="replication slots")
    for column in ("slot", "database", "active", "confirmed_flush_lsn", "lag_bytes", "lag_seconds",
                   "wal_retained_bytes", "wal_status", "two_phase"):
        table.add_column(column)
    for row in slots:
        table.add_row(*(str(row.get(c, "")) for c in (
            "slot", "database", "active", "confirmed_flush_lsn", "lag_bytes", "lag_seconds",
            "wal_retained_bytes", "wal_status", "two_phase")))
    out.print(table)
    if destination.warehouse:
        mirror_table = Table(title="mirrors")
        for column in ("mirror", "source", "slot", "pgcdc.lsn", "rows", "snapshots", "rejected"):
            mirror_table.add_column(column)
        for row in mirrors:
            mirror_table.add_row(row["mirror"], row["source"], str(row["slot"]), str(row["lsn"]), str(row["rows"]),
                                 str(row["snapshots"]), str(row["rejected"]))
        out.print(mirror_table)
        from pgcdc.mirrors.status import consistent_point

        point = consistent_point(mirrors)
        if point is not None:
            out.print(point, highlight=False)
    _print_warnings(warnings)


def _print_warnings(warnings: list[dict[str, str]]) -> None:
    for warning in warnings:
        out.print(f"[yellow]warning[/yellow]: {warning['warning']}\n  [yellow]fix[/yellow]: {warning['fix']}",
                  highlight=False)


@app.command(cls=PanelledHelp)
@with_destination(optional_warehouse="Also check the destination: the warehouse's storage takes a file, the "
                                     "catalog answers.")
def check(
    dsn: Dsn,
    publication: Publication,
    slot: SlotName = "pgcdc",
    as_json: JsonFlag = False,
    *,
    destination: Destination,
) -> None:
    """Verify wal_level, privileges, free slots and WAL senders, the publication and replica identities, and with
    --warehouse that the storage and catalog are reachable and writable; say how to fix each problem. Inactive
    slots that hold WAL are warned about (they do not make the source unready)."""
    from pgcdc.replication import check_source
    from pgcdc.status import idle_slot_warnings, slot_status

    found = check_source(dsn, publication=publication, slot=slot)
    problems: list[Any] = [p for p in found if not p.warning]
    if destination.warehouse:
        problems += _destination_problems(destination)
    warnings = [{"warning": p.what, "fix": p.fix} for p in found if p.warning]
    warnings += idle_slot_warnings(slot_status(dsn, None))
    if as_json:
        out.print_json(json.dumps([{"problem": p.what, "fix": p.fix, "severity": "error"} for p in problems]
                                  + [{"problem": w["warning"], "fix": w["fix"], "severity": "warning"}
                                     for w in warnings]))
    else:
        for problem in problems:
            out.print(f"[red]problem[/red]: {problem.what}\n  [yellow]fix[/yellow]: {problem.fix}")
        _print_warnings(warnings)
        if not problems:
            out.print(f"[green]ready[/green]: {redact_dsn(dsn)} can stream publication {publication!r}"
                      + (f" into {destination.warehouse}" if destination.warehouse else ""))
    if problems:
        raise typer.Exit(EXIT_SOURCE_NOT_READY)


def _destination_problems(destination: Destination) -> list[Any]:
    from pgcdc.spark.destination import FAST_FAILURE_SETTINGS, check_destination
    from pgcdc.spark.session import spark_session
    from pgcdc.warehouse import require_writable_warehouse

    assert destination.warehouse is not None
    require_writable_warehouse(destination.warehouse)
    spark = spark_session(dataclasses.replace(destination, conf={**FAST_FAILURE_SETTINGS, **destination.conf}),
                          short_lived=True)
    try:
        return list(check_destination(spark, destination.warehouse, destination.catalog, destination.namespace))
    finally:
        spark.stop()


@app.command(cls=PanelledHelp)
@with_destination(optional_warehouse="With --consume: the warehouse whose mirrors must not lose what the slot "
                                     "holds (default: ./warehouse if it exists).")
def decode(
    dsn: Annotated[str | None, typer.Option("--dsn", envvar="PGCDC_DSN", callback=_valid_dsn, metavar="DSN",
                                            rich_help_panel=PANEL_SOURCE,
                                            help="Read from a slot on this server (SQL interface).")] = None,
    slot: Annotated[str | None, typer.Option("--slot", metavar="NAME", rich_help_panel=PANEL_SOURCE,
                                             help="Slot to read (peeked unless --consume).")] = None,
    publication: Annotated[str | None, typer.Option("--publication", "-p", envvar="PGCDC_PUBLICATION",
                                                    metavar="NAME", rich_help_panel=PANEL_SOURCE,
                                                    help="Publication the slot is read for.")] = None,
    file: Annotated[Path | None, typer.Option(
        "--file", "-f", metavar="FILE", rich_help_panel=PANEL_SOURCE,
        help="A file of raw messages instead: one hex payload per line, or length-prefixed binary (see docs).")
                    ] = None,
    proto_version: Annotated[int, typer.Option("--proto-version", min=1, max=4, metavar="N",
                                               rich_help_panel=PANEL_SOURCE,
                                               help="pgoutput protocol version.")] = 1,
    binary: Annotated[bool, typer.Option("--binary", rich_help_panel=PANEL_SOURCE,
                                         help="Ask for binary column values.")] = False,
    streaming: Annotated[bool, typer.Option("--streaming", rich_help_panel=PANEL_SOURCE,
                                            help="Ask for in-progress transactions (v2+).")] = False,
    consume: Annotated[bool, typer.Option(
        "--consume", help="Then advance the slot past the printed transactions (only whole transactions whose "
                          "every message was printed).")] = False,
    force: Annotated[bool, typer.Option(
        "--force", help="Let --consume advance a slot that pgcdc's mirrors stream from (they lose what it "
                        "skips).")] = False,
    limit: Annotated[int | None, typer.Option("--limit", "-n", metavar="N",
                                              help="Print at most this many messages.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="JSON lines.")] = False,
    *,
    destination: Destination,
) -> None:
    """Print the pgoutput messages a slot holds (peek, not consume, unless --consume) or a file holds."""
    from pgcdc.decode_view import MessagePrinter, decode_file, decode_slot, transaction_end

    if (file is None) == (slot is None):
        raise ConfigError("give either --slot (with --dsn and --publication) or --file")
    if file is not None:
        if not file.is_file():
            raise ConfigError(f"--file {file} {'is not a file' if file.exists() else 'does not exist'}: give a "
                              "file of hex payloads or length-prefixed messages")
        messages = decode_file(file, proto_version=proto_version)
    else:
        if not dsn or not publication or slot is None:
            raise ConfigError("--slot needs --dsn and --publication")
        if consume:
            _refuse_consuming_a_mirror_slot(slot, destination, force=force)
        messages = decode_slot(dsn, slot, publication=publication, proto_version=proto_version, binary=binary,
                               streaming=streaming, limit=limit)
    printer = MessagePrinter(as_json=as_json)
    printed_through = None  # end of the last transaction whose every message was printed
    after_it = 0
    for count, (lsn, message) in enumerate(messages, start=1):
        out.print(printer.format(lsn, message), markup=False, highlight=False, soft_wrap=True)
        end = transaction_end(message)
        if end is not None:
            printed_through, after_it = end, 0
        else:
            after_it += 1
        if limit is not None and count >= limit:
            break
    if consume and dsn and slot is not None:
        _consume_printed(dsn, slot, printed_through, after_it)


def _refuse_consuming_a_mirror_slot(slot: str, destination: Destination, *, force: bool) -> None:
    """A slot backs mirrors when it is pgcdc's own (the default name, PGCDC_SLOT, the config file's ``slot``) or
    when a warehouse's mirrors record it (``pgcdc.slot``): whatever --consume skips, they never receive. Such a
    slot is consumed only with --force, and then with a warning naming the mirrors."""
    from pgcdc.status import mirrors_streaming_from
    from pgcdc.warehouse import require_existing_warehouse

    if destination.warehouse is None and Path(DEFAULT_WAREHOUSE).is_dir():
        # where pgcdc run keeps its mirrors by default
        destination = dataclasses.replace(destination, warehouse=DEFAULT_WAREHOUSE)
    if destination.warehouse is not None:
        require_existing_warehouse(destination.warehouse)
    mirrors = mirrors_streaming_from(slot, destination) if destination.warehouse is not None else []
    own = slot in {"pgcdc", os.environ.get("PGCDC_SLOT"), _state.get("config_slot")}
    if not mirrors and not own:
        return
    named = (f"the mirrors {', '.join(f'{name} (at {position})' for name, position in mirrors)}" if mirrors
             else "pgcdc's mirrors")
    if force:
        console.print(f"[yellow]warning[/yellow]: consuming slot {slot!r}, which {named} stream from: the "
                      "transactions it skips never reach them; copy them again with pgcdc run --resnapshot")
        return
    raise ConfigError(
        f"slot {slot!r} is the slot {named} stream from: --consume would move it past changes they have not "
        f"applied, and they would never receive them; leave out --consume to look without consuming, or add "
        f"--force to consume anyway (then copy the mirrors again with pgcdc run --resnapshot)")


def _consume_printed(dsn: str, slot: str, printed_through: Any, unprinted_messages: int) -> None:
    from pgcdc.replication import SlotManager

    if printed_through is None:
        console.print(f"slot {slot} not advanced: no transaction was printed whole")
        return
    confirmed = SlotManager(dsn).advance(slot, printed_through)
    kept = (f"; the {unprinted_messages} printed messages of the unfinished transaction after it stay in the slot"
            if unprinted_messages else "")
    console.print(f"slot {slot} advanced to {confirmed}, past the printed transactions{kept}")


@slot_app.command("create", cls=PanelledHelp)
def slot_create(
    name: Annotated[str, typer.Argument(help="Slot name (lower case letters, digits, _).")],
    dsn: Dsn,
    two_phase: Annotated[bool, typer.Option("--two-phase", rich_help_panel=PANEL_SOURCE,
                                            help="Decode prepared transactions (PG 15+).")] = False,
    failover: Annotated[bool, typer.Option("--failover", rich_help_panel=PANEL_SOURCE,
                                           help="Sync the slot to standbys (PG 17+).")] = False,
) -> None:
    """Create a logical replication slot using pgoutput."""
    from pgcdc.replication import SlotManager, slot_name_problem

    problem = slot_name_problem(name)
    if problem:
        raise ConfigError(problem)
    created = SlotManager(dsn).create(name, two_phase=two_phase, failover=failover, export_snapshot=False)
    with created as slot:
        out.print(f"created slot {name} at {slot.consistent_point}")


@slot_app.command("drop", cls=PanelledHelp)
def slot_drop(name: Annotated[str, typer.Argument(help="Slot name.")], dsn: Dsn) -> None:
    """Drop a replication slot (the server then frees the WAL it held)."""
    from pgcdc.replication import SlotManager

    SlotManager(dsn).drop(name)
    out.print(f"dropped slot {name}")


@slot_app.command("list", cls=PanelledHelp)
def slot_list(dsn: Dsn, as_json: JsonFlag = False) -> None:
    """List the server's logical replication slots."""
    from pgcdc.status import slot_status

    rows = slot_status(dsn, None)
    if as_json:
        out.print_json(json.dumps(rows, default=str))
        return
    table = Table()
    for column in ("slot", "plugin", "database", "active", "confirmed_flush_lsn", "wal_status", "two_phase"):
        table.add_column(column)
    for row in rows:
        table.add_row(*(str(row.get(c, "")) for c in (
            "slot", "plugin", "database", "active", "confirmed_flush_lsn", "wal_status", "two_phase")))
    out.print(table)


@embedded_app.command("start", cls=PanelledHelp)
def embedded_start(
    port: Annotated[int | None, typer.Option("--port", metavar="PORT", help="Port (default: a free one).")] = None,
    setting: Annotated[list[str] | None, typer.Option("--set", metavar="KEY=VALUE",
                                                      help="A postgresql.conf setting, repeatable.")] = None,
) -> None:
    """Start a PostgreSQL 18 with wal_level=logical in the background and print its DSN."""
    from pgcdc.embedded import EmbeddedPostgres

    settings = _key_values(setting)
    server = EmbeddedPostgres(settings=settings, port=port, detached=True).start()
    out.print(server.dsn)
    console.print(f"running (pid {server.pid}); stop it with: pgcdc embedded stop --port {server.port}")


@embedded_app.command("stop", cls=PanelledHelp)
def embedded_stop(port: Annotated[int | None, typer.Option("--port", metavar="PORT",
                                                          help="Only the server on this port.")] = None) -> None:
    """Stop embedded servers started with `pgcdc embedded start` and delete their data."""
    from pgcdc.embedded import stop_detached

    stopped = stop_detached(port)
    if not stopped:
        console.print("no embedded server is running" + (f" on port {port}" if port else ""))
        raise typer.Exit(EXIT_FAILURE)
    for info in stopped:
        out.print(f"stopped {info['dsn']}")


@embedded_app.command("list", cls=PanelledHelp)
def embedded_list() -> None:
    """List running embedded servers."""
    from pgcdc.embedded import detached_servers

    for info in detached_servers():
        out.print(info["dsn"])


@app.command(cls=PanelledHelp)
def demo(
    warehouse: Annotated[Path | None, typer.Option(
        "--warehouse", metavar="DIR", rich_help_panel=PANEL_DESTINATION,
        help="Keep the Iceberg warehouse here (default: a temporary directory).")] = None,
    rows: Annotated[int, typer.Option("--rows", metavar="N",
                                      help="Existing rows per table before the workload.")] = 2000,
    large_transaction_rows: Annotated[int, typer.Option(
        "--large-transaction-rows", metavar="N", help="Rows of the streamed large transaction.")] = 20000,
    object_store: Annotated[bool, typer.Option(
        "--object-store", help="Keep the mirrors on a local S3 server (s3a) behind Iceberg's JDBC catalog in a "
                               "database of the demo's PostgreSQL; its parts: make demo-object-store.")] = False,
) -> None:
    """Run the whole thing on a throwaway PostgreSQL: snapshot, a workload peers cannot mirror, Spark + Iceberg,
    and a side-by-side verification of source and mirror."""
    from pgcdc.demo import run_demo

    equal = run_demo(out, warehouse=warehouse, rows=rows, large_transaction_rows=large_transaction_rows,
                     object_store=object_store)
    if not equal:
        raise typer.Exit(EXIT_FAILURE)


def main(argv: list[str] | None = None) -> None:
    """Console entry point: load the TOML config into defaults, run, turn errors into one clear line."""
    argv = _global_options_first(list(sys.argv[1:] if argv is None else argv))
    signal.signal(signal.SIGINT, _interrupt)
    try:
        default_map = _config_defaults(argv)
        # without standalone mode click returns typer.Exit's code instead of exiting
        code = app(args=argv, prog_name="pgcdc", default_map=default_map, standalone_mode=False)
        if code == EXIT_INTERRUPTED:  # typer's own answer to a KeyboardInterrupt: a code, no word
            _interrupted()
        sys.exit(code if isinstance(code, int) else 0)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        _interrupted()
        sys.exit(EXIT_INTERRUPTED)
    except Exception as exc:  # the one place that turns every failure into a sentence and an exit code
        if _state.get("interrupted"):  # what Ctrl-C broke on its way out (a JVM call cut short) is no error
            _interrupted()
            sys.exit(EXIT_INTERRUPTED)
        sys.exit(_report(exc))


def _interrupted() -> None:
    """The one line an interrupted command ends with. The connection to Spark's JVM is torn down on the way
    out, and py4j logs that as an error at exit: after an interrupt it is expected, not news."""
    logging.getLogger("py4j").setLevel(logging.CRITICAL)
    console.print("interrupted")


def _interrupt(signum: int, frame: Any) -> None:
    _state["interrupted"] = True
    # the interrupt may land inside a call to the JVM: py4j then tears that connection down while the exception
    # unwinds, and logs the reset as an error before any handler of pgcdc's runs
    logging.getLogger("py4j").setLevel(logging.CRITICAL)
    _stop_spark_jobs()
    raise KeyboardInterrupt


def _stop_spark_jobs() -> None:
    """Cancel Spark's running jobs and silence its log before the interrupt unwinds: the JVM runs apart (it does
    not hear Ctrl-C), and its tasks would go on writing, then log the failure of every one of them once pgcdc
    has released the slot's snapshot. From another thread: this one may be inside a call to the JVM."""
    if "pyspark" not in sys.modules:
        return
    from pyspark import SparkContext

    context = SparkContext._active_spark_context
    if context is None:
        return

    def cancel() -> None:
        with contextlib.suppress(Exception):  # a JVM already gone has nothing left to cancel
            context.setLogLevel("OFF")
            context.cancelAllJobs()

    canceller = threading.Thread(target=cancel, name="pgcdc-interrupt", daemon=True)
    canceller.start()
    canceller.join(10)


def _global_options_first(argv: list[str]) -> list[str]:
    """Global options given after the command (``pgcdc run ... --log-format json``) moved before it, where the
    parser reads them."""
    leading: list[str] = []
    rest: list[str] = []
    index = 0
    while index < len(argv):
        arg = argv[index]
        if arg == "--":
            rest.extend(argv[index:])
            break
        name = arg.split("=", 1)[0]
        if name in GLOBAL_OPTIONS:
            takes_value = GLOBAL_OPTIONS[name] and "=" not in arg
            leading.extend(argv[index:index + (2 if takes_value else 1)])
            index += 2 if takes_value else 1
            continue
        rest.append(arg)
        index += 1
    return leading + rest


def _report(exc: BaseException) -> int:
    if isinstance(exc, typer.Abort):
        _interrupted()
        return EXIT_INTERRUPTED
    if isinstance(exc, typer.TyperException) and hasattr(exc, "show"):  # usage errors: bad flags and values
        exc.show(file=sys.stderr)
        return EXIT_USAGE
    if _state["debug"]:
        import traceback

        # the chain's messages may quote a DSN (a malformed one, as libpq echoes it): redacted like the rest
        console.print(redact("".join(traceback.format_exception(exc))), markup=False, highlight=False,
                      soft_wrap=True)
    message, code = _explain(exc)
    if _state.get("log_format") == "json":  # the error as one more JSON line, not plain text among them
        log.error(redact(message), extra={"event": "error", "error": redact(message), "exit_code": code})
    else:
        console.print(f"[bold red]error:[/bold red] {escape(redact(message))}", highlight=False)
    return code


def _explain(exc: BaseException) -> tuple[str, int]:
    import psycopg
    import psycopg2

    if isinstance(exc, ConfigError):
        return str(exc), EXIT_USAGE
    if isinstance(exc, PgcdcError):
        return str(exc), EXIT_FAILURE
    if isinstance(exc, psycopg.OperationalError | psycopg2.OperationalError) and "timeout expired" in str(exc):
        reason = " ".join(str(exc).split())
        return (f"PostgreSQL did not answer a connection attempt within {os.environ.get('PGCONNECT_TIMEOUT')} s "
                f"({reason}); check --dsn's host and port and the network path to the server, or wait longer with "
                "--connect-timeout"), EXIT_USAGE
    if isinstance(exc, psycopg.OperationalError | psycopg2.OperationalError):
        reason = " ".join(str(exc).split())
        return (f"cannot connect to PostgreSQL ({reason}); check --dsn (host, port, dbname, user, password, "
                "sslmode) and that the server accepts connections from here"), EXIT_USAGE
    if isinstance(exc, psycopg.Error | psycopg2.Error):
        return f"PostgreSQL said: {' '.join(str(exc).split())}", EXIT_FAILURE
    first_line = next((line for line in str(exc).splitlines() if line.strip()), "")
    return f"{type(exc).__name__}: {first_line} (run with --debug for the whole error)", EXIT_FAILURE


def _config_defaults(argv: list[str]) -> dict[str, Any] | None:
    """Read --config / PGCDC_CONFIG before parsing, so the file's values become option defaults."""
    path = os.environ.get("PGCDC_CONFIG")
    for index, arg in enumerate(argv):
        if arg == "--config" and index + 1 < len(argv):
            path = argv[index + 1]
        elif arg.startswith("--config="):
            path = arg.split("=", 1)[1]
    if not path:
        return None
    try:
        settings = tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    flat = {k.replace("-", "_"): v for k, v in settings.items() if not isinstance(v, dict)}
    _state["config_slot"] = flat.get("slot")
    command = typer.main.get_command(app)
    _refuse_unknown_keys(path, settings, command)
    if isinstance(settings.get("spark"), dict):
        flat["conf"] = [f"{k}={v}" for k, v in settings["spark"].items()]
    for key in ("partition-by", "partition_by"):  # [partition-by] "shop.orders" = "days(created_at)" (or a list)
        if isinstance(settings.get(key), dict):
            flat["partition_by"] = [f"{table}={', '.join(v) if isinstance(v, list) else v}"
                                    for table, v in settings[key].items()]
    return _defaults_for(command, flat)


def _refuse_unknown_keys(path: str, settings: dict[str, Any], command: Any) -> None:
    """A misspelt key would be ignored without a word: name it, with the closest known one."""
    import difflib

    known = _option_names(command) | {"spark"}
    for key, value in settings.items():
        name = key.replace("-", "_")
        if name in known and ((name == "spark") == isinstance(value, dict) or name == "partition_by"):
            continue
        if name == "spark" or isinstance(value, dict):
            raise ConfigError(f"config file {path}: [{key}] is not a known table; Spark settings go in [spark]")
        close = difflib.get_close_matches(name, sorted(known - {"spark"}), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else "; keys are the flags' names with underscores"
        raise ConfigError(f"config file {path}: unknown key {key!r}{hint}")


def _option_names(command: Any) -> set[str]:
    subcommands = getattr(command, "commands", None)
    names = {str(param.name) for param in command.params}
    for sub in (subcommands or {}).values():
        names |= _option_names(sub)
    return names


def _defaults_for(command: Any, flat: dict[str, Any]) -> dict[str, Any]:
    subcommands = getattr(command, "commands", None)
    if subcommands is not None:
        return {name: _defaults_for(sub, flat) for name, sub in subcommands.items()}
    names = {param.name for param in command.params}
    return {k: v for k, v in flat.items() if k in names}


if __name__ == "__main__":  # pragma: no cover
    main()
