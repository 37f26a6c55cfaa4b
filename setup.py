"""Builds pgcdc's optional C accelerator of pgoutput tuple parsing; everything else is in pyproject.toml.

The extension is optional: where it cannot be compiled, pgcdc runs the same logic in pure Python.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("pgcdc.pgoutput._tuple", sources=["src/pgcdc/pgoutput/_tuple.c"], optional=True)])
