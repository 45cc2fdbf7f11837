"""The container image (deploy/image/Containerfile), built and run for real.

No image registry is reachable here, so the base is Debian 12 built with
debootstrap (deploy/image/debian-base.sh: minbase + Python 3.11.2, its venv
module, CA certificates, tini) and imported into buildah's local storage;
`make image` then builds the real Containerfile on it with buildah
(--isolation chroot), which installs the hashed lock on Debian's own Python
3.11.2. The image is run with `buildah run` (host network, loopback ports,
the image's user, its ENTRYPOINT and ENV, a fresh volume): /healthz, the key
file generated in the volume, a train on data copied into the volume, apply
and predict, SIGTERM to the container's init (tini), and a restart on the
same volume that serves the applied model again. buildah run has no
read-only root filesystem, so the test checks that the container's writable
layer holds nothing outside /tmp.

The build is deploy/image/ci-build.sh, which .ci/run starts beside the test
suite (the fixture waits for its result). The image's pip reads the wheels
of the same hashed lock downloaded beforehand (mounted read-only into the
build: PIP_FIND_LINKS, PIP_NO_INDEX); the Containerfile alone installs from PyPI.
Needs root, debootstrap and buildah (.ci/run installs them).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time

import psutil
import pytest

from tests.helpers import ROOT, free_port, request, wait_for

UID = 10001


def _missing() -> str | None:
    if os.geteuid() != 0:
        return "building the image needs root (buildah, debootstrap)"
    for tool in ("buildah", "debootstrap"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt-get install {tool})"
    return None


# the first test builds the base and the image (minutes on 2 cores)
pytestmark = [pytest.mark.skipif(_missing() is not None, reason=_missing() or ""),
              pytest.mark.timeout(1500)]


def make_var(name: str) -> str:
    out = subprocess.run(["make", "-s", "--no-print-directory", f"print-{name}"], cwd=ROOT,
                         check=True, capture_output=True, text=True).stdout
    return out.strip()


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "BUILDAH_ISOLATION": "chroot"}
    return subprocess.run(cmd, check=True, capture_output=True, text=True, env=env, **kw)


@pytest.fixture(scope="module")
def image(tmp_path_factory):
    """The image `make image` builds, on a debootstrap'd bookworm base
    (deploy/image/ci-build.sh). .ci/run starts that build beside the test
    suite and names its folder in TEXTSWAP_IMAGE_BUILD: this waits for its
    result; else the build runs here. Either way it is this run's: nothing
    is kept between runs."""
    tag = make_var("IMAGE")
    out = os.environ.get("TEXTSWAP_IMAGE_BUILD")
    if not out:
        out = str(tmp_path_factory.mktemp("image"))
        subprocess.run([os.path.join(ROOT, "deploy", "image", "ci-build.sh"), out,
                        os.environ.get("TEXTSWAP_IMAGE_BASE", "")], cwd=ROOT)
    rc = os.path.join(out, "rc")
    wait_for(lambda: os.path.exists(rc), timeout=1400, what="the image build (ci-build.sh)", interval=1.0)
    with open(os.path.join(out, "log"), encoding="utf-8", errors="replace") as fh:
        build = fh.read()
    with open(rc) as fh:
        assert fh.read().strip() == "0", f"the image build failed:\n{build[-6000:]}"
    with open(os.path.join(out, "times")) as fh:
        times = {k: float(v) for k, v in (line.split() for line in fh if line.strip())}
    with open(os.path.join(out, "base")) as fh:
        base = fh.read().strip()
    work = tmp_path_factory.mktemp("image-work")
    ctr = _run(["buildah", "from", "--quiet", base]).stdout.strip()
    with open(os.path.join(_run(["buildah", "mount", ctr]).stdout.strip(),
                           "etc/ssl/certs/ca-certificates.crt"), "rb") as fh:
        base_ca = fh.read()
    _run(["buildah", "umount", ctr])
    _run(["buildah", "rm", ctr])
    ctr = _run(["buildah", "from", "--quiet", tag]).stdout.strip()
    mnt = _run(["buildah", "mount", ctr]).stdout.strip()
    image_bytes, venv = (int(_run(["du", "-sb", path]).stdout.split()[0])
                         for path in (mnt, f"{mnt}/opt/textswap/venv"))
    with open(f"{mnt}/opt/textswap/venv/pyvenv.cfg", encoding="utf-8") as fh:
        python = dict(line.split(" = ", 1) for line in fh.read().splitlines())["version"]
    _run(["buildah", "umount", ctr])
    _run(["buildah", "rm", ctr])
    config = json.loads(_run(["buildah", "inspect", "--type", "image", tag]).stdout)["Docker"]["config"]
    print(f"\nimage {tag} (Python {python}): {image_bytes / 1e6:.0f} MB, its venv {venv / 1e6:.0f} MB "
          f"({image_bytes / venv:.2f}x); " + ", ".join(f"{k} {v:.0f}s" for k, v in times.items()))
    yield {"tag": tag, "config": config, "base_ca": base_ca, "image_bytes": image_bytes,
           "venv_bytes": venv, "python": python, "build_log": build, "work": work}
    # removing 2 GB of layers takes half a minute of disk time: it goes on
    # beside the tests that follow
    subprocess.Popen(["buildah", "rmi", "--force", tag, base], stdout=subprocess.DEVNULL,
                     stderr=subprocess.DEVNULL, start_new_session=True)


def test_the_hashed_lock_installed_on_debians_python_3_11_2(image):
    """The lock's oldest 3.11 (redis asks for async-timeout before 3.11.3)."""
    assert image["python"] == "3.11.2"


