"""Prometheus metrics of the service (supervisor side; no TensorFlow).

Served as the Prometheus text format at GET /metrics on the management port
(behind the admin or review key) and, when `metrics.port` is set, on a port of its own.

The hot path stays cheap: a request or a model batch only bumps plain ints in
dicts and one bucket of a fixed histogram (no locks, no prometheus_client
objects per call; everything runs on the one IOLoop thread). prometheus_client
turns them into metric families at scrape time, as a custom collector, and
writes the exposition. Gauges (workers by state, in flight, queued, memory,
jobs) are read from the supervisor at scrape time, never per request.

Where each figure comes from:
- requests, end-to-end latency: the frontend (fastpath.py and the handlers'
  log function in app.py), per API, model, version and status code;
- time inside the model, batch size: measured by the worker around each model
  call and carried in the first result frame of the batch (no extra frame);
- applies, phase durations, crashes, restarts: the supervisor's events;
- training jobs by state and duration: the job list, at scrape time;
- RSS and private memory (USS) per worker: psutil at scrape time (USS is
  cached a few seconds per worker: reading it walks the page maps).
"""
from __future__ import annotations

import bisect
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Sequence, TypeVar, cast

if TYPE_CHECKING:
    from state.config import Config
    from state.storage import Storage
    from control.events import Events
    from control.jobs import JobManager
    from control.pool import WorkerPool
    from control.workerhandle import LoadedModel
    from control.quality import Quality
    from control.serving import ServingState

from prometheus_client import CollectorRegistry, PlatformCollector, ProcessCollector
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                    HistogramMetricFamily, Metric)
from prometheus_client.exposition import choose_encoder

PREFIX = "textswap_"
_Key = TypeVar("_Key", bound=tuple[str, ...])  # a family's label values

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                   10.0, 30.0)
MODEL_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                 0.5, 1.0, 2.5)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
APPLY_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TRAIN_BUCKETS = (1.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0, 7200.0)
_FINISHED = ("succeeded", "failed", "cancelled", "interrupted")


