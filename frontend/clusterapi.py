"""GET /cluster (management port): the nodes, what each serves, stragglers.

Only routed in cluster mode (the supervisor has a `cluster`); see clusternode.py.
"""
from __future__ import annotations

from typing import Any

from state.errors import ServiceError
from frontend.base import ApiError, JsonHandler


class ClusterHandler(JsonHandler):
    async def get(self) -> None:
        cluster = getattr(self.sup, "cluster", None)
        if cluster is None:
            raise ApiError(404, "not_found", "cluster mode is off (set cluster.redis_url)")
        try:
            self.send_json(await cluster.overview())
        except ServiceError as exc:  # Redis down: 503, and this node's own view
            raise ApiError(exc.status, exc.code, str(exc),
                           {"this_node": cluster.cluster.status()}) from None


def routes(kw: dict[str, Any]) -> list[Any]:
    return [(r"/cluster", ClusterHandler, kw)]
