"""Service configuration: built-in defaults, config.yaml, command-line overrides.

Every setting has a default here, so the service runs with no file at all;
config.yaml documents the same values. Unknown keys are an error, so a typo
in the file is reported at start instead of being silently ignored.
"""
from __future__ import annotations

import copy
import os
import urllib.parse
from dataclasses import dataclass
from typing import Any

import yaml

DEFAULTS: dict[str, Any] = {
    "server": {
        "host": "0.0.0.0",  # nosec B104 # public by design
        "port": 8080,
        "manage_host": "127.0.0.1",
        "manage_port": 8081,
        # answer POST /predict on a lean path beside Tornado's RequestHandler
        # (same checks and answers, far less CPU per request; see fastpath.py)
        "fast_predict": True,
        # names clients (or a proxy's Host) use for this service besides
        # localhost and the bound addresses: the management routes and
        # POST /feedback refuse any other Host or Origin (DNS rebinding)
        "allowed_hosts": [],
        "body_timeout_s": 60.0,  # a request body not wholly sent within this is cut off
        # the supervisor's event loop under Tornado: "uvloop" (where the
        # package imports; else asyncio's, logged) or "asyncio" (control/eventloop.py)
        "event_loop": "uvloop",
        # what serves the inference port's HTTP/1.1: "httptools" (its C parser
        # under an asyncio protocol, frontend/httpwire.py; where the package
        # imports, else Tornado's, logged) or "tornado" (Tornado's HTTPServer)
        "http_parser": "httptools",
        # the inference port (httptools): a request line and headers not
        # wholly sent within this get 408; a kept-alive connection idle this long is closed
        "header_timeout_s": 10.0,
        "idle_timeout_s": 75.0,
    },
    "models_dir": "./models",
    "management": {
        # the admin key under its older name (auth.admin_key wins when both
        # are set); the environment variable TEXTSWAP_MANAGEMENT_TOKEN overrides it
        "token": "",
    },
    "auth": {
        # API keys (state/keys.py, docs/operations.md "Security"): on by
        # default; false leaves the management port open (loopback only,
        # unless the service starts with --insecure-no-auth) and turns the
        # inference port's POST /feedback off
        "enabled": True,
        # the generated key file; "": <models_dir>/../.textswap/keys.json
        "keys_file": "",
        # keys set here (or in TEXTSWAP_ADMIN_KEY, TEXTSWAP_REVIEW_KEY,
        # TEXTSWAP_FEEDBACK_KEY, TEXTSWAP_PREDICT_KEY) win over the key file's;
        # with none set, the first start generates admin, review and feedback
        # keys into the key file. At least 32 characters each.
        "admin_key": "",
        "review_key": "",
        "feedback_key": "",
        "predict_key": "",  # set: /predict and /v2 need it
        "session_hours": 12.0,  # a dashboard session (from the start URL's code) lasts this long
        "code_minutes": 10.0,  # a one-time dashboard code (the start URL's) works this long
    },
    "limits": {
        "max_body_bytes": 4 * 1024 * 1024,
        "max_texts": 1024,
        "max_text_chars": 20000,
        "max_top_k": 100,
        "default_top_k": 5,
    },
    "worker": {
        # Most texts one model call takes; bigger requests are chunked.
        "max_batch": 256,
        # Extra wait for more requests before a model call, in ms. Measured:
        # 0 (run as soon as the model is free) is best; see README.
        "batch_wait_ms": 0.0,
        # Requests in flight on one worker; beyond it requests wait in the
        # frontend up to request_timeout, then get 503.
        "max_inflight": 256,
        "load_timeout": 60.0,   # load + warm-up of a model, seconds
        "boot_timeout": 60.0,   # TensorFlow import in a new process
        "drain_timeout": 30.0,  # old worker finishing its in-flight requests
        "stop_timeout": 5.0,    # clean exit before SIGTERM, then SIGKILL
        "request_timeout": 30.0,  # a client's predict, queueing included
        "hang_timeout": 20.0,   # a request this old means the worker hangs
        "standby": True,        # keep TensorFlow-ready processes waiting (the pool)
        "standby_pool": 1,      # how many; any model's apply or replacement takes one
        "preload": True,        # ... with the likeliest next model already loaded
        # Fork workers and trainers from one process that imported TensorFlow
        # once (model_worker/zygote.py): a worker starts in milliseconds and
        # shares TensorFlow's memory. false: each child spawns and imports it.
        "zygote": True,
        # TensorFlow threads in a serving worker (0: TensorFlow's choice).
        # Measured on 2 cores: one each cut the worker's CPU per request under
        # load by 25-40% with batch-256 throughput unchanged; raise them on a
        # big machine serving big batches.
        "intra_op_threads": 1,
        "inter_op_threads": 1,
        # How a worker computes a model: "lean" (default) answers from the
        # version's lean.npz when it has one (model_worker/lean.py: the same
        # scores in NumPy, no TensorFlow in the worker: a fifth of the
        # memory), else through Keras; "keras": always through Keras.
        "engine": "lean",
        "max_restarts": 5,      # crashes within restart_window -> FAILED
        # Every worker process at once (serving, draining, standby, preloading,
        # loading); 0 = no limit. Applies that would need more get 409.
        "max_workers": 0,
        # Recycle a serving worker (successor first, no gap) after this many
        # requests or above this RSS; 0 = off.
        "max_requests": 0,
        "max_rss_mb": 0,
        "restart_window": 60.0,
    },
    "rollout": {
        # After a swap the previous version stays loaded, idle, this long:
        # POST /rollback is then one routing assignment. 0 turns it off.
        "probation_s": 60.0,
        # Automatic rollback during probation: the new version's error rate
        # (5xx and model errors) above this share...
        "max_error_rate": 0.05,
        # ... or its p99 latency above this multiple of the previous
        # version's (and at least latency_slack_ms above it)...
        "max_latency_ratio": 3.0,
        "latency_slack_ms": 20.0,
        # ... judged once it has answered this many requests.
        "min_requests": 50,
        # Quality gate: a candidate's golden-set accuracy may be at most this
        # much below the serving version's.
        "gate_tolerance": 0.01,
    },
    "serving": {
        # Replicas of a model when its apply does not say (each its own process).
        "replicas": 1,
    },
    "watcher": {
        "enabled": True,
        "interval": 0.25,
    },
    # Cluster mode (README "Running several nodes"): several nodes on one
    # shared model store follow one applied-model record in Redis.
    "cluster": {
        "redis_url": "",        # e.g. redis://10.0.0.5:6379/0; empty: off (one node).
                                # With a password (redis://user:pw@host/0, rediss:// for
                                # TLS) give it in TEXTSWAP_REDIS_URL or redis_url_file
                                # instead: then it is on no command line or config file
        "redis_url_file": "",   # a file whose first line is the URL (mode 0600)
        "node_id": "",          # empty: hostname:port (the inference port)
        "key_prefix": "textswap",  # Redis keys; one prefix per cluster
        "poll_interval": 1.0,   # heartbeat and record re-read, seconds
        "heartbeat_ttl": 5.0,   # a node missing beats this long is gone
        "job_lease": 10.0,      # a training job's lease; a dead node's job is
                                # `interrupted` this long after its last renewal
        "prepare_timeout": 60.0,  # two-phase apply: a node not ready this long
                                  # refuses the apply (409), unless "partial"
        # Redis Sentinel (docs/cluster.md "Sentinel"): ["host:26379", ...]; the
        # primary is asked of them, and followed through failovers. The URL
        # (redis_url, TEXTSWAP_REDIS_URL or redis_url_file) then gives only the
        # password, the db and rediss:// for TLS; its host is not used
        "sentinels": [],
        "sentinel_service": "textswap",  # the Sentinels' name for the primary
        "min_replicas_acked": None,  # writes answered 200 wait for this many
                                     # replicas (WAIT); None: 1 with Sentinel, else 0
        "replica_ack_timeout": 1.0,  # that wait's bound, seconds; then 503 not_replicated
    },
    # Prometheus metrics (metrics.py): GET /metrics on the management port
    # (behind the admin or review key), and on a port of its own when `port` is set
    "metrics": {
        "enabled": True,
        "port": 0,           # 0: no separate port (TorchServe's convention is 8082)
        "host": "127.0.0.1",  # where that port listens: it takes no key, so loopback by default
    },
    # Drift of live traffic against each version's training-data profile
    # (control/quality.py, docs/loop.md "Live quality and drift"). Thresholds
    # measured with bench/drift.py: quiet on in-domain windows, alert on
    # another language or domain within 500 texts.
    "drift": {
        "window": 1000,        # the last texts of a version that are compared
        "min_texts": 200,      # no alert on fewer texts than this
        "max_unknown_excess": 0.04,  # unknown n-gram share above the training's own
        "max_label_js": 0.1,   # predicted-label distribution (Jensen-Shannon, base 2)
        "max_top_score_js": 0.05,  # top-score distribution (Jensen-Shannon, base 2)
        "refresh_s": 30.0,     # /metrics figures recomputed this often (0: only on GET /quality)
    },
    "training": {
        # auto's pretrained view (WordLlama vectors derived from Llama 2: see
        # docs/models.md for the licence); false: never used by any job
        "pretrained": True,
        "max_concurrent": 1,
        "nice": 10,
        # trainers run under SCHED_IDLE (Linux): they get only CPU that serving
        # leaves unused and never delay a serving thread's wake-up
        "idle_priority": True,
        "threads": 2,
        "demo_on_empty_store": True,
        "data_roots": [],
        # finished jobs kept (listed by GET /train, in the state db); older ones go
        "keep_jobs": 200,
    },
    # The learning loop (docs/loop.md): every prediction logged with its text,
    # true labels fed back (POST /feedback), per-model retrain policies
    "predictions": {
        "log": True,         # keep what /predict answered (texts too) in models_dir/.predictions.db
        "sample": 1.0,       # share of requests logged (a request is logged whole or not at all)
        "max_rows": 100000,  # per model; the oldest go first
        # the age limit of logged texts, feedback and free examples, in days
        # (checked every minute, erased as DELETE /predictions erases); 0: none
        "max_age_days": 0.0,
        "max_age_days_by_model": {},  # {model name: days}, over max_age_days
    },
    "feedback": {
        # the feedback key under its older name (auth.feedback_key wins when
        # both are set); TEXTSWAP_FEEDBACK_TOKEN overrides it
        "token": "",
        "max_items": 1024,   # labels in one POST /feedback
        # per caller (its key; its address when no key is needed): requests a
        # second on average, in bursts of up to `burst`; beyond: 429 with
        # Retry-After. 0: no limit
        "rate_per_s": 20.0,
        "burst": 200.0,
        # the same per caller for what the requests carry: labels (each text
        # labelled or example given) and body bytes
        "labels_per_s": 200.0,
        "label_burst": 2000.0,
        "bytes_per_s": 1048576.0,
        "byte_burst": 8388608.0,
        "max_examples": 1000,        # free examples in one POST /feedback; more: 413
        "max_rows": 100000,          # feedback rows kept per model; the oldest go first
        "max_example_rows": 100000,  # free examples kept per model; the oldest go first
    },
    # per-model retrain policies, e.g. {news: {retrain_after_labels: 200, apply: gate}};
    # PUT /models/<name>/policy overrides them (control/policies.py)
    "policies": {},
    "log_level": "INFO",
    # "text": one line a record, for a terminal; "json": one JSON object a
    # line on stdout (time, level, logger, message, request_id where there is
    # one), for log collectors (Loki, ELK); --log-format overrides it
    "log_format": "text",
}

