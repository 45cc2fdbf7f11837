"""Management handlers for training jobs: POST/GET /train, GET/DELETE /train/<id>."""
from __future__ import annotations

from typing import Any

from frontend.base import ApiError, JsonHandler
from jobs import JobError


def _job_error(exc: JobError) -> ApiError:
    return ApiError(exc.status, exc.code, str(exc))


class TrainHandler(JsonHandler):
    async def post(self) -> None:
        data = self.json_object({"name", "data", "params", "apply"})
        for field in ("name", "data"):
            if field not in data:
                raise ApiError(400, "missing_field", f"'{field}' is required")
        try:
            job = await self.sup.jobs.submit(data["name"], data["data"], data.get("params"),
                                             data.get("apply", False))
        except JobError as exc:
            raise _job_error(exc) from None
        self.set_header("Location", f"/train/{job.id}")
        self.send_json({"job": job.describe()}, status=202)

    def get(self) -> None:
        self.send_json({"jobs": self.sup.jobs.list()})


class JobHandler(JsonHandler):
    def get(self, job_id: str) -> None:
        try:
            self.send_json({"job": self.sup.jobs.get(job_id).describe()})
        except JobError as exc:
            raise _job_error(exc) from None

    async def delete(self, job_id: str) -> None:
        try:
            job = await self.sup.jobs.cancel(job_id)
        except JobError as exc:
            raise _job_error(exc) from None
        self.send_json({"job": job.describe()})


def routes(kw: dict[str, Any]) -> list:
    return [(r"/train", TrainHandler, kw), (r"/train/([^/]{1,64})", JobHandler, kw)]
