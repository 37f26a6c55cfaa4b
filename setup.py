"""Builds pgcdc's optional C accelerators (pgoutput tuple parsing, column conversion, key hashing); everything
else is in pyproject.toml.

The extensions are optional: where they cannot be compiled, pgcdc runs the same logic in pure Python.
"""

from setuptools import Extension, setup

setup(ext_modules=[
    Extension("pgcdc.pgoutput._tuple", sources=["src/pgcdc/pgoutput/_tuple.c"], optional=True),
    Extension("pgcdc.types._columns", sources=["src/pgcdc/types/_columns.c"], optional=True),
    Extension("pgcdc.index._keyhash", sources=["src/pgcdc/index/_keyhash.c"], optional=True),
])