# mappings whose keys are the user's (model names), checked where they are used
_FREE_MAPPINGS = {"policies", "predictions.max_age_days_by_model"}


LOG_FORMATS = ("text", "json")


class ConfigError(ValueError):
    pass


def _merge(base: dict[str, Any], override: dict[str, Any], path: str = "") -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in override.items():
        where = f"{path}{key}"
        if key not in base:
            raise ConfigError(f"unknown setting '{where}'")
        if isinstance(base[key], dict):
            if not isinstance(value, dict):
                raise ConfigError(f"setting '{where}' must be a mapping")
            if where in _FREE_MAPPINGS:
                out[key] = copy.deepcopy(value)
                continue
            out[key] = _merge(base[key], value, where + ".")
        else:
            default = base[key]
            if isinstance(default, bool) != isinstance(value, bool):
                raise ConfigError(f"setting '{where}' must be a boolean" if isinstance(default, bool)
                                  else f"setting '{where}' must not be a boolean")
            if isinstance(default, float) and isinstance(value, int):
                value = float(value)
            if not isinstance(value, type(default)):
                raise ConfigError(
                    f"setting '{where}' must be of type {type(default).__name__}, got {value!r}")
            out[key] = value
    return out


# -- typed sections: one frozen dataclass per section, built once by
# load_config from the checked mapping, so that mypy checks every
# cfg.<section>.<setting> read; tests/test_config.py keeps their fields equal
# to DEFAULTS' keys.

