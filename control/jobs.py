"""Training jobs: a queue, at most training.max_concurrent trainer processes.

The Supervisor owns the JobManager; both live on the IOLoop. A job's data is
checked in the supervisor (dataset.py, in a thread so the loop keeps
serving), written to the job's folder as normalised JSONL, and the trainer
process (model_worker/trainer.py) is spawned to train and publish. Job
folders live under <models_dir>/.tmp/jobs/ and are wiped at start.

Jobs outlive the process: every job and each of its epochs is written to the
state database (statedb.py; the writes go to its background thread, so the
IOLoop never waits on disk). The in-memory list is the cache the API reads.
On construction, before the store wipes .tmp/, the manager reloads the jobs
kept (training.keep_jobs finished ones) and marks each one the previous
process left queued or running as `interrupted`, with the tail of its log;
its folder is removed. A clean shutdown interrupts running jobs the same way.
"""
from __future__ import annotations

import collections
import itertools
import logging
import os
import re
import shutil
import time
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Literal, Protocol, Required, TypedDict, cast

from tornado.ioloop import IOLoop

from state import dataset
from state.statedb import StateDB
from model_worker.params import ParamError, detect_tokenize, multi_label_refusal, validate_params
from state.errors import InvalidName
from state.store import DATA, TMP, check_name
from control.childlog import is_tensorflow_line
from control.workerhandle import ChildProcess, Frame

if TYPE_CHECKING:
    from control.slots import ApplyResult
    from state.config import Config
    from state.predlog_api import PredictionLogBackend
    from state.store import ModelStore
    from control.policies import Policies
    from control.pool import WorkerPool
    from control.serving import ServingState
    from control.zygote_client import Zygote
    from tornado.concurrent import Future

log = logging.getLogger("textswap.jobs")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root
BUNDLED = os.path.join(ROOT, "data", "demo")  # the first-start demo's data (supervisor.py)
STATES = ("queued", "running", "succeeded", "failed", "cancelled", "interrupted")
FINISHED = ("succeeded", "failed", "cancelled", "interrupted")
ACTIVE = ("queued", "running")
# the ids this service makes (Job, cluster/job_queue.py new_id): a time, a counter
JOB_ID = re.compile(r"[0-9]{14}-[1-9][0-9]{0,17}")


# a progress frame's figures (an epoch's, or a model-search candidate's): one
# history entry each, kept as the trainer sent them
Figures = dict[str, object]


class JobResult(TypedDict, total=False):
    """The version a succeeded job published."""
    name: Required[str]
    version: Required[int]
    warnings: list[str]


class JobDoc(TypedDict, total=False):
    """A job as GET /train/<id> shows it (Job.describe); the list leaves out
    `history` and `params`; in cluster mode `node` says which node runs it."""
    id: str
    name: str
    state: str
    apply: bool
    params: dict[str, object]
    data: dict[str, object]
    progress: Figures
    history: list[Figures]
    created_at: float
    started_at: float | None
    finished_at: float | None
    elapsed_s: float | None
    result: JobResult | None
    metrics: dict[str, object] | None
    error: str | None
    exitcode: int | None
    log_tail: str | None
    applied: "ApplyResult | dict[str, object] | None"
    pid: int | None
    node: str | None


class JobRow(TypedDict):
    """A job's row in the state db (Job.record)."""
    id: str
    name: str
    state: str
    apply: bool
    params: dict[str, object]
    data: dict[str, object]
    created_at: float
    started_at: float | None
    finished_at: float | None
    progress: Figures
    result_version: int | None
    metrics: dict[str, object] | None
    error: str | None
    exitcode: int | None
    log_tail: str | None
    applied: "ApplyResult | dict[str, object] | None"


def listed(doc: JobDoc) -> JobDoc:
    """A job as the list shows it: without its history and params."""
    out = doc.copy()
    out.pop("history", None)
    out.pop("params", None)
    return out


_TRAIN_AGAIN = ("train {name} once with 'data' (POST /train {{\"name\": \"{name}\", "
                "\"data\": {{\"path\": ...}}}}): later retrains reuse that data")


