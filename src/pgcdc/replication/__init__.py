"""Replication client: walsender streaming, SQL interface, slots and server checks."""

from pgcdc.replication.options import ReplicationOptions, with_session_settings
from pgcdc.replication.slots import (
    CreatedSlot,
    ServerInfo,
    SlotInfo,
    SlotManager,
    SourceProblem,
    check_source,
    deadline,
    replication_connection,
    server_info,
)
from pgcdc.replication.stream import LogicalReplicationStream, ReplicationEvent, SqlInterfaceReader

__all__ = [
    "CreatedSlot", "LogicalReplicationStream", "ReplicationEvent", "ReplicationOptions", "ServerInfo", "SlotInfo",
    "SlotManager", "SourceProblem", "SqlInterfaceReader", "check_source", "deadline", "replication_connection", "server_info",
    "with_session_settings",
]