@dataclass(frozen=True, slots=True)
class ServerSettings:
    host: str
    port: int
    manage_host: str
    manage_port: int
    fast_predict: bool
    allowed_hosts: list[str]
    body_timeout_s: float
    event_loop: str
    http_parser: str
    header_timeout_s: float
    idle_timeout_s: float


@dataclass(frozen=True, slots=True)
class ManagementSettings:
    token: str


@dataclass(frozen=True, slots=True)
class AuthSettings:
    enabled: bool
    keys_file: str
    admin_key: str
    review_key: str
    feedback_key: str
    predict_key: str
    session_hours: float
    code_minutes: float


@dataclass(frozen=True, slots=True)
class LimitsSettings:
    max_body_bytes: int
    max_texts: int
    max_text_chars: int
    max_top_k: int
    default_top_k: int


@dataclass(frozen=True, slots=True)
class WorkerSettings:
    max_batch: int
    batch_wait_ms: float
    max_inflight: int
    load_timeout: float
    boot_timeout: float
    drain_timeout: float
    stop_timeout: float
    request_timeout: float
    hang_timeout: float
    standby: bool
    standby_pool: int
    preload: bool
    zygote: bool
    intra_op_threads: int
    inter_op_threads: int
    engine: str
    max_restarts: int
    max_workers: int
    max_requests: int
    max_rss_mb: int
    restart_window: float


