"""Replication client: walsender streaming, SQL interface, slots and server checks."""

from typing import TYPE_CHECKING

from pgcdc.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from pgcdc.replication.options import ReplicationOptions, with_session_settings
    from pgcdc.replication.slots import (
        CreatedSlot,
        KeptConnection,
        ServerInfo,
        SlotInfo,
        SlotManager,
        SourceProblem,
        check_source,
        deadline,
        replication_connection,
        server_info,
        slot_name_problem,
        source_connection,
    )
    from pgcdc.replication.stream import LogicalReplicationStream, ReplicationEvent, SqlInterfaceReader
    from pgcdc.replication.watch import SlotStatus, SourceWatch

__all__ = [
    "CreatedSlot", "KeptConnection", "LogicalReplicationStream", "ReplicationEvent", "ReplicationOptions", "ServerInfo", "SlotInfo",
    "SlotManager", "SlotStatus", "SourceProblem", "SourceWatch", "SqlInterfaceReader", "check_source", "deadline",
    "replication_connection", "server_info", "slot_name_problem", "source_connection", "with_session_settings",
]

__getattr__ = lazy_exports(__name__, {
    **dict.fromkeys(["ReplicationOptions", "with_session_settings"], "pgcdc.replication.options"),
    **dict.fromkeys(["CreatedSlot", "KeptConnection", "ServerInfo", "SlotInfo", "SlotManager", "SourceProblem",
                     "check_source", "deadline", "replication_connection", "server_info", "slot_name_problem",
                     "source_connection"], "pgcdc.replication.slots"),
    **dict.fromkeys(["LogicalReplicationStream", "ReplicationEvent", "SqlInterfaceReader"], "pgcdc.replication.stream"),
    **dict.fromkeys(["SlotStatus", "SourceWatch"], "pgcdc.replication.watch"),
})
