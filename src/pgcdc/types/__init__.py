"""Column values: PostgreSQL types to Arrow and Spark, text and binary formats."""