@dataclass(frozen=True, slots=True)
class RolloutSettings:
    probation_s: float
    max_error_rate: float
    max_latency_ratio: float
    latency_slack_ms: float
    min_requests: int
    gate_tolerance: float


@dataclass(frozen=True, slots=True)
class ServingSettings:
    replicas: int


@dataclass(frozen=True, slots=True)
class WatcherSettings:
    enabled: bool
    interval: float


@dataclass(frozen=True, slots=True)
class ClusterSettings:
    redis_url: str
    redis_url_file: str
    node_id: str
    key_prefix: str
    poll_interval: float
    heartbeat_ttl: float
    job_lease: float
    prepare_timeout: float
    sentinels: list[str]
    sentinel_service: str
    min_replicas_acked: int | None
    replica_ack_timeout: float


@dataclass(frozen=True, slots=True)
class MetricsSettings:
    enabled: bool
    port: int
    host: str


@dataclass(frozen=True, slots=True)
class DriftSettings:
    window: int
    min_texts: int
    max_unknown_excess: float
    max_label_js: float
    max_top_score_js: float
    refresh_s: float


@dataclass(frozen=True, slots=True)
class TrainingSettings:
    pretrained: bool
    max_concurrent: int
    nice: int
    idle_priority: bool
    threads: int
    demo_on_empty_store: bool
    data_roots: list[str]
    keep_jobs: int


