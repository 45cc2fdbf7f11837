# The two commands: `make serve` and `make test`. Both create .venv when it
# is missing or older than what it is made from: `make serve` installs the
# service's runtime (requirements.txt), `make test` adds the tests' and the
# type check's packages (requirements-dev.txt). Both files pin every package
# with its hashes (pip install --require-hashes); edit requirements*.in and
# run `make lock` to write them. The `textswap` command is installed from
# pyproject.toml in editable mode with --no-deps (its dependencies are the
# pinned ones).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEVSTAMP := $(VENV)/.installed-dev
PIP_TOOLS := pip-tools==7.7.0
COMPILE := --quiet --generate-hashes --allow-unsafe --strip-extras --no-emit-index-url --no-emit-find-links

.PHONY: serve test venv lock bench bench-slots bench-rollouts bench-faults bench-accuracy clean cluster

$(STAMP): requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet --require-hashes -r requirements.txt
	$(PY) -m pip install --quiet --no-deps -e .
	touch $(STAMP)

$(DEVSTAMP): $(STAMP) requirements-dev.txt
	$(PY) -m pip install --quiet --require-hashes -r requirements.txt -r requirements-dev.txt
	touch $(DEVSTAMP)

venv: $(DEVSTAMP)

# requirements*.in -> requirements*.txt (every package pinned, with hashes),
# with pip-tools in a venv of its own
lock:
	test -x .lock-venv/bin/pip-compile || ($(PYTHON) -m venv .lock-venv && .lock-venv/bin/pip install --quiet $(PIP_TOOLS))
	.lock-venv/bin/pip-compile $(COMPILE) -o requirements.txt requirements.in
	.lock-venv/bin/pip-compile $(COMPILE) -o requirements-dev.txt requirements-dev.in

serve: $(STAMP)
	$(PY) supervisor.py --config config.yaml

# tests in a random order (pytest-randomly prints its seed: rerun one order with
# -p randomly --randomly-seed=N), under coverage.py in every process of the
# service (.coveragerc); then the total and the ten least-covered modules
test: $(DEVSTAMP)
	rm -rf .coverage-data
	$(PY) -m coverage run -m pytest -q tests
	$(PY) -m coverage combine -q
	$(PY) -m coverage report | awk 'NR <= 12 || /^TOTAL/'

# Redis + nginx + three nodes on this machine (see README "Running several nodes")
cluster: $(STAMP)
	$(PY) deploy/localcluster.py $(if $(SENTINEL),--sentinel)  # SENTINEL=1: primary, replica, 3 Sentinels

bench: $(DEVSTAMP)
	$(PY) bench/serving.py
	$(PY) bench/cluster.py  # nginx + Redis + 1-3 nodes (needs redis-server, nginx)
	$(PY) bench/slots.py    # two models, swaps beside load, replica kills, recycling
	$(PY) bench/rollouts.py # rollback in probation, shadow, canary, automatic rollback, gate
	$(PY) bench/loop.py     # prediction log cost (<= 3%), the learning loop on a real set
	$(PY) bench/faults.py   # serving p99 while every fsync takes 200 ms
	$(PY) bench/explain.py  # an explanation's cost against the plain predict

bench-slots: $(DEVSTAMP)
	$(PY) bench/slots.py

bench-rollouts: $(DEVSTAMP)
	$(PY) bench/rollouts.py

bench-faults: $(DEVSTAMP)
	$(PY) bench/faults.py   # serving p99 while every fsync takes 200 ms

bench-accuracy: $(DEVSTAMP)
	$(PY) -m pip install --quiet -r bench/requirements.txt
	$(PY) bench/accuracy.py

clean:
	rm -rf $(VENV) .lock-venv .pytest_cache .coverage-data