class Hist:
    """A fixed-bucket histogram: one bisect and two adds per observation."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1  # "le" buckets
        self.sum += value

    def buckets(self) -> list[tuple[str, int]]:
        out, total = [], 0
        for bound, n in zip(self.bounds, self.counts):
            total += n
            out.append((repr(float(bound)), total))
        out.append(("+Inf", total + self.counts[-1]))
        return out


def _noop(*args: object, **kwargs: object) -> None:
    return None


@dataclass
class Sources:
    """What a scrape reads besides the counters (given at composition)."""
    serving: "ServingState"  # slots: requests queued per model
    pool: "WorkerPool"  # worker processes: state, memory, requests in flight
    storage: "Storage"  # durable writes' health
    jobs: "JobManager"  # training jobs by state
    quality: "Quality"  # live quality and drift per version


class Metrics:
    """The service's figures; `sources` are read at scrape time.

    Counting calls, for the frontend and the supervisor:
      observe_request(api, model, version, status, seconds)  one HTTP answer
      observe_batch(model_ref, texts, seconds)                one model call
      on_event(kind, fields)                                  supervisor events
    With `enabled` false they do nothing, and /metrics is not served.
    """

    def __init__(self, sources: Sources | None = None, events: "Events | None" = None,
                 enabled: bool = True) -> None:
        self.sources = sources
        self.enabled = enabled
        self.started = time.time()
        # (api, model, version) -> [answers by status code, end-to-end latency]
        self.requests: dict[tuple[str, str, object], list[Any]] = {}
        self.model_time: dict[tuple[str, str], Hist] = {}
        self.batch_size: dict[tuple[str, str], Hist] = {}
        self.crashes: dict[tuple[str, str], int] = defaultdict(int)
        self.restarts: dict[tuple[str, str], int] = defaultdict(int)
        self.applies: dict[tuple[str, str, str], int] = defaultdict(int)
        self.apply_phases: dict[str, Hist] = {}
        self.train_seconds: dict[str, Hist] = {}
        self._jobs_seen: set[str] = set()
        if not enabled:
            self.observe_request = self.observe_batch = self.on_event = _noop  # type: ignore[method-assign]  # disabled: hooks do nothing
            return
        self.registry = CollectorRegistry(auto_describe=False)
        ProcessCollector(registry=self.registry)  # the supervisor's own CPU, RSS, fds
        PlatformCollector(registry=self.registry)
        self.registry.register(self)  # a custom collector
        if events is not None:
            events.subscribe(self.on_event)
        if sources is not None:
            self.attach(sources)

    def attach(self, sources: Sources) -> None:
        """Read `sources` at each scrape, and count the workers' batches."""
        self.sources = sources
        if self.enabled:  # batch figures arrive in the workers' result frames
            from control.workerhandle import WorkerHandle

            WorkerHandle.on_batch = self.observe_batch

    # -- counting (hot path: keep it plain) ----------------------------------------------
    def observe_request(self, api: str, model: str, version: object, status: int,
                        seconds: float) -> None:
        # one dict lookup, one bisect: labels are turned into strings at scrape time
        rec = self.requests.get((api, model, version))
        if rec is None:
            rec = self.requests[(api, model, version)] = [{}, Hist(LATENCY_BUCKETS)]
        codes, h = rec
        codes[status] = codes.get(status, 0) + 1
        h.counts[bisect.bisect_left(h.bounds, seconds)] += 1
        h.sum += seconds

    def observe_batch(self, model: "LoadedModel | None", texts: int, seconds: float) -> None:
        key = (model["name"], str(model["version"])) if model else ("", "")
        h = self.model_time.get(key)
        if h is None:
            h = self.model_time[key] = Hist(MODEL_BUCKETS)
            self.batch_size[key] = Hist(BATCH_BUCKETS)
        h.observe(seconds)
        self.batch_size[key].observe(texts)

    def on_event(self, kind: str, fields: dict[str, object]) -> None:
        name = str(fields.get("name") or "")
        version = "" if fields.get("version") is None else str(fields["version"])
        if kind == "crash":
            self.crashes[(name, version)] += 1
        elif kind == "restart":
            self.restarts[(name, version)] += 1
        elif kind in ("apply", "apply_failed"):
            outcome = "ok" if kind == "apply" else "failed"
            self.applies[(name, str(fields.get("source") or ""), outcome)] += 1
            for phase, seconds in cast("dict[str, object]", fields.get("phases") or {}).items():
                if isinstance(seconds, (int, float)):
                    h = self.apply_phases.get(phase)
                    if h is None:
                        h = self.apply_phases[phase] = Hist(APPLY_BUCKETS)
                    h.observe(float(seconds))

    # -- scraping ---------------------------------------------------------------------------
    def exposition(self, accept: str | None = None) -> tuple[bytes, str]:
        """(body, Content-Type): the text format, or OpenMetrics when the scraper's
        Accept header asks for it (as Prometheus does)."""
        encoder, content_type = choose_encoder(accept or "")
        return encoder(self.registry), content_type

    def collect(self) -> Iterator[Metric]:
        """prometheus_client's collector protocol: every family, built now."""
        counts: dict[tuple[str, str, str, str], int] = defaultdict(int)
        latency: dict[tuple[str, str, str], Hist] = {}
        labels: tuple[str, ...]
        for (api, model, version), (codes, h) in list(self.requests.items()):
            key = (api, model, "" if version is None else str(version))
            for code, n in list(codes.items()):
                counts[(*key, str(code))] += n
            merged = latency.setdefault(key, Hist(LATENCY_BUCKETS))
            merged.counts = [a + b for a, b in zip(merged.counts, h.counts)]
            merged.sum += h.sum
        c = CounterMetricFamily(PREFIX + "requests", "HTTP answers on the inference API",
                                labels=["api", "model", "version", "code"])
        for labels, n in sorted(counts.items()):
            c.add_metric(labels, n)
        yield c
        yield _hist("request_duration_seconds", "end-to-end time of an inference request, "
                    "from its headers to its answer", ["api", "model", "version"], latency)
        yield _hist("model_seconds", "time inside the model per batch (measured in the worker)",
                    ["model", "version"], self.model_time)
        yield _hist("batch_size", "texts per model call (micro-batches)", ["model", "version"],
                    self.batch_size)
        for fam, doc, data in (("worker_crashes", "serving worker exits not asked for",
                                self.crashes),
                               ("worker_restarts", "crashed replicas replaced", self.restarts)):
            c = CounterMetricFamily(PREFIX + fam, doc, labels=["model", "version"])
            for labels, n in sorted(data.items()):
                c.add_metric(labels, n)
            yield c
        c = CounterMetricFamily(PREFIX + "applies", "applies by model, source and outcome",
                                labels=["model", "source", "outcome"])
        for labels, n in sorted(self.applies.items()):
            c.add_metric(labels, n)
        yield c
        yield _hist("apply_phase_seconds", "duration of each phase of a successful apply",
                    ["phase"], {(k,): h for k, h in self.apply_phases.items()})
        if self.sources is not None:
            yield from self._supervisor_gauges(self.sources)
            yield from self._quality_families(self.sources)

    def _supervisor_gauges(self, src: Sources) -> Iterator[Metric]:
        workers = list(src.pool.workers.values())
        by_state: dict[str, int] = defaultdict(int)
        inflight: dict[tuple[str, str], int] = defaultdict(int)
        labels: Sequence[str]
        rss = GaugeMetricFamily(PREFIX + "worker_rss_bytes", "resident memory per worker process",
                                labels=["worker", "state", "model", "version"])
        uss = GaugeMetricFamily(PREFIX + "worker_uss_bytes", "private memory (USS) per worker "
                                "process", labels=["worker", "state", "model", "version"])
        for w in workers:
            state = w.state.value
            by_state[state] += 1
            key = (w.model["name"], str(w.model["version"])) if w.model else ("", "")
            if w.inflight:
                inflight[key] += w.inflight
            labels = [str(w.generation), state, *key]
            value = w.rss()
            if value is not None:
                rss.add_metric(labels, value)
            value = w.uss() if hasattr(w, "uss") else None
            if value is not None:
                uss.add_metric(labels, value)
        g = GaugeMetricFamily(PREFIX + "workers", "worker processes by state", labels=["state"])
        for state, n in sorted(by_state.items()):
            g.add_metric([state], n)
        yield g
        yield rss
        yield uss
        g = GaugeMetricFamily(PREFIX + "requests_in_flight", "requests sent to a worker and "
                              "not yet answered", labels=["model", "version"])
        for labels, n in sorted(inflight.items()):
            g.add_metric(list(labels), n)
        yield g
        g = GaugeMetricFamily(PREFIX + "requests_queued", "requests waiting for room on a "
                              "worker (all replicas at max_inflight)", labels=["model"])
        for name, n in sorted((n, s.waiters) for n, s in src.serving.slots.items()):
            g.add_metric([name], n)
        yield g
        yield from self._storage_families(src)
        yield from self._job_families(src)

    def _storage_families(self, src: Sources) -> Iterator[Metric]:
        h = src.storage.health()
        g = GaugeMetricFamily(PREFIX + "storage_ok", "1 while the last durable write "
                              "(record, state db, golden sets) succeeded, 0 after a failure")
        g.add_metric([], 1 if h["ok"] else 0)
        yield g
        if h["free_bytes"] is not None:
            g = GaugeMetricFamily(PREFIX + "store_free_bytes", "free space of the model store's "
                                  "filesystem")
            g.add_metric([], h["free_bytes"])
            yield g
        c = CounterMetricFamily(PREFIX + "storage_write_failures", "durable writes that failed")
        c.add_metric([], h["failures"])
        yield c

    def _job_families(self, src: Sources) -> Iterator[Metric]:
        listing = src.jobs.list()
        states: dict[str, int] = defaultdict(int)
        for job in listing:
            states[job["state"]] += 1
            # a job finished while this process runs counts once in the histogram
            elapsed = job.get("elapsed_s")
            if (job["state"] in _FINISHED and elapsed is not None
                    and (job.get("finished_at") or 0) >= self.started
                    and job["id"] not in self._jobs_seen):
                self._jobs_seen.add(job["id"])
                h = self.train_seconds.get(job["state"])
                if h is None:
                    h = self.train_seconds[job["state"]] = Hist(TRAIN_BUCKETS)
                h.observe(float(elapsed))
        g = GaugeMetricFamily(PREFIX + "training_jobs", "training jobs known, by state",
                              labels=["state"])
        for state, n in sorted(states.items()):
            g.add_metric([state], n)
        yield g
        yield _hist("training_seconds", "run time of training jobs finished since start, "
                    "by final state", ["state"], {(k,): h for k, h in self.train_seconds.items()})

    def _quality_families(self, src: Sources) -> Iterator[Metric]:
        """Live quality and drift per version: control/quality.py's latest reports
        (refreshed every drift.refresh_s and by GET /models/<name>/quality)."""
        latest = dict(src.quality.latest)
        labels = ["model", "version"]
        fams: dict[str, CounterMetricFamily | GaugeMetricFamily] = {
            "feedback": CounterMetricFamily(PREFIX + "feedback", "true labels fed back on "
                                            "logged predictions", labels=labels),
            "predictions": GaugeMetricFamily(PREFIX + "predictions_logged", "predictions kept "
                                             "in the prediction log", labels=labels),
            "accuracy": GaugeMetricFamily(PREFIX + "live_accuracy", "accuracy on the fed-back "
                                          "predictions (multi-label: exact match of the "
                                          "label set)", labels=labels),
            "macro_f1": GaugeMetricFamily(PREFIX + "live_macro_f1", "macro-F1 on the fed-back "
                                          "predictions", labels=labels),
            "micro_f1": GaugeMetricFamily(PREFIX + "live_micro_f1", "micro-F1 on the fed-back "
                                          "predictions of a multi-label version",
                                          labels=labels),
            "unknown_ngram_share": GaugeMetricFamily(
                PREFIX + "drift_unknown_ngram_share", "share of the window's n-grams the "
                "training data does not hold", labels=labels),
            "unknown_ngram_excess": GaugeMetricFamily(
                PREFIX + "drift_unknown_ngram_excess", "unknown n-gram share above the "
                "training data's own (leave-one-out)", labels=labels),
            "label_js": GaugeMetricFamily(PREFIX + "drift_label_js", "Jensen-Shannon divergence "
                                          "of the predicted labels from the profile's",
                                          labels=labels),
            "top_score_js": GaugeMetricFamily(PREFIX + "drift_top_score_js", "Jensen-Shannon "
                                              "divergence of the top scores from the "
                                              "profile's", labels=labels),
            "texts": GaugeMetricFamily(PREFIX + "drift_window_texts", "texts in the drift "
                                       "window", labels=labels),
            "alert": GaugeMetricFamily(PREFIX + "drift_alert", "1 when a drift signal is above "
                                       "its threshold (drift.max_*)", labels=labels),
        }
        for name, report in sorted(latest.items()):
            for v in report.get("versions", []):
                key = [name, str(v["version"])]
                fams["feedback"].add_metric(key, v["feedback"])
                fams["predictions"].add_metric(key, v["predictions"])
                for field in ("accuracy", "macro_f1", "micro_f1"):
                    if v["live"].get(field) is not None:
                        fams[field].add_metric(key, v["live"][field])
                drift = v.get("drift")
                if drift:
                    for field in ("unknown_ngram_share", "unknown_ngram_excess", "label_js",
                                  "top_score_js", "texts"):
                        if drift.get(field) is not None:
                            fams[field].add_metric(key, drift[field])
                    fams["alert"].add_metric(key, 1 if drift["alert"] else 0)
        yield from fams.values()


def _hist(name: str, doc: str, labels: list[str], data: dict[_Key, Hist]
          ) -> HistogramMetricFamily:
    fam = HistogramMetricFamily(PREFIX + name, doc, labels=labels)
    for key, h in sorted(data.items()):
        fam.add_metric(list(key), h.buckets(), h.sum)
    return fam


def build(config: "Config", events: "Events | None" = None) -> Metrics:
    """The service's Metrics from its config (`metrics.enabled`); its
    sources are set once the parts they are made of exist."""
    return Metrics(None, events, enabled=bool(config.metrics.enabled))

