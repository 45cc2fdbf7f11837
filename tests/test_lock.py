"""The hashed locks install on every Python the README promises ("Python 3.11").

pip-compile resolves for the Python it runs on, and `--require-hashes`
refuses any package the lock does not pin. A dependency that a pinned package
asks for only on some Python releases (redis asks for async-timeout before
3.11.3, Debian 12's python3 is 3.11.2) is then missing from a lock made on a
later release, and `make serve` fails on the earlier one. This test reads the
real metadata of every installed, pinned package and evaluates each of its
requirements' markers for every 3.11 release, on Linux x86_64 and aarch64: each
requirement that applies must be pinned, at a version it accepts. The image
build in tests/test_image.py installs the same lock on Debian's 3.11.2 for real.
"""
import importlib.metadata as md
import os
import re

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.helpers import ROOT

# every CPython 3.11 patch release (3.11.0 to 3.11.14 have shipped)
PYTHONS = [f"3.11.{n}" for n in range(0, 15)]
MACHINES = ["x86_64", "aarch64"]


def _pins(*files: str) -> dict[str, str]:
    pins: dict[str, str] = {}
    for name in files:
        with open(os.path.join(ROOT, name), encoding="utf-8") as f:
            for line in f:
                m = re.match(r"^([A-Za-z0-9_.\-]+)==([^\s\\;]+)", line)
                if m:
                    pins[canonicalize_name(m.group(1))] = m.group(2)
    return pins


def _environments():
    for py in PYTHONS:
        for machine in MACHINES:
            env = default_environment()
            env.update(python_full_version=py, python_version="3.11", sys_platform="linux",
                       platform_system="Linux", os_name="posix", platform_machine=machine,
                       implementation_name="cpython", platform_python_implementation="CPython")
            yield env


def _missing(pins: dict[str, str]) -> list[str]:
    problems = []
    for name, version in sorted(pins.items()):
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue   # pinned for another platform; nothing installed to read
        for spec in dist.requires or []:
            req = Requirement(spec)
            dep = canonicalize_name(req.name)
            for env in _environments():
                if req.marker is not None and not req.marker.evaluate({**env, "extra": ""}):
                    continue
                if dep not in pins:
                    problems.append(f"{name}=={version} needs {spec!r} on Python "
                                    f"{env['python_full_version']} ({env['platform_machine']}), "
                                    f"and the lock has no {dep}")
                elif not req.specifier.contains(pins[dep], prereleases=True):
                    problems.append(f"{name}=={version} needs {spec!r}; the lock pins "
                                    f"{dep}=={pins[dep]}")
                break
    return problems


def test_runtime_lock_covers_every_311_release():
    pins = _pins("requirements.txt")
    assert "async-timeout" in pins, "redis needs async-timeout before Python 3.11.3"
    assert _missing(pins) == []


def test_dev_lock_covers_every_311_release():
    assert _missing(_pins("requirements.txt", "requirements-dev.txt")) == []


def test_lock_check_sees_a_marker_only_dependency():
    """The check itself: without the async-timeout pin, redis's requirement
    for Python before 3.11.3 is reported."""
    pins = _pins("requirements.txt")
    pins.pop("async-timeout")
    assert any(p.startswith("redis==") and "async-timeout" in p for p in _missing(pins))