@dataclass(frozen=True, slots=True)
class PredictionsSettings:
    log: bool
    sample: float
    max_rows: int
    max_age_days: float
    max_age_days_by_model: dict[str, float]


@dataclass(frozen=True, slots=True)
class FeedbackSettings:
    token: str
    max_items: int
    rate_per_s: float
    burst: float
    labels_per_s: float
    label_burst: float
    bytes_per_s: float
    byte_burst: float
    max_examples: int
    max_rows: int
    max_example_rows: int


SECTIONS: dict[str, type] = {name: cls for name, cls in (
    ("server", ServerSettings), ("management", ManagementSettings), ("auth", AuthSettings),
    ("limits", LimitsSettings), ("worker", WorkerSettings), ("rollout", RolloutSettings),
    ("serving", ServingSettings), ("watcher", WatcherSettings), ("cluster", ClusterSettings),
    ("metrics", MetricsSettings), ("drift", DriftSettings), ("training", TrainingSettings),
    ("predictions", PredictionsSettings), ("feedback", FeedbackSettings))}


class Config:
    """The service's settings, checked: a typed section per mapping of
    DEFAULTS (cfg.worker.drain_timeout), `policies` (the user's model names:
    checked by control/policies.py), and the top-level settings. `raw` is the
    merged mapping it was built from (what a child process is handed)."""

    __slots__ = ("raw", "server", "management", "auth", "limits", "worker", "rollout", "serving",
                 "watcher", "cluster", "metrics", "drift", "training", "predictions", "feedback",
                 "policies", "log_level", "log_format")

    def __init__(self, raw: dict[str, Any]) -> None:
        self.raw = raw
        self.server = ServerSettings(**raw["server"])
        self.management = ManagementSettings(**raw["management"])
        self.auth = AuthSettings(**raw["auth"])
        self.limits = LimitsSettings(**raw["limits"])
        self.worker = WorkerSettings(**raw["worker"])
        self.rollout = RolloutSettings(**raw["rollout"])
        self.serving = ServingSettings(**raw["serving"])
        self.watcher = WatcherSettings(**raw["watcher"])
        self.cluster = ClusterSettings(**raw["cluster"])
        self.metrics = MetricsSettings(**raw["metrics"])
        self.drift = DriftSettings(**raw["drift"])
        self.training = TrainingSettings(**raw["training"])
        self.predictions = PredictionsSettings(**raw["predictions"])
        self.feedback = FeedbackSettings(**raw["feedback"])
        self.policies: dict[str, Any] = raw["policies"]
        self.log_level: str = raw["log_level"]
        self.log_format: str = raw["log_format"]

    @property
    def models_dir(self) -> str:
        return os.path.abspath(self.raw["models_dir"])


