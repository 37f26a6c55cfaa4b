"""Replication client: walsender streaming, SQL interface, slots and server checks."""