def test_the_image_is_at_most_1_3_times_its_venv(image):
    assert image["venv_bytes"] > 500e6  # TensorFlow and Keras are in it
    assert image["image_bytes"] <= 1.3 * image["venv_bytes"], \
        (image["image_bytes"], image["venv_bytes"])
    assert f"image {image['tag']}:" in image["build_log"]  # make image prints its size


def test_image_config_runs_as_a_fixed_user_with_tini_and_a_healthcheck(image):
    c = image["config"]
    assert c["User"] == f"{UID}:{UID}"
    assert c["Entrypoint"][:2] == ["tini", "--"]
    assert c["StopSignal"] == "SIGTERM"
    assert set(c["ExposedPorts"]) == {"8080/tcp", "8081/tcp"}
    assert list(c["Volumes"]) == ["/var/lib/textswap"]
    assert "python" in c["Healthcheck"]["Test"][1] and "/healthz" in " ".join(c["Healthcheck"]["Test"])


def test_the_image_holds_no_compiler_pip_cache_tests_or_git(image):
    ctr = _run(["buildah", "from", "--quiet", image["tag"]]).stdout.strip()
    try:
        mnt = _run(["buildah", "mount", ctr]).stdout.strip()
        for path in ("opt/textswap/tests", "opt/textswap/bench", "opt/textswap/.git",
                     "root/.cache/pip", "usr/bin/gcc", "usr/bin/cc", "etc/ssl/certs/proxy"):
            assert not os.path.exists(os.path.join(mnt, path)), path
        # the CA bundle is the base's own: the build secret (the host's
        # bundle) was mounted for the install only and stored nowhere
        with open(os.path.join(mnt, "etc/ssl/certs/ca-certificates.crt"), "rb") as fh:
            assert fh.read() == image["base_ca"]
        assert not os.path.exists(os.path.join(mnt, "run/secrets/cacert"))
        assert os.path.exists(os.path.join(mnt, "opt/textswap/data/demo/sentiment_zh.jsonl"))
        # bytecode compiled at build time: the read-only root takes none later
        site = os.path.join(mnt, "opt/textswap/venv/lib/python3.11/site-packages")
        for pkg in ("tensorflow", "keras", "tornado"):
            assert any(f.startswith("__init__.cpython-311") for f in
                       os.listdir(os.path.join(site, pkg, "__pycache__"))), pkg
        assert os.listdir(os.path.join(mnt, "opt/textswap/control/__pycache__"))
        # the `textswap` command is on the image's PATH, as the image's user
        out = _run(["buildah", "run", "--isolation", "chroot", "--user", f"{UID}:{UID}", ctr,
                    "--", "textswap", "--version"]).stdout
        assert "0.1.0" in out, out
    finally:
        _run(["buildah", "umount", ctr])
        _run(["buildah", "rm", ctr])


