"""What a mirror is and records: its name, creation and schema (``catalog``), its properties and position, what a
start-up and ``pgcdc status`` read of a namespace's mirrors, the consistent tags across them, added columns'
fills, and their maintenance."""
