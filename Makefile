# The two commands: `make serve` and `make test`. Both create .venv from
# requirements.txt (and install the `textswap` command from pyproject.toml)
# when it is missing or older than either file; the command is installed in
# editable mode with --no-deps: its dependencies are pinned in requirements.txt.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: serve test venv bench bench-slots bench-rollouts bench-faults bench-accuracy clean cluster

$(STAMP): requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	$(PY) -m pip install --quiet --no-deps -e .
	touch $(STAMP)

venv: $(STAMP)

serve: $(STAMP)
	$(PY) supervisor.py --config config.yaml

# tests in a random order (pytest-randomly prints its seed: rerun one order with
# -p randomly --randomly-seed=N), under coverage.py in every process of the
# service (.coveragerc); then the total and the ten least-covered modules
test: $(STAMP)
	rm -rf .coverage-data
	$(PY) -m coverage run -m pytest -q tests
	$(PY) -m coverage combine -q
	$(PY) -m coverage report | awk 'NR <= 12 || /^TOTAL/'

# Redis + nginx + three nodes on this machine (see README "Running several nodes")
cluster: $(STAMP)
	$(PY) deploy/localcluster.py

bench: $(STAMP)
	$(PY) bench/serving.py
	$(PY) bench/cluster.py  # nginx + Redis + 1-3 nodes (needs redis-server, nginx)
	$(PY) bench/slots.py    # two models, swaps beside load, replica kills, recycling
	$(PY) bench/rollouts.py # rollback in probation, shadow, canary, automatic rollback, gate
	$(PY) bench/loop.py     # prediction log cost (<= 3%), the learning loop on a real set
	$(PY) bench/faults.py   # serving p99 while every fsync takes 200 ms
	$(PY) bench/explain.py  # an explanation's cost against the plain predict

bench-slots: $(STAMP)
	$(PY) bench/slots.py

bench-rollouts: $(STAMP)
	$(PY) bench/rollouts.py

bench-faults: $(STAMP)
	$(PY) bench/faults.py   # serving p99 while every fsync takes 200 ms

bench-accuracy: $(STAMP)
	$(PY) -m pip install --quiet -r bench/requirements.txt
	$(PY) bench/accuracy.py

clean:
	rm -rf $(VENV) .pytest_cache .coverage-data