class Container:
    """One `buildah run` of the image's ENTRYPOINT, as its user, host network
    on free loopback ports, the volume at /var/lib/textswap."""

    def __init__(self, image: dict, volume: str, env: dict[str, str]) -> None:
        self.ctr = _run(["buildah", "from", "--quiet", image["tag"]]).stdout.strip()
        self.port, self.mport = free_port(), free_port()
        self.log = open(os.path.join(os.path.dirname(volume), f"run-{self.port}.log"), "w+b")
        cmd = ["buildah", "run", "--isolation", "chroot", "--network", "host",
               "--user", f"{UID}:{UID}", "--volume", f"{volume}:/var/lib/textswap"]
        # buildah run gives the container no PID namespace: tini is not PID 1
        # there, and registers as the subreaper instead, as it would be
        for k, v in {"TINI_SUBREAPER": "1", **env}.items():
            cmd += ["--env", f"{k}={v}"]
        entry = image["config"]["Entrypoint"]
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            cmd + [self.ctr, "--"] + entry + ["--host", "127.0.0.1", "--manage-host", "127.0.0.1",
                                              "--port", str(self.port),
                                              "--manage-port", str(self.mport)],
            stdout=self.log, stderr=subprocess.STDOUT)

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read().decode("utf-8", "replace")

    def init_pid(self) -> int:
        """The container's init: the tini among buildah run's descendants."""
        def find():
            for p in psutil.Process(self.proc.pid).children(recursive=True):
                if p.name() == "tini":
                    return p.pid
            return None
        return wait_for(find, 30, "tini in the container")

    def pss(self) -> int:
        """Bytes of memory (PSS) of every process in the container."""
        total = 0
        for p in psutil.Process(self.proc.pid).children(recursive=True):
            try:
                if p.uids().real == UID:
                    total += p.memory_full_info().pss
            except psutil.Error:
                pass
        return total

    def upper_files(self) -> list[str]:
        """What the run wrote to the container's own layer (not the volume)."""
        mnt = _run(["buildah", "mount", self.ctr]).stdout.strip()
        upper = os.path.join(os.path.dirname(mnt), "diff")
        found = []
        for d, dirs, files in os.walk(upper):
            for name in files + [x for x in dirs if os.path.islink(os.path.join(d, x))]:
                found.append(os.path.relpath(os.path.join(d, name), upper))
        _run(["buildah", "umount", self.ctr])
        return found

    def remove(self) -> None:
        if self.proc.poll() is None:
            # buildah run passes no SIGKILL on: its descendants (tini, the
            # service, its workers) are killed themselves, or they outlive the test
            try:
                tree = psutil.Process(self.proc.pid).children(recursive=True)
            except psutil.Error:
                tree = []
            self.proc.kill()
            self.proc.wait()
            for p in tree:
                try:
                    p.kill()
                except psutil.Error:
                    pass
            psutil.wait_procs(tree, timeout=10)
        subprocess.run(["buildah", "rm", self.ctr], capture_output=True)
        self.log.close()


def _keys(volume: str) -> dict[str, str]:
    with open(os.path.join(volume, ".textswap", "keys.json"), encoding="utf-8") as fh:
        return json.load(fh)["keys"]


