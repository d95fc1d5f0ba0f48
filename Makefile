# tensile_db — the two commands of the README:
#   make demo   in-database training of four models (three MLPs, a CNN) at once in an embedded PostgreSQL cluster
#   make test   the test suite (what .ci/run calls)
#
# Everything missing is installed: Debian's PL/Python for PostgreSQL 15, a virtual environment
# built from the Python that PL/Python embeds (/usr/bin/python3.11), this package, and the
# extension's files (PGXS `make install`). State lives in TENSILE_HOME: the checkout's .tensile/
# when the `postgres` OS user can read the checkout, else a directory under /var/lib/tensile_db/
# (running as root, the server runs as `postgres`, which must read the venv and the cluster).

SYSTEM_PYTHON ?= /usr/bin/python3.11
# Decided once (":="), before system-deps can change the answer; override with TENSILE_HOME=dir.
TENSILE_HOME := $(shell if [ "$$(id -u)" = 0 ] && ! runuser -u postgres -- test -r "$(CURDIR)/Makefile" 2>/dev/null; \
	then echo /var/lib/tensile_db/$$(printf %s "$(CURDIR)" | sha256sum | cut -c1-12); else echo "$(CURDIR)/.tensile"; fi)
VENV := $(TENSILE_HOME)/venv
PY := $(VENV)/bin/python
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
APT_PACKAGES := postgresql-15 postgresql-plpython3-15 postgresql-server-dev-15 gcc libgomp1 python3.11 python3.11-venv
# docker-compose only validates the compose files (tests/test_compose.py): installed without its
# recommended Docker engine, which nothing here runs.
APT_TOOLS := docker-compose
export TENSILE_HOME

.PHONY: demo test system-deps extension package bench compose-check clean

demo: package extension
	$(PY) -m tensile_db.cli demo --home "$(TENSILE_HOME)"

test: package extension
	$(PY) -m ruff check tensile_db tests bench
	$(PY) -m pytest

bench: $(VENV)/.bench-deps package extension
	$(PY) bench/ingest.py --home "$(TENSILE_HOME)"
	$(PY) bench/throughput.py
	$(PY) bench/scheduler.py
	$(PY) bench/pool.py
	$(PY) bench/paper.py
	$(PY) bench/inference.py
	$(PY) bench/fairness.py
	$(PY) bench/load.py
	$(PY) bench/spill.py
	$(PY) bench/disk_layering.py
	$(PY) bench/accuracy.py
	$(PY) bench/search.py
	$(PY) bench/placement.py

system-deps:
	@dpkg -s $(APT_PACKAGES) $(APT_TOOLS) >/dev/null 2>&1 || { \
	  echo "installing $(APT_PACKAGES) $(APT_TOOLS)"; \
	  $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq $(APT_PACKAGES) >/dev/null && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends $(APT_TOOLS) >/dev/null; }

$(VENV)/.deps: pyproject.toml | system-deps
	install -d -m 755 "$(TENSILE_HOME)"
	[ -x "$(PY)" ] || $(SYSTEM_PYTHON) -m venv "$(VENV)"
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install -q ".[test,demo]"
	touch $@

# The bench extra (matplotlib), only for `make bench`; installed before `package` reinstalls the package.
$(VENV)/.bench-deps: pyproject.toml $(VENV)/.deps
	$(PY) -m pip install -q ".[bench]"
	touch $@

# Reinstall the package itself on every run (no dependencies): the server imports the installed copy.
# Its compiled library is built in the checkout too, for the tests, which import the checkout's copy.
package: $(VENV)/.deps
	$(PY) -m pip install -q --no-deps --no-build-isolation --force-reinstall .
	$(PY) setup.py -q build_ext --inplace
	chmod -R a+rX "$(VENV)"

extension: system-deps
	$(SUDO) $(MAKE) -s -C extension install

# The docker-compose setup for real (needs a Docker engine; not part of `make test`): builds both
# images, runs the demo service, restarts the database, removes what it made. docker/compose-check.sh
compose-check:
	bash docker/compose-check.sh

clean:
	$(MAKE) -s -C extension clean
	rm -rf build *.egg-info
