"""Transaction assembly: the message stream to committed transactions, with spill to disk."""

from pgcdc.transactions.assembler import Change, Transaction, TransactionAssembler, sweep_spill_files

__all__ = ["Change", "Transaction", "TransactionAssembler", "sweep_spill_files"]
