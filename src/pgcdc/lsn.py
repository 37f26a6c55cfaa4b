"""PostgreSQL log sequence numbers."""

from __future__ import annotations

import re

_LSN_TEXT = re.compile(r"^\s*([0-9A-Fa-f]{1,8})/([0-9A-Fa-f]{1,8})\s*$")
_MAX = 0xFFFF_FFFF_FFFF_FFFF


class Lsn(int):
    """An LSN: a 64-bit WAL position that prints as PostgreSQL does (``16/B374D848``).

    >>> Lsn.parse("16/B374D848")
    Lsn('16/B374D848')
    >>> int(Lsn.parse("0/10"))
    16
    """

    __slots__ = ()

    def __new__(cls, value: int | str = 0) -> Lsn:
        if isinstance(value, str):
            return cls.parse(value)
        if not 0 <= value <= _MAX:
            raise ValueError(f"LSN {value} is outside 0..2^64-1")
        return super().__new__(cls, value)

    @classmethod
    def parse(cls, text: str) -> Lsn:
        match = _LSN_TEXT.match(text)
        if match is None:
            raise ValueError(f"{text!r} is not an LSN; expected the form 'X/Y' in hex, e.g. '16/B374D848'")
        return super().__new__(cls, (int(match.group(1), 16) << 32) | int(match.group(2), 16))

    def __str__(self) -> str:
        return f"{int(self) >> 32:X}/{int(self) & 0xFFFFFFFF:X}"

    def __repr__(self) -> str:
        return f"Lsn('{self}')"

    def __reduce__(self):  # pickling (Spark ships these to executors) keeps the type
        return (Lsn, (int(self),))


ZERO = Lsn(0)