def load_config(path: str | None = None, overrides: dict[str, Any] | None = None) -> Config:
    data: dict[str, Any] = {}
    if path:
        with open(path, encoding="utf-8") as fh:
            data = yaml.safe_load(fh) or {}
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: top level must be a mapping")
    merged = _merge(DEFAULTS, data)
    if overrides:
        merged = _merge(merged, overrides)
    _check_ages(merged["predictions"])
    _check_feedback(merged["feedback"])
    if merged["server"]["event_loop"] not in ("uvloop", "asyncio"):
        raise ConfigError("setting 'server.event_loop' must be uvloop or asyncio, got "
                          f"{merged['server']['event_loop']!r}")
    if merged["worker"]["engine"] not in ("lean", "keras"):
        raise ConfigError("setting 'worker.engine' must be lean or keras, got "
                          f"{merged['worker']['engine']!r}")
    if merged["server"]["http_parser"] not in ("httptools", "tornado"):
        raise ConfigError("setting 'server.http_parser' must be httptools or tornado, got "
                          f"{merged['server']['http_parser']!r}")
    for key in ("header_timeout_s", "idle_timeout_s"):
        value = merged["server"][key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ConfigError(f"setting 'server.{key}' must be a number of seconds above 0, "
                              f"got {value!r}")
    if merged["log_format"] not in LOG_FORMATS:
        raise ConfigError(f"setting 'log_format' must be one of {', '.join(LOG_FORMATS)}, "
                          f"got {merged['log_format']!r}")
    # TEXTSWAP_DEMO=0 (a production image) or 1 overrides training.demo_on_empty_store
    demo = os.environ.get("TEXTSWAP_DEMO", "").strip()
    if demo:
        if demo not in ("0", "1"):
            raise ConfigError(f"TEXTSWAP_DEMO must be 0 or 1, got {demo!r}")
        merged["training"]["demo_on_empty_store"] = demo == "1"
    _resolve_redis_url(merged["cluster"])
    _check_sentinels(merged["cluster"])
    # the tokens' environment variables win over the file
    for env, (section, key) in _SECRET_ENV.items():
        if env != "TEXTSWAP_REDIS_URL" and os.environ.get(env):
            merged[section][key] = os.environ[env]
    return Config(merged)


# the service's secrets that may come from the environment: read into the
# config at start, then taken out of this process's environment
# (scrub_secret_env), so that no child (worker, trainer, log writer) gets them
_SECRET_ENV = {"TEXTSWAP_MANAGEMENT_TOKEN": ("management", "token"),
               "TEXTSWAP_FEEDBACK_TOKEN": ("feedback", "token"),
               "TEXTSWAP_ADMIN_KEY": ("auth", "admin_key"),
               "TEXTSWAP_REVIEW_KEY": ("auth", "review_key"),
               "TEXTSWAP_FEEDBACK_KEY": ("auth", "feedback_key"),
               "TEXTSWAP_PREDICT_KEY": ("auth", "predict_key"),
               "TEXTSWAP_REDIS_URL": ("cluster", "redis_url")}


def secret_env_name(name: str) -> bool:
    """Whether an environment variable holds one of the service's secrets:
    those above, the CLI's TEXTSWAP_KEY, and any TEXTSWAP_*_KEY, *_TOKEN,
    *_PASSWORD or *_SECRET."""
    return name in _SECRET_ENV or (name.startswith("TEXTSWAP_") and (
        name == "TEXTSWAP_KEY" or name.endswith(("_KEY", "_TOKEN", "_PASSWORD", "_SECRET"))))


def scrub_secret_env() -> list[str]:
    """Remove the secrets' variables from os.environ (after load_config);
    the names removed."""
    names = [name for name in os.environ if secret_env_name(name)]
    return [name for name in names if os.environ.pop(name, None) is not None]


def _check_ages(p: dict[str, Any]) -> None:
    if p["max_age_days"] < 0:
        raise ConfigError("setting 'predictions.max_age_days' must be >= 0 (0: no limit)")
    for model, days in p["max_age_days_by_model"].items():
        if isinstance(days, bool) or not isinstance(days, (int, float)) or days < 0:
            raise ConfigError(f"setting 'predictions.max_age_days_by_model.{model}' must be "
                              f"a number of days >= 0, got {days!r}")


def _check_feedback(f: dict[str, Any]) -> None:
    for key in ("max_examples", "max_rows", "max_example_rows"):
        if f[key] < 1:
            raise ConfigError(f"setting 'feedback.{key}' must be >= 1")
    for key in ("rate_per_s", "burst", "labels_per_s", "label_burst", "bytes_per_s",
                "byte_burst"):
        if f[key] < 0:
            raise ConfigError(f"setting 'feedback.{key}' must be >= 0 (a rate of 0: no limit)")


def open_to_others(path: str) -> int | None:
    """The mode of a file holding a secret when others may read it, else None.
    Private is readable by this user alone, or a read-only file (no write bit
    at all) readable by this process's own group too: what Kubernetes makes of
    a Secret mounted with the pod's fsGroup (0440, that group;
    docs/kubernetes.md). The key file and cluster.redis_url_file keep this rule."""
    st = os.stat(path)
    mode = st.st_mode & 0o777
    if mode & 0o037 or (mode & 0o040 and (mode & 0o200 or st.st_gid != os.getegid())):
        return mode
    return None


def _resolve_redis_url(cluster: dict[str, Any]) -> None:
    """cluster.redis_url: as set (config, --redis-url), else the environment's
    TEXTSWAP_REDIS_URL, else the first line of cluster.redis_url_file."""
    if cluster["redis_url"]:
        return
    env = os.environ.get("TEXTSWAP_REDIS_URL", "").strip()
    if env:
        cluster["redis_url"] = env
        return
    path = cluster["redis_url_file"]
    if path:
        try:
            mode = open_to_others(path)
            if mode is not None:  # it holds the password
                raise ConfigError(f"cluster.redis_url_file: {path} is open to others (mode "
                                  f"{mode:o}); chmod 600 {path}")
            with open(path, encoding="utf-8") as fh:
                cluster["redis_url"] = (fh.readline() or "").strip()
        except OSError as exc:
            raise ConfigError(f"cluster.redis_url_file: cannot read {path}: "
                              f"{exc.strerror or exc}") from None
        if not cluster["redis_url"]:
            raise ConfigError(f"cluster.redis_url_file: {path} holds no URL")


def _check_sentinels(cluster: dict[str, Any]) -> None:
    """cluster.sentinels: a list of "host:port"; min_replicas_acked resolved
    (1 with Sentinel, 0 without), replica_ack_timeout a positive number."""
    sentinels = cluster["sentinels"]
    if isinstance(sentinels, str):
        sentinels = [s for s in sentinels.replace(",", " ").split() if s]
    if not isinstance(sentinels, list):
        raise ConfigError("setting 'cluster.sentinels' must be a list of \"host:port\"")
    for item in sentinels:
        host, _, port = str(item).rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"setting 'cluster.sentinels': {item!r} is not \"host:port\"")
    cluster["sentinels"] = [str(x) for x in sentinels]
    if sentinels and not cluster["sentinel_service"]:
        raise ConfigError("setting 'cluster.sentinel_service' must name the Sentinels' primary")
    acked = cluster["min_replicas_acked"]
    if acked is None:
        acked = 1 if sentinels else 0
    if isinstance(acked, bool) or not isinstance(acked, int) or acked < 0:
        raise ConfigError("setting 'cluster.min_replicas_acked' must be an integer >= 0, "
                          f"got {acked!r}")
    cluster["min_replicas_acked"] = acked
    timeout = cluster["replica_ack_timeout"]
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ConfigError("setting 'cluster.replica_ack_timeout' must be a number of seconds "
                          f"> 0, got {timeout!r}")
    if sentinels and not cluster["redis_url"]:
        cluster["redis_url"] = "redis://"  # no password; the Sentinels name the primary


def redact_url(url: str) -> str:
    """The URL with its password (if any) replaced by ***: what logs, errors
    and /status may show."""
    try:
        parts = urllib.parse.urlsplit(url)
        if parts.query:  # redis-py takes ?password= too
            query = urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
            if any(k.lower() == "password" for k, _ in query):
                parts = parts._replace(query="&".join(
                    f"{k}=***" if k.lower() == "password" else urllib.parse.urlencode({k: v})
                    for k, v in query))
        if parts.password is None:
            return urllib.parse.urlunsplit(parts)
        user = parts.username or ""
        host = parts.netloc.rsplit("@", 1)[1]
        return urllib.parse.urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))
    except ValueError:
        return "<a URL that cannot be parsed>"