def _under(path: str, roots: list[str]) -> bool:
    """Whether a real path lies inside one of the roots (as their real paths)."""
    for root in roots:
        r = os.path.realpath(root)
        if path != r and path.startswith(r.rstrip(os.sep) + os.sep):
            return True
    return False


class JobError(Exception):
    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code = status, code


class TrainerProcess(ChildProcess):
    def __init__(self, job: "Job", spec: dict[str, object],
                 on_exit: Callable[["TrainerProcess"], None], zygote: "Zygote | None" = None) -> None:
        from model_worker.trainer import main as target

        self.job = job
        super().__init__(target, spec, "trainer", on_exit, zygote)

    def on_frame(self, msg: Frame) -> None:
        self.job.on_frame(msg)


class Job:
    _ids = itertools.count(1)

    def __init__(self, name: str, params: dict[str, object], data_summary: dict[str, object],
                 apply: bool, job_id: str | None = None) -> None:
        self.id = job_id or f"{time.strftime('%Y%m%d%H%M%S')}-{next(self._ids)}"
        self.name = name
        self.params = params
        self.data_summary = data_summary
        self.apply = apply
        self.state = "queued"
        self.created = time.time()
        self.started: float | None = None
        self.finished: float | None = None
        self.progress: Figures = {}
        self.history: list[Figures] = []
        self.result: JobResult | None = None
        self.metrics: dict[str, object] | None = None
        self.error: str | None = None
        self.exitcode: int | None = None
        self.log_tail: str | None = None
        self.applied: "ApplyResult | dict[str, object] | None" = None  # or {"error"}
        self.process: TrainerProcess | None = None
        self._done: "Future[Job] | None" = None  # resolved when the job finishes (done_future)
        self.dir = ""
        # (job, figures or None) -> None: persists the job
        self.on_change: Callable[[Job, Figures | None], None] | None = None

    def done_future(self) -> "Future[Job]":
        """A Future resolved (with the job) once it has finished."""
        from tornado.concurrent import Future
        if self._done is None:
            self._done = Future()
            if self.state in FINISHED:
                self._done.set_result(self)
        return self._done

    def on_frame(self, msg: Frame) -> None:
        kind = msg.get("t")
        figures = None
        if kind == "progress":
            info = {k: v for k, v in msg.items() if k != "t"}
            self.progress.update(info)
            # an epoch's figures, or a model-search candidate's: one history entry each
            if "loss" in info or "candidate" in info:
                figures = info
                self.history.append(info)
                log.info("job %s (%s): %s", self.id, self.name, _progress_line(info))
        elif kind == "done":
            self.result = {"name": self.name, "version": msg["version"]}
            if msg.get("warnings"):  # e.g. labels with a single example (never tested)
                self.result["warnings"] = list(msg["warnings"])
            self.metrics = msg.get("metrics")
        elif kind == "failed":
            self.error = msg.get("message")
        if self.on_change is not None:
            self.on_change(self, figures)

    def describe(self) -> JobDoc:
        now = time.time()
        return {
            "id": self.id, "name": self.name, "state": self.state, "apply": self.apply,
            "params": self.params, "data": self.data_summary,
            "progress": self.progress, "history": self.history,
            "created_at": self.created, "started_at": self.started,
            "finished_at": self.finished,
            "elapsed_s": None if self.started is None else round(
                (self.finished or now) - self.started, 3),
            "result": self.result, "metrics": self.metrics, "error": self.error,
            "exitcode": self.exitcode, "log_tail": self.log_tail, "applied": self.applied,
            "pid": self.process.pid if self.process else None,
        }

    # -- the state db's row ------------------------------------------------------------
    def record(self) -> JobRow:
        return {"id": self.id, "name": self.name, "state": self.state, "apply": self.apply,
                "params": self.params, "data": self.data_summary, "created_at": self.created,
                "started_at": self.started, "finished_at": self.finished,
                "progress": self.progress,
                "result_version": self.result["version"] if self.result else None,
                "metrics": self.metrics, "error": self.error, "exitcode": self.exitcode,
                "log_tail": self.log_tail, "applied": self.applied}

    @classmethod
    def from_record(cls, row: dict[str, Any], history: list[dict[str, Any]]) -> "Job":
        job = cls(row["name"], row["params"] or {}, row["data"] or {}, row["apply"],
                  job_id=row["id"])
        job.state = row["state"]
        job.created, job.started, job.finished = (row["created_at"], row["started_at"],
                                                  row["finished_at"])
        job.progress = row["progress"] or {}
        job.history = history
        if row["result_version"] is not None:
            job.result = {"name": row["name"], "version": row["result_version"]}
        job.metrics, job.error, job.exitcode = row["metrics"], row["error"], row["exitcode"]
        job.log_tail, job.applied = row["log_tail"], row["applied"]
        return job


