"""What a prediction log is, whichever backend holds it: the contract that
state/predlog.py's PredictionLog (SQLite and a writer process, one node) and
cluster/redis_predlog.py's RedisPredictionLog (Redis streams, a cluster) both keep.
The supervisor picks one at start; the rest of the service sees this only.
tests/test_predlog_contract.py runs the same tests against both."""
from __future__ import annotations

import concurrent.futures
from typing import Any, Iterable, Protocol


class PredictionLogBackend(Protocol):
    enabled: bool
    health: Any  # state/storage.py's Storage: where write failures are reported

    @property
    def logged(self) -> int: ...

    @property
    def dropped(self) -> int: ...

    def stats(self) -> dict[str, int]: ...

    # -- writes: predictions from the IOLoop (never block), feedback as futures --------------
    def add(self, rows: list[dict[str, Any]]) -> None: ...

    def add_answer(self, at: float, request_id: str, model: str, version: Any,
                   texts: list[str], predictions: list[dict[str, Any]]) -> None: ...

    def add_scores(self, at: float, request_id: str, model: str, version: Any,
                   texts: list[str], labels: list[str], rows: list[list[float]], k: int
                   ) -> None: ...

    def add_feedback(self, request_id: str, index: int, label: str, *, model: str,
                     version: Any, text: str, predicted: str | None = None,
                     new_label: bool = False, at: float | None = None
                     ) -> concurrent.futures.Future[Any]: ...

    def add_feedback_many(self, items: list[tuple[Any, ...]], at: float | None = None
                          ) -> concurrent.futures.Future[Any]: ...

    def add_examples(self, model: str, examples: Iterable[tuple[str, str]],
                     new_labels: Iterable[str] = (), at: float | None = None
                     ) -> concurrent.futures.Future[Any]: ...

    # -- reads (executor threads, never the IOLoop) ----------------------------------------
    def get(self, request_id: str, index: int | None = None) -> list[dict[str, Any]]: ...

    def recent(self, model: str, version: Any = None, limit: int = 1000
               ) -> list[dict[str, Any]]: ...

    def fed_back(self, model: str, version: Any = None) -> list[dict[str, Any]]: ...

    def counts(self, model: str) -> dict[Any, dict[str, int]]: ...

    def feedback_count(self, model: str, since: float | None = None) -> int: ...

    def feedback_examples(self, model: str, since: float | None = None
                          ) -> list[tuple[str, Any]]: ...

    def review(self, model: str, limit: int = 50, strategy: str = "uncertain"
               ) -> list[dict[str, Any]]: ...

    def labels_seen(self, model: str) -> set[str]: ...

    # -- erasure and retention (executor threads) -------------------------------------------
    # erased: when given, filled with {model: the texts erased} (the policy's
    # hold-out and inline-data copies erase them too: control/policies.py forget)
    def erase(self, request_id: str, timeout: float = 60.0,
              erased: dict[str, set[str]] | None = None) -> dict[str, int]: ...

    def purge(self, model: str, timeout: float = 60.0,
              erased: dict[str, set[str]] | None = None) -> dict[str, int]: ...

    def expire(self, ages: dict[str, float], default: float = 0.0,
               now: float | None = None,
               erased: dict[str, set[str]] | None = None) -> dict[str, int]: ...

    # -- lifetime ------------------------------------------------------------------------------
    def flush(self, timeout: float | None = None) -> None: ...

    def close(self) -> None: ...
