"""control/feedback.py's FeedbackService without HTTP: feedback on logged
predictions (single-label and multi-label), free examples, the review queue
and the refusals, against both prediction logs (SQLite with its writer
process, and Redis streams on a real redis-server) and a real model store
(tests/tinymodels.py's models; a multi-label copy of one). The HTTP side
(parsing, tokens, the rate limit) is tests/test_feedback.py's."""
from __future__ import annotations

import asyncio
import itertools
import shutil
import time

import pytest

from tests.clusterkit import RedisServer
from control.feedback import FeedbackService
from state.errors import ServiceError
from state.store import ModelStore
from tests.tinymodels import copy_model

_prefixes = itertools.count()


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    if not shutil.which("redis-server"):
        pytest.skip("redis-server is not installed (.ci/run installs it)")
    server = RedisServer(str(tmp_path_factory.mktemp("feedback-redis")))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def store(tiny_store, tmp_path_factory) -> ModelStore:
    """The tiny models, and "tags": sent v1 as a multi-label model."""
    root = str(tmp_path_factory.mktemp("feedback-store") / "models")
    shutil.copytree(tiny_store, root)
    copy_model(root, "sent/1", "tags", meta_update={
        "multi_label": True, "thresholds": {"neg": 0.5, "pos": 0.5}, "min_labels": 0})
    return ModelStore(root)


@pytest.fixture(params=["sqlite", "redis"])
def plog(request, tmp_path):
    if request.param == "sqlite":
        from state.predlog import PredictionLog
        p = PredictionLog(str(tmp_path / "p.db"))
    else:
        from cluster.redis_predlog import RedisPredictionLog
        server = request.getfixturevalue("redis_server")
        p = RedisPredictionLog(server.url, prefix=f"fs{next(_prefixes)}")
    yield p
    p.close()


@pytest.fixture
def service(plog, store) -> FeedbackService:
    return FeedbackService(plog, store, None, max_items=100, max_text_chars=1000)


def _logged(plog, rid: str, model: str, texts: list[str], rows: list[list[float]]) -> None:
    plog.add_scores(time.time(), rid, model, 1, texts, ["neg", "pos"], rows, 2)


def _refused(coro) -> ServiceError:
    with pytest.raises(ServiceError) as err:
        asyncio.run(coro)
    return err.value


def test_feedback_on_a_logged_batch_is_stored_and_checked(service, plog):
    _logged(plog, "b-1", "sent", ["good", "bad", "meh"], [[0.1, 0.9], [0.8, 0.2], [0.4, 0.6]])
    answer = asyncio.run(service.feedback({"request_id": "b-1",
                                           "labels": ["pos", "neg", "neutral"]}))
    assert answer["stored"] == 3 and answer["model"] == {"name": "sent", "version": 1}
    assert [(i["label"], i["predicted"], i["correct"], i["new_label"])
            for i in answer["items"]] == [("pos", "pos", True, False),
                                          ("neg", "neg", True, False),
                                          ("neutral", "pos", False, True)]
    assert answer["new_label"] is True
    fed = {(r["index"], r["truth"]) for r in plog.fed_back("sent")}
    assert fed == {(0, "pos"), (1, "neg"), (2, "neutral")}


def test_feedback_on_one_text_by_index(service, plog):
    _logged(plog, "b-2", "sent", ["good", "bad"], [[0.1, 0.9], [0.8, 0.2]])
    answer = asyncio.run(service.feedback({"request_id": "b-2", "index": 1, "label": "pos"}))
    assert (answer["stored"], answer["index"], answer["label"], answer["predicted"],
            answer["correct"]) == (1, 1, "pos", "neg", False)
    assert [(r["index"], r["truth"]) for r in plog.fed_back("sent")] == [(1, "pos")]


def test_feedback_refusals_say_what_is_wrong(service, plog):
    _logged(plog, "b-3", "sent", ["good", "bad"], [[0.1, 0.9], [0.8, 0.2]])
    cases = [
        ({"request_id": "nobody", "label": "pos"}, 404, "unknown_request_id"),
        ({"request_id": "b-3", "labels": ["pos"]}, 400, "wrong_length"),
        ({"request_id": "b-3", "label": "pos"}, 400, "missing_field"),  # two texts: index?
        ({"request_id": "b-3", "index": 5, "label": "pos"}, 404, "unknown_index"),
        ({"request_id": "b-3", "label": "pos", "labels": ["pos"]}, 400, "bad_request"),
        ({"request_id": "b-3", "index": True, "label": "pos"}, 400, "invalid_field"),
        ({"request_id": "b-3", "labels": [["pos"], ["neg"]]}, 400, "invalid_field"),
        ({"request_id": "b-3", "labels": ["pos", '["neg"]']}, 400, "invalid_field"),
        ({"request_id": "bad id!", "label": "pos"}, 400, "invalid_request_id"),
        ({"label": "pos"}, 400, "missing_field"),
        ({"request_id": "b-3", "labels": ["x"] * 101}, 413, "too_many_items"),
    ]
    for body, status, code in cases:
        err = _refused(service.feedback(body))
        assert (err.status, err.code) == (status, code), (body, err)
    assert plog.fed_back("sent") == []
    assert _refused(service.feedback({"request_id": "nobody", "label": "pos"})).details == {
        "request_id": "nobody"}


