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

.PHONY: serve test coverage venv lock image bench bench-slots bench-rollouts bench-faults bench-accuracy clean cluster

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
# (pip-tools' venv lives outside the checkout: the checkout holds only the project's code)
LOCK_VENV ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/textswap/lock-venv
lock:
	test -x $(LOCK_VENV)/bin/pip-compile || ($(PYTHON) -m venv $(LOCK_VENV) && $(LOCK_VENV)/bin/pip install --quiet $(PIP_TOOLS))
	$(LOCK_VENV)/bin/pip-compile $(COMPILE) -o requirements.txt requirements.in
	$(LOCK_VENV)/bin/pip-compile $(COMPILE) -o requirements-dev.txt requirements-dev.in

serve: $(STAMP)
	$(PY) supervisor.py --config config.yaml

# tests in a random order (pytest-randomly prints its seed: rerun one order with
# -p randomly --randomly-seed=N), the 15 slowest listed at the end
test: $(DEVSTAMP)
	$(PY) -m pytest -q --durations=15 tests

# the same under coverage.py in every process of the service (.coveragerc);
# then the total and the ten least-covered modules. Not part of `make test`:
# each of the suite's thousands of short-lived processes (workers, trainers,
# CLI calls) pays coverage's start and save, a third more time in all
coverage: $(DEVSTAMP)
	rm -rf .coverage-data
	$(PY) -m coverage run -m pytest -q tests
	$(PY) -m coverage combine -q
	$(PY) -m coverage report | awk 'NR <= 12 || /^TOTAL/'

# The container image (deploy/image/Containerfile; docs/kubernetes.md), built
# with whichever of podman, docker (with a daemon) or buildah is present. The
# host's CA bundle goes in as the build secret `cacert` (pip's, for a
# TLS-intercepting proxy) when there is one. BASE: another Debian 12 base
# with Python 3.11; IMAGE_ARGS: more build flags.
IMAGE ?= textswap:$(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
IMAGE_BUILDER ?= $(shell for b in podman docker buildah; do command -v $$b >/dev/null || continue; \
	[ $$b != docker ] || docker info >/dev/null 2>&1 || continue; echo $$b; break; done)
CACERT ?= $(firstword $(wildcard /etc/ssl/certs/ca-certificates.crt /etc/pki/tls/certs/ca-bundle.crt))
BASE ?=
IMAGE_ARGS ?=
image:
	@test -n "$(IMAGE_BUILDER)" || { echo "make image needs podman, docker (with its daemon) or buildah" >&2; exit 1; }
	$(IMAGE_BUILDER) build -f deploy/image/Containerfile -t $(IMAGE) \
	    $(if $(filter docker,$(IMAGE_BUILDER)),,--format docker) \
	    $(if $(CACERT),--secret id=cacert$(comma)src=$(CACERT)) \
	    $(if $(BASE),--build-arg BASE=$(BASE)) $(IMAGE_ARGS) .
	@echo "image $(IMAGE): $$($(IMAGE_BUILDER) images --format '{{.Size}}' $(IMAGE) | head -1)"

comma := ,

print-%:  # a variable's value, e.g. make -s print-IMAGE
	@echo '$($*)'

# Redis + nginx + three nodes on this machine (see README "Running several nodes")
cluster: $(STAMP)
	$(PY) -m deploy.localcluster $(if $(SENTINEL),--sentinel)  # SENTINEL=1: primary, replica, 3 Sentinels

bench: $(DEVSTAMP)
	$(PY) -m bench.serving
	$(PY) -m bench.cluster  # nginx + Redis + 1-3 nodes (needs redis-server, nginx)
	$(PY) -m bench.slots    # two models, swaps beside load, replica kills, recycling
	$(PY) -m bench.rollouts # rollback in probation, shadow, canary, automatic rollback, gate
	$(PY) -m bench.loop     # prediction log cost (<= 3%), the learning loop on a real set
	$(PY) -m bench.faults   # serving p99 while every fsync takes 200 ms
	$(PY) -m bench.explain  # an explanation's cost against the plain predict

bench-slots: $(DEVSTAMP)
	$(PY) -m bench.slots

bench-rollouts: $(DEVSTAMP)
	$(PY) -m bench.rollouts

bench-faults: $(DEVSTAMP)
	$(PY) -m bench.faults   # serving p99 while every fsync takes 200 ms

bench-accuracy: $(DEVSTAMP)
	$(PY) -m pip install --quiet -r bench/requirements.txt
	$(PY) -m bench.accuracy

clean:
	rm -rf $(VENV) $(LOCK_VENV) .pytest_cache .coverage-data
