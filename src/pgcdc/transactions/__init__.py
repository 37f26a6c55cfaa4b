"""Transaction assembly: the message stream to committed transactions, with spill to disk."""
