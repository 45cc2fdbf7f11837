import os
import shutil
import subprocess
import sys

import pytest

from tests.helpers import ROOT


# CI (.ci/run) sets TEXTSWAP_REQUIRE_ALL=1: a test skipped for a missing
# part of the environment (redis-server, nginx, Chromium, fiu-utils, tmpfs
# mount rights, pidfds, zh_CN catalogues) fails there, naming what was
# missing, so a green CI has run every feature's tests. Locally a skip stays
# a skip, and the summary (-ra) says what was skipped and why.
REQUIRE_ALL = os.environ.get("TEXTSWAP_REQUIRE_ALL") == "1"


def _required(rep) -> None:
    if REQUIRE_ALL and rep.skipped and not hasattr(rep, "wasxfail"):
        reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
        rep.outcome = "failed"
        rep.longrepr = f"TEXTSWAP_REQUIRE_ALL=1, and this was skipped: {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _required(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    _required(outcome.get_result())


@pytest.fixture(scope="session")
def tiny_store(tmp_path_factory) -> str:
    """A model store with tiny real models: sent v1, sent v2, topic v1.

    Built once per session in a child process (it imports TensorFlow; the test
    process must not, see test_no_tensorflow.py)."""
    root = str(tmp_path_factory.mktemp("store") / "models")
    subprocess.run([sys.executable, "-m", "tests.tinymodels", root],
                   check=True, cwd=ROOT, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    return root


@pytest.fixture
def store_copy(tiny_store, tmp_path) -> str:
    """A private copy of the tiny store, for a test that changes it."""
    dst = str(tmp_path / "models")
    shutil.copytree(tiny_store, dst)
    return dst


@pytest.fixture(scope="session")
def feature_models(tmp_path_factory) -> str:
    """The trained feature models of tests/featuremodels.py ("lin": auto linear,
    "bowm": bow), built once per session in a child process (it imports
    TensorFlow). Read-only: a module that serves them takes a copy
    (feature_store in test_explain.py and test_dashboard_review.py)."""
    root = str(tmp_path_factory.mktemp("features") / "models")
    subprocess.run([sys.executable, "-m", "tests.featuremodels", root],
                   check=True, cwd=ROOT, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    return root


def pytest_terminal_summary(terminalreporter, config) -> None:
    """The random order's seed at the end, next to the failures (make test runs
    -q, which leaves out the header where pytest-randomly prints it)."""
    seed = getattr(config.option, "randomly_seed", None)
    if isinstance(seed, int) and config.pluginmanager.hasplugin("randomly"):
        terminalreporter.write_line(f"random test order: seed {seed} (repeat it with "
                                    f"-p randomly --randomly-seed={seed})")
