"""Training jobs: a queue, at most training.max_concurrent trainer processes.

The Supervisor owns the JobManager; both live on the IOLoop. A job's data is
checked in the supervisor (dataset.py, in a thread so the loop keeps
serving), written to the job's folder as normalised JSONL, and the trainer
process (model_worker/trainer.py) is spawned to train and publish. Job
folders live under <models_dir>/.tmp/jobs/ and are wiped at start; the job
list is in memory (a restart forgets finished jobs, never published models).
"""
from __future__ import annotations

import collections
import itertools
import logging
import os
import shutil
import time
from typing import Any

from tornado.ioloop import IOLoop

import dataset
from model_worker.params import ParamError, validate_params
from store import TMP, check_name
from workerhandle import ChildProcess

log = logging.getLogger("textswap.jobs")

ROOT = os.path.dirname(os.path.abspath(__file__))
STATES = ("queued", "running", "succeeded", "failed", "cancelled")
KEEP_FINISHED = 200


class JobError(Exception):
    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code = status, code


class TrainerProcess(ChildProcess):
    def __init__(self, job: "Job", spec: dict[str, Any], on_exit: Any) -> None:
        from model_worker.trainer import main as target

        self.job = job
        super().__init__(target, spec, "trainer", on_exit)

    def on_frame(self, msg: dict[str, Any]) -> None:
        self.job.on_frame(msg)


class Job:
    _ids = itertools.count(1)

    def __init__(self, name: str, params: dict[str, Any], data: dataset.Dataset,
                 apply: bool) -> None:
        self.id = f"{time.strftime('%Y%m%d%H%M%S')}-{next(self._ids)}"
        self.name = name
        self.params = params
        self.data_summary = data.summary()
        self.apply = apply
        self.state = "queued"
        self.created = time.time()
        self.started: float | None = None
        self.finished: float | None = None
        self.progress: dict[str, Any] = {}
        self.history: list[dict[str, Any]] = []
        self.result: dict[str, Any] | None = None
        self.metrics: dict[str, Any] | None = None
        self.error: str | None = None
        self.exitcode: int | None = None
        self.log_tail: str | None = None
        self.applied: dict[str, Any] | None = None
        self.process: TrainerProcess | None = None
        self.dir = ""

    def on_frame(self, msg: dict[str, Any]) -> None:
        kind = msg.get("t")
        if kind == "progress":
            info = {k: v for k, v in msg.items() if k != "t"}
            self.progress.update(info)
            if "loss" in info:
                self.history.append(info)
                log.info("job %s (%s): epoch %s/%s loss %.4f val_accuracy %s", self.id,
                         self.name, info.get("epoch"), info.get("epochs"), info["loss"],
                         info.get("val_accuracy"))
        elif kind == "done":
            self.result = {"name": self.name, "version": msg["version"]}
            self.metrics = msg.get("metrics")
        elif kind == "failed":
            self.error = msg.get("message")

    def describe(self) -> dict[str, Any]:
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


