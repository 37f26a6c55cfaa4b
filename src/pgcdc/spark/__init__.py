"""What needs Spark's JVM: the session and its settings, the destination's checks, Iceberg's Java API (commits
that carry pgcdc's position), the initial copy's tasks, and Arrow tables handed to Spark."""
