"""Transaction assembly: the message stream to committed transactions, with spill to disk."""

from pgcdc.transactions.assembler import (
    Change,
    ChangeRun,
    Transaction,
    TransactionAssembler,
    sweep_spill_files,
)
from pgcdc.transactions.reader import Tick, TransactionReader

__all__ = ["Change", "ChangeRun", "Tick", "Transaction", "TransactionAssembler", "TransactionReader", "sweep_spill_files"]
