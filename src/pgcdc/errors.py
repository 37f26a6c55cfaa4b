"""One exception tree for everything pgcdc raises on purpose.

Every error says what is wrong and, where pgcdc can know it, how to fix it.
"""

from __future__ import annotations


class PgcdcError(Exception):
    """Base of every error pgcdc raises deliberately."""


class DecodeError(PgcdcError):
    """Bytes that are not a valid pgoutput message for the given protocol state."""

    def __init__(self, message: str, *, msg_type: str | None = None, field: str | None = None,
                 offset: int | None = None) -> None:
        self.msg_type = msg_type
        self.field = field
        self.offset = offset
        where = []
        if msg_type is not None:
            where.append(f"message {msg_type}")
        if field is not None:
            where.append(f"field {field}")
        if offset is not None:
            where.append(f"byte offset {offset}")
        super().__init__(f"{message} ({', '.join(where)})" if where else message)


class ProtocolError(PgcdcError):
    """The server or the message stream broke the replication protocol's rules."""


class ConversionError(PgcdcError):
    """A column value that cannot be converted to its declared type."""


class UnconvertibleValue(PgcdcError):
    """A value a type's decoder cannot convert; the converter makes it a ConversionError with the column's context
    (table, column, type, format, LSN)."""


class TextValuesRequired(ConversionError):
    """Binary values of a column whose type pgcdc reads only as text (a column added while streaming binary)."""


class InProgressDecodingFailed(PgcdcError):
    """The server's decoder failed on a transaction it was streaming in progress (a PostgreSQL internal error,
    such as "could not map filenumber ... to relation OID"): decoded whole at its commit, it may not fail."""


class ConfigError(PgcdcError):
    """Bad configuration or a server set-up pgcdc cannot work with; the message says how to fix it."""


class SlotBusyError(ConfigError):
    """The replication slot is active for another connection."""


class SourceChangedError(PgcdcError):
    """The source's catalog changed under pgcdc (a table or a type dropped while it was being read)."""


class IdentityChangedError(PgcdcError):
    """A table's replica identity changed while pgcdc streams it, under ``--on-identity-change stop``."""


class EmbeddedPostgresError(PgcdcError):
    """The embedded server could not be set up or started; the message carries its log's tail."""


class SpillCorruptError(PgcdcError):
    """A spill file that cannot be written, or that changed on disk; the message says what to do."""


class PositionCorruptError(PgcdcError):
    """A mirror's stored position (``pgcdc.lsn``) that cannot be trusted; the message says the way out."""


class Unindexable(PgcdcError):
    """Why a mirror's key index cannot be had (its files out of this machine's reach, or past the memory the
    indexes may take): that mirror deletes by equality instead, with a warning."""


class MetadataUnreadable(PgcdcError):
    """This process cannot read a mirror's metadata by itself (a catalog, storage or format it does not handle, or
    a file it cannot read): it is read through Spark's JVM instead. Never shown to a user."""
