"""The Iceberg table format, read and written in Python without a JVM: a table's metadata file, its manifest lists
and manifests (Avro), the files of a snapshot and the rows they hold, the catalogs pgcdc configures, where a
location points, and Parquet data files in a table's layout. Imports nothing of pgcdc's but its errors."""
