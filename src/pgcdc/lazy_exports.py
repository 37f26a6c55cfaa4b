"""Packages whose names load on first use: a command that needs none of a package's heavy modules (Arrow, the
codec, the pipeline) starts without importing them, as ``pgcdc --help``, ``status`` or ``slot list`` do."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, exports: Mapping[str, str]) -> Callable[[str], Any]:
    """The module ``__getattr__`` of ``package`` that imports each name of ``exports`` (name: the module defining
    it) when it is first asked for, and keeps it on the package after."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