def _progress_line(info: Figures) -> str:
    if "candidate" in info:
        # a search frame: {candidate, of, name, score, best, best_score}
        where = f"candidate {info.get('candidate')}/{info.get('of', info.get('candidates'))}"
        score, best = info.get("score"), info.get("best_score")
        return (f"{where} {info.get('name')} score {score:.4f}" if isinstance(score, float) else
                f"{where} {info.get('name')}") + \
            (f" best {info.get('best')} {best:.4f}" if isinstance(best, float) else "")
    else:
        where = f"epoch {info.get('epoch')}/{info.get('epochs')}"
    loss = info.get("loss")
    return (f"{where} loss {loss:.4f}" if isinstance(loss, float) else where) + \
        f" val_accuracy {info.get('val_accuracy')}"


class JobQueue(Protocol):
    """Where submitted jobs queue and how every job is read (chosen at start):
    this service's own (`LocalJobs`), or the cluster's in Redis
    (cluster/node.py ClusterTraining), where any node with room runs a job."""
    shared_store: bool  # other services' job data and staging live in this store too

    async def new_id(self) -> str | None:
        """A job id unique where jobs are queued (None: the manager makes one)."""

    async def enqueue(self, job: "Job") -> bool:
        """True: queued elsewhere (not run by this manager's own schedule)."""

    def changed(self, job: "Job") -> None:
        """A job this service runs changed."""

    async def list(self) -> list[JobDoc]: ...

    async def get(self, job_id: str) -> JobDoc | None: ...

    async def cancel(self, job_id: str) -> tuple[str, JobDoc | None]:
        """("cancelled", job) / ("done:<state>", job) / ("missing", None)."""

    def attach(self, manager: "JobManager") -> None:
        """The manager that runs this service's jobs (it attaches itself)."""


class LocalJobs:
    """The queue of a single service: its JobManager's own jobs."""

    shared_store = False

    def __init__(self) -> None:
        self.manager: "JobManager"  # the manager it serves (attach)

    def attach(self, manager: "JobManager") -> None:
        self.manager = manager

    async def new_id(self) -> str | None:
        return None

    async def enqueue(self, job: "Job") -> bool:
        return False

    def changed(self, job: "Job") -> None:
        return None

    async def list(self) -> list[JobDoc]:
        return self.manager.list()

    async def get(self, job_id: str) -> JobDoc | None:
        job = self.manager.jobs.get(job_id)
        return None if job is None else job.describe()

    async def cancel(self, job_id: str) -> tuple[str, JobDoc | None]:
        job = self.manager.jobs.get(job_id)
        if job is None:
            return "missing", None
        if job.state not in ("queued", "running"):
            return f"done:{job.state}", job.describe()
        await self.manager.cancel(job_id)
        return "cancelled", job.describe()