def test_multi_label_feedback_takes_label_sets(service, plog):
    _logged(plog, "m-1", "tags", ["both", "none"], [[0.7, 0.9], [0.1, 0.2]])
    answer = asyncio.run(service.feedback({"request_id": "m-1",
                                           "labels": [["neg", "pos"], []]}))
    assert answer["multi_label"] is True and answer["stored"] == 2
    assert [(i["labels"], i["predicted"], i["correct"]) for i in answer["items"]] == [
        (["neg", "pos"], ["neg", "pos"], True), ([], [], True)]
    err = _refused(service.feedback({"request_id": "m-1", "index": 0, "label": "pos"}))
    assert (err.status, err.code) == (400, "invalid_field") and "multi-label" in str(err)


def test_free_examples_flag_new_labels(service, plog):
    answer = asyncio.run(service.feedback({"model": "sent", "examples": [
        {"text": "lovely", "label": "pos"}, {"text": "so so", "label": "neutral"}]}))
    assert (answer["stored"], answer["new_labels"]) == (2, ["neutral"])
    assert [i["new_label"] for i in answer["items"]] == [False, True]
    assert sorted(plog.feedback_examples("sent")) == [("lovely", "pos"), ("so so", "neutral")]
    multi = asyncio.run(service.feedback({"model": "tags", "examples": [
        {"text": "both", "labels": ["pos", "neg", "pos"]}]}))
    assert multi["multi_label"] is True and multi["items"][0]["labels"] == ["neg", "pos"]
    for body, status, code in [
            ({"model": "absent", "examples": [{"text": "x", "label": "pos"}]}, 404, "not_found"),
            ({"model": "sent", "examples": []}, 400, "invalid_field"),
            ({"model": "sent", "examples": [{"text": "x", "labels": ["pos"]}]}, 400,
             "invalid_field"),
            ({"model": "sent", "examples": [{"text": "x" * 1001, "label": "pos"}]}, 422,
             "text_too_long"),
            ({"model": "sent", "examples": [{"text": "x", "label": "pos"}], "index": 0}, 400,
             "bad_request")]:
        err = _refused(service.feedback(body))
        assert (err.status, err.code) == (status, code), (body, err)


def test_the_review_queue_lists_what_has_no_label_yet(service, plog):
    _logged(plog, "r-1", "sent", ["sure", "unsure"], [[0.02, 0.98], [0.45, 0.55]])
    queue = asyncio.run(service.review("sent", 10, "uncertain"))
    assert queue["count"] == 2 and queue["strategy"] == "uncertain"
    assert [i["text"] for i in queue["items"]] == ["unsure", "sure"]  # most uncertain first
    asyncio.run(service.feedback({"request_id": "r-1", "index": 1, "label": "neg"}))
    assert [i["text"] for i in asyncio.run(service.review("sent", 10, "random"))["items"]] == [
        "sure"]
    _logged(plog, "r-2", "tags", ["both"], [[0.7, 0.9]])
    tags = asyncio.run(service.review("tags", 10, "uncertain"))
    assert tags["items"][0]["labels"] == ["neg", "pos"]  # the set it answered
    for args, status in [(("absent", 10, "uncertain"), 404), (("sent", 0, "uncertain"), 400),
                         (("sent", 10, "newest"), 400)]:
        assert _refused(service.review(*args)).status == status


def test_a_log_that_is_off_refuses_feedback(store, tmp_path):
    from state.predlog import PredictionLog
    plog = PredictionLog(str(tmp_path / "off.db"), enabled=False)
    try:
        err = _refused(FeedbackService(plog, store, None, 100, 1000).feedback(
            {"request_id": "x", "label": "pos"}))
        assert (err.status, err.code) == (409, "log_off")
    finally:
        plog.close()


def test_feedback_is_awaited_while_the_loop_keeps_turning(service, plog):
    """The service's reads run in its executor and its writes are awaited as
    futures: twenty feedbacks at once finish while a ticker on the same loop
    keeps running."""
    for n in range(20):
        _logged(plog, f"c-{n}", "sent", ["t"], [[0.3, 0.7]])

    async def main() -> tuple[list[dict], int]:
        ticks = 0
        done = False

        async def ticker() -> None:
            nonlocal ticks
            while not done:
                ticks += 1
                await asyncio.sleep(0.001)
        t = asyncio.ensure_future(ticker())
        answers = await asyncio.gather(*(service.feedback({"request_id": f"c-{n}",
                                                           "label": "pos"})
                                         for n in range(20)))
        done = True
        await t
        return list(answers), ticks
    answers, ticks = asyncio.run(main())
    assert [a["stored"] for a in answers] == [1] * 20
    assert ticks > 1
    assert len(plog.fed_back("sent")) == 20
