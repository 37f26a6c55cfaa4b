"""Where each row of a mirror is: key codes computed in bulk from Arrow, the key index from a row's key to its
data file and row position, and a mirror's index kept equal to its Iceberg snapshot, so that a batch deletes by
position."""
