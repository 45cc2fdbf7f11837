"""GET /cluster (management port): the nodes, what each serves, stragglers.

The record backend answers: in cluster mode cluster/node.py's overview;
with the file record a 404 (cluster mode is off).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from state.errors import ServiceError
from frontend.base import ApiError, JsonHandler

if TYPE_CHECKING:
    from control.records import RecordBackend


class ClusterHandler(JsonHandler):
    parts: RecordBackend

    async def get(self) -> None:
        records = self.parts
        try:
            self.send_json(await records.overview())
        except ServiceError as exc:  # Redis down: 503, and this node's own view
            this_node = records.status()
            raise ApiError(exc.status, exc.code, str(exc),
                           {"this_node": this_node} if this_node else None) from None


def routes(kw: dict[str, Any], records: RecordBackend) -> list[Any]:
    return [(r"/cluster", ClusterHandler, {**kw, "parts": records})]