class JobManager:
    def __init__(self, supervisor: Any) -> None:
        self.sup = supervisor
        self.cfg = supervisor.cfg["training"]
        self.jobs: "collections.OrderedDict[str, Job]" = collections.OrderedDict()
        self.loop = IOLoop.current()
        self.root = os.path.join(supervisor.store.root, TMP, "jobs")

    @property
    def data_roots(self) -> list[str]:
        return [os.getcwd(), os.path.join(self.sup.store.root, "data"), *self.cfg["data_roots"]]

    # -- API -----------------------------------------------------------------------
    async def submit(self, name: Any, data_spec: Any, params: Any, apply: Any,
                     trusted_path: bool = False) -> Job:
        try:
            check_name(name)
        except Exception as exc:
            raise JobError(400, "invalid_name", str(exc)) from None
        if not isinstance(apply, bool):
            raise JobError(400, "invalid_field", "'apply' must be true or false")
        if params is not None and not isinstance(params, dict):
            raise JobError(400, "invalid_params", "'params' must be an object")
        try:
            full = validate_params(params or {})
        except ParamError as exc:
            raise JobError(400, "invalid_params", f"params.{exc.field}: {exc.message}") from None
        roots = ["/"] if trusted_path else self.data_roots
        try:  # reading a big file must not stall serving: off the loop
            data = await self.loop.run_in_executor(None, dataset.load, data_spec, roots)
        except dataset.DataError as exc:
            raise JobError(400, "invalid_data", str(exc)) from None
        job = Job(name, full, data, apply)
        job.dir = os.path.join(self.root, job.id)
        try:
            os.makedirs(job.dir, exist_ok=True)
            await self.loop.run_in_executor(None, data.write_jsonl,
                                            os.path.join(job.dir, "data.jsonl"))
        except OSError as exc:
            shutil.rmtree(job.dir, ignore_errors=True)
            raise JobError(507, "insufficient_storage",
                           f"cannot write the job's data into the model store: {exc}") from None
        self.jobs[job.id] = job
        self._trim()
        log.info("job %s queued: train %s on %d examples %s", job.id, name,
                 len(data.texts), data.summary()["label_counts"])
        self._schedule()
        return job

    def get(self, job_id: str) -> Job:
        job = self.jobs.get(job_id)
        if job is None:
            raise JobError(404, "not_found", f"no job with id {job_id!r}")
        return job

    def list(self) -> list[dict[str, Any]]:
        return [{k: v for k, v in j.describe().items() if k not in ("history", "params")}
                for j in reversed(self.jobs.values())]

    async def cancel(self, job_id: str) -> Job:
        job = self.get(job_id)
        if job.state == "queued":
            self._finish(job, "cancelled")
        elif job.state == "running":
            job.state = "cancelled"  # the exit callback keeps it so
            if job.process is not None:
                await job.process.stop(2.0)
        else:
            raise JobError(409, "conflict", f"job {job_id} is already {job.state}")
        return job

    async def shutdown(self) -> None:
        for job in list(self.jobs.values()):
            if job.state in ("queued", "running"):
                await self.cancel(job.id)

    # -- running -------------------------------------------------------------------
    def _trim(self) -> None:
        done = [j for j in self.jobs.values() if j.state in ("succeeded", "failed", "cancelled")]
        for j in done[:max(0, len(done) - KEEP_FINISHED)]:
            del self.jobs[j.id]

    def _schedule(self) -> None:
        running = sum(1 for j in self.jobs.values() if j.state == "running")
        for job in self.jobs.values():
            if running >= self.cfg["max_concurrent"] or self.sup.stopping:
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
                "data_summary": job.data_summary, "models_dir": self.sup.store.root,
                "nice": self.cfg["nice"], "threads": self.cfg["threads"], "root": ROOT,
                "parent_pid": os.getpid()}
        job.process = TrainerProcess(job, spec, self._on_exit)

    def _on_exit(self, proc: TrainerProcess) -> None:
        job = proc.job
        job.exitcode = proc.exitcode
        if job.state == "cancelled":
            self._finish(job, "cancelled")
        elif job.result is not None and proc.exitcode == 0:
            self._finish(job, "succeeded")
            log.info("job %s succeeded: %s v%s, accuracy %s", job.id, job.name,
                     job.result["version"], (job.metrics or {}).get("accuracy"))
            if job.apply and not self.sup.stopping:
                self.loop.spawn_callback(self._apply, job)
            else:
                self.sup.refresh_preload()
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
        # a cancelled or crashed trainer may leave a staging folder behind
        if not self._any_running():
            self.sup.store.clean_staging()

    def _any_running(self) -> bool:
        return any(j.state == "running" for j in self.jobs.values())

    @staticmethod
    def _tail(path: str, n: int = 4000) -> str | None:
        try:
            with open(path, "rb") as fh:
                fh.seek(0, os.SEEK_END)
                fh.seek(max(0, fh.tell() - n))
                return fh.read().decode("utf-8", "replace")
        except OSError:
            return None

    async def _apply(self, job: Job) -> None:
        assert job.result is not None
        try:
            job.applied = await self.sup.apply(job.name, job.result["version"], source="train")
        except Exception as exc:
            job.applied = {"error": str(exc)}
            log.error("job %s: apply of %s v%s failed: %s", job.id, job.name,
                      job.result["version"], exc)
