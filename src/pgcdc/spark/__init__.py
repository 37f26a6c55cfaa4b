"""Spark side of pgcdc: the session, Iceberg mirrors, apply and the initial snapshot."""
