"""pgcdc's optional C modules, and the switch that leaves them out.

Each C module (tuple parsing, column conversion, key hashing) has a pure-Python path that does the same work more
slowly, taken where the module could not be compiled. ``PGCDC_NO_C_EXTENSIONS=1`` takes those paths on purpose:
to rule the C modules out when a problem is reported, and to run the tests on both paths.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

SWITCH = "PGCDC_NO_C_EXTENSIONS"


def optional_extension(name: str) -> ModuleType | None:
    """The C module ``name`` (a dotted module path), or None where it is not built or the switch is set."""
    if os.environ.get(SWITCH, "").strip().lower() in ("1", "true", "yes", "on"):
        return None
    try:
        return importlib.import_module(name)
    except ImportError:
        return None