def test_the_image_runs_trains_applies_predicts_and_stops_cleanly(image, tmp_path):
    volume = str(tmp_path / "volume")
    os.makedirs(os.path.join(volume, "models", "data"))
    # the user's path: a JSONL file placed in models/data/ (here 1,200 of the
    # demo's 6,000 reviews: a shorter training)
    with open(os.path.join(ROOT, "data", "demo", "sentiment_zh.jsonl"), encoding="utf-8") as src:
        lines = src.readlines()
    with open(os.path.join(volume, "models", "data", "reviews.jsonl"), "w", encoding="utf-8") as dst:
        dst.writelines(lines[:600] + lines[-600:])
    for d, dirs, files in os.walk(volume):
        for name in [d] + [os.path.join(d, f) for f in files]:
            os.chown(name, UID, UID)
    # a production start: no demo training (TEXTSWAP_DEMO=0)
    c = Container(image, volume, {"TEXTSWAP_DEMO": "0"})
    try:
        wait_for(lambda: request(c.port, "GET", "/healthz", auth=False)[0] == 200, 60,
                 f"the container's /healthz\n{c.output()}")
        first_healthz = time.monotonic() - c.started
        # the key file: generated in the volume, 0600, owned by the image's user
        path = os.path.join(volume, ".textswap", "keys.json")
        st = os.stat(path)
        assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == UID
        admin = {"Authorization": f"Bearer {_keys(volume)['admin']}"}
        assert request(c.mport, "GET", "/models", auth=False)[0] == 401
        code, body = request(c.mport, "POST", "/train", {
            "name": "reviews", "data": {"path": "reviews.jsonl"},
            "params": {"architecture": "bow", "epochs": 3}}, headers=admin)
        assert code == 202, body
        job = body["job"]["id"]
        peak_pss = [0]

        def finished():
            peak_pss[0] = max(peak_pss[0], c.pss())
            r = request(c.mport, "GET", f"/train/{job}", headers=admin)[1]["job"]
            return r if r["state"] in ("succeeded", "failed", "cancelled", "interrupted") else None
        done = wait_for(finished, 300, "training", interval=0.5)
        assert done["state"] == "succeeded", done
        code, body = request(c.mport, "POST", "/apply", {"name": "reviews"}, headers=admin)
        assert code == 200, body
        code, body = request(c.port, "POST", "/predict", {"text": "质量很好，非常满意"})
        assert code == 200 and body["model"]["name"] == "reviews", body
        serving_pss = c.pss()
        code, _ = request(c.port, "POST", "/predict", {"text": 5},
                          headers={"X-Request-Id": "image-test-1"})
        assert code == 400
        # logs: one JSON object a line (the image's config says log_format: json)
        lines = [x for x in c.output().splitlines() if x.startswith("{")]
        records = [json.loads(x) for x in lines]
        assert any(r.get("request_id") == "image-test-1" and "400 POST /predict" in r["message"]
                   for r in records), lines[-5:]
        assert {"time", "level", "logger", "message"} <= set(records[0])
        assert any("inference API on" in r["message"] for r in records)
        assert not any("demo" in r["message"] and "training" in r["message"] for r in records)
        # SIGTERM to the container's init, as a runtime stops it: drains, exits 0
        os.kill(c.init_pid(), signal.SIGTERM)
        drain = 30.0  # worker.drain_timeout
        assert c.proc.wait(drain + 10) == 0, c.output()[-3000:]
        assert "all workers stopped" in c.output()
        written = [f for f in c.upper_files() if not f.startswith("tmp/")]
        # buildah run's own mount points (resolv.conf, hosts, the volume's folder)
        assert all(f in ("etc/hosts", "etc/resolv.conf", "etc/hostname", "run/.containerenv")
                   or f.startswith(("var/lib/textswap", "proc", "sys", "dev", "run/"))
                   for f in written), written
    finally:
        c.remove()
    # a restart on the same volume serves the applied model again
    c = Container(image, volume, {"TEXTSWAP_DEMO": "0"})
    try:
        def predicted():
            code, body = request(c.port, "POST", "/predict", {"text": "质量很好"})
            return code == 200 and body["model"]["name"] == "reviews"
        wait_for(predicted, 60, f"the applied model after a restart\n{c.output()}")
        first_prediction = time.monotonic() - c.started
    finally:
        c.remove()
    print(f"\nimage start: first /healthz {first_healthz:.1f}s, first prediction of the "
          f"applied model after a restart {first_prediction:.1f}s; memory (PSS, all the "
          f"container's processes): {peak_pss[0] / 1e6:.0f} MB peak while training, "
          f"{serving_pss / 1e6:.0f} MB serving")
