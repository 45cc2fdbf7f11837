"""Management handlers for training jobs: POST/GET /train, GET/DELETE /train/<id>."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Awaitable, TypeVar

from state.errors import ServiceError
from frontend.base import ApiError, JsonHandler
from control.jobs import JobError

if TYPE_CHECKING:
    from control.jobs import JobManager

_T = TypeVar("_T")


def _job_error(exc: JobError) -> ApiError:
    return ApiError(exc.status, exc.code, str(exc))


class TrainHandler(JsonHandler):
    parts: JobManager

    async def post(self) -> None:
        # "labels": {label: description}; without "data" a zero-shot version (control/jobs.py)
        data = self.json_object({"name", "data", "params", "apply", "feedback", "labels"})
        if "name" not in data:  # no data: the model's last training's (docs/loop.md)
            raise ApiError(400, "missing_field", "'name' is required")
        feedback = data.get("feedback", False)
        if not isinstance(feedback, bool):
            raise ApiError(400, "invalid_field", "'feedback' must be true or false")
        if "labels" in data and data["labels"] is None:
            raise ApiError(400, "invalid_labels", "'labels' must be an object: "
                                                  "{\"<label>\": \"<description>\", ...}")
        if data.get("data") is None and "data" in data:
            raise ApiError(400, "invalid_data", "'data' must be an object; leave it out to "
                                                "reuse the last training's data")
        try:
            job = await self.parts.submit(data["name"], data.get("data"), data.get("params"),
                                          data.get("apply", False),
                                          feedback=True if feedback else None,
                                          descriptions=data.get("labels"))
        except JobError as exc:
            raise _job_error(exc) from None
        described = job.describe()
        self.audit(data["name"], "train", {"job": job.id, "architecture": (
            described.get("params") or {}).get("architecture"), "apply": bool(data.get("apply"))})
        self.set_header("Location", f"/train/{job.id}")
        self.send_json({"job": described}, status=202)

    async def get(self) -> None:  # cluster mode: every node's jobs, from Redis
        self.send_json({"jobs": await _queue(self.parts.queue.list())})


async def _queue(coro: Awaitable[_T]) -> _T:
    try:
        return await coro
    except JobError as exc:
        raise _job_error(exc) from None
    except ServiceError as exc:  # the cluster store is unreachable: 503
        raise ApiError(exc.status, exc.code, str(exc)) from None


class JobHandler(JsonHandler):
    parts: JobManager

    async def get(self, job_id: str) -> None:
        doc = await _queue(self.parts.queue.get(job_id))
        if doc is None:
            raise ApiError(404, "not_found", f"no job with id {job_id!r}")
        self.send_json({"job": doc})

    async def delete(self, job_id: str) -> None:
        verdict, doc = await _queue(self.parts.queue.cancel(job_id))
        if doc is None:
            raise ApiError(404, "not_found", f"no job with id {job_id!r}")
        if verdict.startswith("done:"):
            raise ApiError(409, "conflict", f"job {job_id} is already {verdict[5:]}")
        self.audit(doc.get("name"), "cancel", {"job": job_id})
        self.send_json({"job": doc})


def routes(kw: dict[str, Any], jobs: JobManager) -> list[Any]:
    kw = {**kw, "parts": jobs}
    return [(r"/train", TrainHandler, kw), (r"/train/([^/]{1,64})", JobHandler, kw)]