class JobManager:
    def __init__(self, cfg: "Config", store: "ModelStore", serving: "ServingState",
                 db: StateDB, pool: "WorkerPool", policies: "Policies",
                 predlog: "PredictionLogBackend",
                 apply: Callable[..., Awaitable["ApplyResult"]],
                 queue: JobQueue | None = None) -> None:
        """db: the state db shared with the rollout history; apply: the applies'
        apply (a job that asks for it applies its version); queue: LocalJobs
        unless given."""
        self.cfg = cfg.training
        self.log_level = cfg.log_level
        self.store, self.serving, self.pool = store, serving, pool
        self.policies, self.predlog, self.apply = policies, predlog, apply
        self.jobs: "collections.OrderedDict[str, Job]" = collections.OrderedDict()
        self.loop = IOLoop.current()
        self.root = os.path.join(store.root, TMP, "jobs")
        self.db = db
        if queue is None:
            queue = LocalJobs()
        queue.attach(self)
        self.queue: JobQueue = queue
        self.shared_store = queue.shared_store  # nothing shared is wiped here
        self._recover()

    @property
    def data_roots(self) -> list[str]:
        """Where /train may read files: the store's data/ folder (a relative
        path is read from there) and training.data_roots; never the working
        directory (it holds the service's own files)."""
        return [os.path.join(self.store.root, DATA), *self.cfg.data_roots]

    @property
    def reuse_roots(self) -> list[str]:
        """Where a retrain without data may re-read its last training's file:
        the data roots configured now, the copies of inline data (.loop/) and
        the bundled demo's folder; never the working directory or /."""
        loop_dir = [self.policies.dir] if self.policies is not None else []
        return [*self.data_roots, *loop_dir, BUNDLED]

    def reusable(self, name: str, spec: dict[str, Any]) -> dict[str, Any]:
        """The recorded data of `name`'s last training, if its file is still
        there under a root it may be read from; else JobError 409 data_gone
        (blocking: from an executor)."""
        path = spec.get("path") if isinstance(spec, dict) else None
        if not isinstance(path, str) or not path:
            raise JobError(409, "data_gone", f"the last training of {name!r} recorded no "
                                             f"data file; {_TRAIN_AGAIN.format(name=name)}")
        roots = self.reuse_roots
        real = os.path.realpath(path)
        if "root" not in spec and not _under(real, roots):
            # recorded before the data root was kept: a relative path was
            # resolved against the working directory; read it from models/data/
            rel = os.path.relpath(real, os.getcwd())
            if not rel.startswith(os.pardir):
                real = os.path.realpath(os.path.join(self.data_roots[0], rel))
        if not _under(real, roots):
            raise JobError(409, "data_gone", f"the data of {name!r}'s last training ({path}) "
                                             f"is no longer under a data root "
                                             f"({', '.join(self.data_roots)}; see "
                                             f"training.data_roots); "
                                             f"{_TRAIN_AGAIN.format(name=name)}")
        if not os.path.isfile(real):
            raise JobError(409, "data_gone", f"the data of {name!r}'s last training ({real}) "
                                             f"is gone; put the file back, or "
                                             f"{_TRAIN_AGAIN.format(name=name)}")
        return {**{k: v for k, v in spec.items() if k != "root"}, "path": real}

    # -- persistence -------------------------------------------------------------------
    def _recover(self) -> None:
        """Reload kept jobs; the ones a dead process left queued or running are
        `interrupted`. Runs before the store wipes .tmp/, to read their logs."""
        rows = self.db.jobs()
        epochs = self.db.all_epochs()
        now = time.time()
        seq = 0
        for row in rows:
            job = Job.from_record(row, epochs.get(row["id"], []))
            if job.state in ACTIVE:
                was = job.state
                job.log_tail = self._tail(os.path.join(self.root, job.id, "train.log")) \
                    or job.log_tail
                self._mark_interrupted(job, f"the service stopped while the job was {was}",
                                       now)
                log.warning("job %s (%s) was %s when the service stopped: interrupted",
                            job.id, job.name, was)
            self.jobs[job.id] = job
            tail = job.id.rpartition("-")[2]
            seq = max(seq, int(tail) if tail.isdigit() else 0)
        # ids stay unique across restarts within the same second
        Job._ids = itertools.count(seq + 1)
        if not self.shared_store:
            shutil.rmtree(self.root, ignore_errors=True)  # interrupted jobs' data and logs
            self.store.clean_staging()  # and what their trainers were publishing
        self._trim()

    def _mark_interrupted(self, job: Job, reason: str, when: float | None = None) -> None:
        job.state = "interrupted"
        job.error = job.error or reason
        job.finished = job.finished or when or time.time()
        job.process = None
        self._save(job)

    def _save(self, job: Job, figures: Figures | None = None) -> None:
        """Hand the job's row (and a new history entry) to the db's writer thread."""
        try:
            if figures is not None:
                self.db.add_epoch(job.id, len(job.history) - 1, figures)
            self.db.save_job(job.record())
        except Exception as exc:  # the db is closed or broken: serve on, say so
            log.error("job %s: cannot persist: %s", job.id, exc)
        self.queue.changed(job)  # cluster: every node's GET /train/<id> reads it there

    # -- API -----------------------------------------------------------------------
    async def _check_space(self, name: str) -> None:
        """The low-space guard: a job starts only with twice the size of the
        model's newest version free in the store (it stages, then publishes)."""
        need = 2 * await self.loop.run_in_executor(None, self.store.version_bytes, name)
        try:
            free = shutil.disk_usage(self.store.root).free
        except OSError:
            return
        if need and free < need:
            raise JobError(507, "insufficient_storage",
                           f"the model store ({self.store.root}) has {free} bytes free; "
                           f"training {name} needs about {need} (twice its newest version)")

    async def submit(self, name: str, data_spec: object, params: object, apply: bool,
                     trusted_path: bool = False,
                     feedback: "Literal[True] | list[tuple[str, str]] | None" = None,
                     watermark: float | None = None, descriptions: object = None) -> Job:
        """feedback: True (the model's fed-back labels) or (text, label) pairs to fold
        into the data; data_spec None: the data of the model's last training.
        descriptions: {label: description} (the request's "labels"); without data
        a zero-shot version (model_worker/zeroshot.py), with data one more example
        per label. trusted_path: the bundled demo (its folder is read too).
        Without data, JobError 409 data_gone when the last training's file is
        gone (reusable)."""
        try:
            check_name(name)
        except Exception as exc:
            raise JobError(400, "invalid_name", str(exc)) from None
        if name == DATA:  # its versions would land among the user's data files
            raise JobError(400, "invalid_name", f"the name {DATA!r} is the store's data folder "
                                                "(where training files go): choose another name")
        if descriptions is not None:
            try:
                descriptions = dataset.check_descriptions(descriptions)
            except dataset.DataError as exc:
                raise JobError(400, "invalid_labels", str(exc)) from None
        arch = params.get("architecture") if isinstance(params, dict) else None
        if arch == "zero_shot" and (descriptions is None or data_spec is not None):
            raise JobError(400, "invalid_params", "params.architecture: 'zero_shot' trains from "
                                                  "'labels' descriptions without 'data'")
        if descriptions is not None and data_spec is None:
            return await self._submit_zero_shot(name, descriptions, params, apply, feedback)
        policies = self.policies
        given_spec = data_spec
        roots = [*self.data_roots, BUNDLED] if trusted_path else self.data_roots
        if data_spec is None:  # the data (and parameters) of the last training
            last = (await self.loop.run_in_executor(None, policies.last_training, name)
                    if policies is not None else (None, None))
            if last[0] is None:
                raise JobError(400, "missing_field", f"'data' is required: no earlier "
                                                     f"training of {name!r} to reuse")
            roots = self.reuse_roots
            data_spec = await self.loop.run_in_executor(None, self.reusable, name, last[0])
            params = last[1] if params is None else params
        if not isinstance(apply, bool):
            raise JobError(400, "invalid_field", "'apply' must be true or false")
        if params is not None and not isinstance(params, dict):
            raise JobError(400, "invalid_params", "'params' must be an object")
        try:
            full = validate_params(params or {})
        except ParamError as exc:
            raise JobError(400, "invalid_params", f"params.{exc.field}: {exc.message}") from None
        if not self.cfg.pretrained:
            # training.pretrained: false: for a service that cannot take the
            # Llama 2 licence of the pretrained vectors, no job may use them
            if params and params.get("pretrained") is True:
                raise JobError(400, "invalid_params", "params.pretrained: the pretrained view "
                                                      "is off on this service "
                                                      "(training.pretrained: false)")
            full["pretrained"] = False
        try:  # reading a big file must not stall serving: off the loop
            data = await self.loop.run_in_executor(None, dataset.load, data_spec, roots,
                                                   feedback is not None)
        except dataset.DataError as exc:
            raise JobError(400, "invalid_data", str(exc)) from None
        if descriptions is not None:  # one more example per label; remembered as data
            data = dataset.add_descriptions(data, descriptions)
            data_spec = {"examples": "copied", "descriptions": True}
        if data.multi_label and full["architecture"] != "auto":  # docs/models.md "Multi-label"
            raise JobError(400, "invalid_params", multi_label_refusal(full["architecture"]))
        base = data
        examples: list[tuple[str, str]] | None
        if feedback is True:
            examples = await self.loop.run_in_executor(None, self.predlog.feedback_examples,
                                                       name)
            watermark = time.time() if watermark is None else watermark
        else:
            examples = feedback
        folded = None
        if examples is not None:
            try:
                data, folded = dataset.merge_feedback(data, list(examples))
            except dataset.DataError as exc:
                raise JobError(400, "invalid_data", str(exc)) from None
        spec = cast("dict[str, object]", data_spec)  # dataset.load refused anything else
        return await self._queue(name, data, base, spec, given_spec, params, full, apply,
                                 folded, watermark, descriptions)

    async def _submit_zero_shot(self, name: str, descriptions: dict[str, str], params: object,
                                apply: bool, feedback: object) -> Job:
        """POST /train with "labels" descriptions and no data: a zero-shot version.
        The job's data is the descriptions, one row per label; what a retrain
        without data reuses too (the policy's: feedback plus one example per label)."""
        if feedback is not None:
            raise JobError(400, "invalid_field", "'feedback' needs 'data': a zero-shot training "
                                                 "has no data to fold feedback into")
        if not isinstance(apply, bool):
            raise JobError(400, "invalid_field", "'apply' must be true or false")
        if params is not None and not isinstance(params, dict):
            raise JobError(400, "invalid_params", "'params' must be an object")
        try:
            full = validate_params({**(params or {}), "architecture": "zero_shot"})
        except ParamError as exc:
            raise JobError(400, "invalid_params", f"params.{exc.field}: {exc.message}") from None
        if not self.cfg.pretrained or not full["pretrained"]:
            raise JobError(422, "zero_shot_unavailable",
                           "a zero-shot version embeds the descriptions with the pretrained "
                           "view, which is off " + ("on this service (training.pretrained: "
                                                    "false)" if not self.cfg.pretrained
                                                    else "(params.pretrained: false)")
                           + "; give 'data' with labelled examples")
        if detect_tokenize(list(descriptions.values())) == "char":
            raise JobError(422, "zero_shot_unavailable",
                           "the descriptions are CJK text: the pretrained view (LLaMA-2's "
                           "vocabulary) splits it into bytes and cannot compare it; give "
                           "'data' with labelled examples")
        data = dataset.from_descriptions(descriptions)
        # a retrain without data reuses the descriptions as data, with auto's params
        later = {k: v for k, v in (params or {}).items() if k != "architecture"} or None
        return await self._queue(name, data, data, {"examples": "copied", "descriptions": True},
                                 {}, later, full, apply, None, None, descriptions)

    async def _queue(self, name: str, data: dataset.Dataset, base: dataset.Dataset,
                     data_spec: dict[str, object], given_spec: object,
                     params: dict[str, object] | None, full: dict[str, object], apply: bool,
                     folded: dict[str, object] | None, watermark: float | None,
                     descriptions: dict[str, str] | None) -> Job:
        """Remember the training's data, write it into the job's folder, queue it."""
        policies = self.policies
        summary = await self.loop.run_in_executor(None, data.summary)  # hashes every text
        if folded is not None:
            summary["feedback"] = folded
        if given_spec is None:
            summary["reused"] = data_spec.get("path")
        if descriptions is not None:
            summary["descriptions"] = descriptions
            if full["architecture"] == "zero_shot":
                summary.pop("warnings", None)  # one row per label is what zero-shot takes
                summary.pop("single_example_labels", None)
                summary["zero_shot"] = True
        if policies is not None:
            try:
                await self.loop.run_in_executor(None, policies.remember_training, name,
                                                data_spec, base, params, watermark,
                                                [*self.reuse_roots])
            except OSError as exc:
                log.error("cannot remember the data of %s's training: %s", name, exc)
        # cluster mode: an id unique across nodes (JobError 503 when Redis is down)
        job_id = await self.queue.new_id()
        await self._check_space(name)
        job = Job(name, full, summary, apply, job_id=job_id)
        job.dir = self.job_dir(job.id)
        try:
            os.makedirs(job.dir, exist_ok=True)
            await self.loop.run_in_executor(None, data.write_jsonl,
                                            os.path.join(job.dir, "data.jsonl"))
        except OSError as exc:
            shutil.rmtree(job.dir, ignore_errors=True)
            raise JobError(507, "insufficient_storage",
                           f"cannot write the job's data into the model store: {exc}") from None
        if await self.queue.enqueue(job):  # queued in Redis: a node with room runs it
            log.info("job %s queued in the cluster: train %s", job.id, name)
            return job
        job.on_change = self._save
        self.jobs[job.id] = job
        self._save(job)
        self._trim()
        log.info("job %s queued: train %s on %d examples %s", job.id, name,
                 len(data.texts), summary["label_counts"])
        self._schedule()
        return job

    def job_dir(self, job_id: object) -> str:
        """The job's folder under the jobs root; JobError for an id that is not
        one this service makes, or a path that would leave the root (a job id
        read from Redis is untrusted: its folder is deleted when it ends)."""
        if not isinstance(job_id, str) or not JOB_ID.fullmatch(job_id):
            raise JobError(400, "invalid_job", f"not a job id: {str(job_id)[:80]!r}")
        root = os.path.realpath(self.root)
        path = os.path.realpath(os.path.join(root, job_id))
        if path == root or os.path.commonpath([root, path]) != root:
            raise JobError(400, "invalid_job", f"job id {job_id!r} leaves the jobs folder")
        return path

    def check_claimed(self, doc: object) -> JobDoc:
        """A job document read from the Redis queue, checked as if it came
        over HTTP: id, name, params (checked again, replicas capped), data
        summary, apply. JobError(400) names the first bad field."""
        if not isinstance(doc, dict):
            raise JobError(400, "invalid_job", "a job document must be an object")
        self.job_dir(doc.get("id"))
        try:
            check_name(doc.get("name"))
            params = validate_params(doc.get("params"))
            if not self.cfg.pretrained:  # this node's own licence switch
                params["pretrained"] = False
        except (InvalidName, ParamError) as exc:
            raise JobError(400, "invalid_job", f"job {doc['id']}: {exc}") from None
        if not isinstance(doc.get("data"), dict):
            raise JobError(400, "invalid_job", f"job {doc['id']}: data must be an object")
        if not isinstance(doc.get("apply"), bool):
            raise JobError(400, "invalid_job", f"job {doc['id']}: apply must be true or false")
        created = doc.get("created_at")
        if created is not None and not isinstance(created, (int, float)):
            raise JobError(400, "invalid_job", f"job {doc['id']}: created_at must be a number")
        return cast(JobDoc, {**doc, "params": params})

    def run_claimed(self, doc: object) -> Job:
        """Cluster mode: run a job this node claimed from the Redis queue
        (JobError, and nothing started or deleted, for a document that does
        not pass check_claimed)."""
        checked = self.check_claimed(doc)
        job = Job(checked["name"], checked["params"], checked["data"], checked["apply"],
                  job_id=checked["id"])
        job.created = checked.get("created_at") or job.created
        job.dir = self.job_dir(job.id)
        job.on_change = self._save
        self.jobs[job.id] = job
        self._start(job)
        return job

    def get(self, job_id: str) -> Job:
        job = self.jobs.get(job_id)
        if job is None:
            raise JobError(404, "not_found", f"no job with id {job_id!r}")
        return job

    def list(self) -> list[JobDoc]:
        return [listed(j.describe()) for j in reversed(self.jobs.values())]

    async def cancel(self, job_id: str) -> Job:
        """Cancel a queued or running job; it stays readable as `cancelled`."""
        job = self.get(job_id)
        if job.state == "queued":
            self._finish(job, "cancelled")
        elif job.state == "running":
            job.state = "cancelled"  # the exit callback keeps it so
            self._save(job)
            if job.process is not None:
                await job.process.stop(2.0)
        else:
            raise JobError(409, "conflict", f"job {job_id} is already {job.state}")
        return job

    async def shutdown(self) -> None:
        """Stop every trainer; their jobs are `interrupted` (not the user's cancel)."""
        for job in list(self.jobs.values()):
            if job.state == "queued":
                job.error = "the service stopped before the job started"
                self._finish(job, "interrupted")
            elif job.state == "running":
                job.state = "interrupted"  # the exit callback keeps it so
                job.error = "the service stopped while the job was running"
                if job.process is not None:
                    await job.process.stop(2.0)

    # -- running -------------------------------------------------------------------
    def _trim(self) -> None:
        """Keep training.keep_jobs finished jobs, in memory and in the db."""
        done = [j for j in self.jobs.values() if j.state in FINISHED]
        drop = done[:max(0, len(done) - self.cfg.keep_jobs)]
        for j in drop:
            del self.jobs[j.id]
        if drop:
            try:
                self.db.delete_jobs([j.id for j in drop])
            except Exception as exc:
                log.error("cannot trim old jobs from the state db: %s", exc)

    def _schedule(self) -> None:
        running = sum(1 for j in self.jobs.values() if j.state == "running")
        for job in self.jobs.values():
            if running >= self.cfg.max_concurrent or self.serving.stopping:
                return
            if job.state == "queued":
                self._start(job)
                running += 1

    def _start(self, job: Job) -> None:
        job.state = "running"
        job.started = time.time()
        spec = {"job_id": job.id, "name": job.name, "params": job.params,
                "data_file": os.path.join(job.dir, "data.jsonl"),
                "log_file": os.path.join(job.dir, "train.log"),
                "data_summary": job.data_summary, "models_dir": self.store.root,
                "nice": self.cfg.nice,
                "idle_priority": self.cfg.idle_priority, "threads": self.cfg.threads, "root": ROOT,
                "parent_pid": os.getpid(),
                "log_level": self.log_level}
        # forked from the workers' zygote like them: the trainer sets its own
        # nice, SCHED_IDLE and thread caps after the fork, as a spawned one did
        job.process = TrainerProcess(job, spec, self._on_exit, self.pool.zygote)
        self._save(job)

    def _on_exit(self, proc: TrainerProcess) -> None:
        job = proc.job
        job.exitcode = proc.exitcode
        if job.state in ("cancelled", "interrupted"):
            self._finish(job, job.state)
        elif job.result is not None and proc.exitcode == 0:
            self._finish(job, "succeeded")
            log.info("job %s succeeded: %s v%s, accuracy %s", job.id, job.name,
                     job.result["version"], (job.metrics or {}).get("accuracy"))
            if job.apply and not self.serving.stopping:
                self.loop.spawn_callback(self._apply, job)
            else:
                self.pool.refresh()
        else:
            job.error = job.error or f"trainer process exited with code {proc.exitcode}"
            self._finish(job, "failed")
            log.error("job %s failed: %s", job.id, job.error)
        self._schedule()

    def _finish(self, job: Job, state: str) -> None:
        job.state = state
        job.finished = time.time()
        if state != "succeeded":
            job.log_tail = self._tail(os.path.join(job.dir, "train.log"))
        shutil.rmtree(job.dir, ignore_errors=True)
        self._save(job)
        if job._done is not None and not job._done.done():
            job._done.set_result(job)
        self._trim()
        # a cancelled or crashed trainer may leave a staging folder behind
        if not self._any_running() and not self.shared_store:
            self.store.clean_staging()

    def _any_running(self) -> bool:
        return any(j.state == "running" for j in self.jobs.values())

    @staticmethod
    def _tail(path: str, n: int = 4000) -> str | None:
        try:
            with open(path, "rb") as fh:
                fh.seek(0, os.SEEK_END)
                fh.seek(max(0, fh.tell() - 4 * n))
                text = fh.read().decode("utf-8", "replace")
        except OSError:
            return None
        # TensorFlow's C++ notices (control/childlog.py) say nothing about the job
        lines = [ln for ln in text.split("\n") if not is_tensorflow_line(ln)]
        return "\n".join(lines)[-n:]

    async def _apply(self, job: Job) -> None:
        assert job.result is not None
        try:
            job.applied = await self.apply(job.name, job.result["version"], source="train")
        except Exception as exc:
            job.applied = {"error": str(exc)}
            log.error("job %s: apply of %s v%s failed: %s", job.id, job.name,
                      job.result["version"], exc)
        self._save(job)
