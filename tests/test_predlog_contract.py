"""The prediction log's contract, run against both backends: SQLite with its
writer process (state/predlog.py) and Redis streams (cluster/redis_predlog.py).

Writes and reads (get, recent, counts), feedback replacing feedback and its
join, the review order, reads from many threads while writing, a closed log
refusing writes; erasure (one request's texts, a model's whole log), the age
limit, and a request id used twice keeping its first answer. Where the two
differ on purpose (trimming in steps, counts since the start) their own
files test it: tests/test_predlog.py, tests/test_cluster_predlog.py. Real
SQLite, a real writer process, a real redis-server (with AOF on, as
tests/clusterkit.py runs it)."""
from __future__ import annotations

import concurrent.futures
import itertools
import os
import shutil
import threading
import time

import pytest

from tests.clusterkit import RedisServer
from tests.helpers import wait_for

_prefixes = itertools.count()
PREDS = [{"label": "pos", "score": 0.8,
          "top": [{"label": "pos", "score": 0.8}, {"label": "neg", "score": 0.2}]}]


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    if not shutil.which("redis-server"):
        pytest.skip("redis-server is not installed (.ci/run installs it)")
    server = RedisServer(str(tmp_path_factory.mktemp("contract-redis")))
    yield server
    server.stop()


@pytest.fixture(params=["sqlite", "redis"])
def backend(request, tmp_path):
    """(the log, the folder whose files must not hold an erased text)."""
    if request.param == "sqlite":
        from state.predlog import PredictionLog
        p = PredictionLog(str(tmp_path / "p.db"))
        where = str(tmp_path)
    else:
        from cluster.redis_predlog import RedisPredictionLog
        server = request.getfixturevalue("redis_server")
        p = RedisPredictionLog(server.url, prefix=f"c{next(_prefixes)}")
        where = server.dir
    yield request.param, p, where
    p.close()


@pytest.fixture(params=["sqlite", "redis"])
def plog(request, tmp_path):
    """A log of either backend keeping 50 texts a model."""
    if request.param == "sqlite":
        from state.predlog import PredictionLog
        p = PredictionLog(str(tmp_path / "p.db"), max_rows=50)
    else:
        from cluster.redis_predlog import RedisPredictionLog
        server = request.getfixturevalue("redis_server")
        p = RedisPredictionLog(server.url, prefix=f"c{next(_prefixes)}", max_rows=50)
    yield p
    p.close()


def _rows(rid: str, texts: list[str], model: str = "m", version: int = 1,
          scores: list[dict] | None = None) -> list[dict]:
    scores = scores or [{"pos": 0.9, "neg": 0.1}] * len(texts)
    return [{"at": 1.0, "request_id": rid, "index": i, "model": model, "version": version,
             "text": t, "label": max(s, key=s.get), "scores": s}
            for i, (t, s) in enumerate(zip(texts, scores))]


def _answer(plog, rid: str, texts: list[str], model: str = "m") -> None:
    plog.add_answer(time.time(), rid, model, 1, texts, PREDS * len(texts))


def _files_hold(folder: str, needle: str) -> list[str]:
    found = []
    for dirpath, _dirs, files in os.walk(folder):
        for fn in files:
            with open(os.path.join(dirpath, fn), "rb") as fh:
                if needle.encode() in fh.read():
                    found.append(fn)
    return found


def test_add_get_recent_counts(plog):
    plog.add(_rows("r1", ["a", "b", "c"]))
    plog.add(_rows("r2", ["d"], version=2))
    plog.flush(10)
    got = plog.get("r1")
    assert [r["text"] for r in got] == ["a", "b", "c"] and got[1]["index"] == 1
    assert got[0]["model"] == "m" and got[0]["version"] == 1 and got[0]["label"] == "pos"
    assert plog.get("r1", 2)[0]["text"] == "c" and plog.get("r1", 5) == []
    assert plog.get("nope") == []
    assert [r["text"] for r in plog.recent("m")] == ["d", "c", "b", "a"]
    assert [r["text"] for r in plog.recent("m", version=1, limit=2)] == ["c", "b"]
    assert plog.recent("m", version=3) == [] and plog.recent("other") == []
    assert plog.recent("m")[0]["scores"] == {"pos": 0.9, "neg": 0.1}
    assert plog.counts("m") == {1: {"predictions": 3, "feedback": 0},
                                2: {"predictions": 1, "feedback": 0}}
    assert plog.counts("other") == {}
    assert plog.logged == 4 and plog.dropped == 0


def test_top_list_scores_are_kept_as_a_map(plog):
    rows = _rows("r", ["x"])
    rows[0]["scores"] = [{"label": "neg", "score": 0.6}, {"label": "pos", "score": 0.4}]
    plog.add(rows)
    plog.flush(10)
    r = plog.get("r")[0]
    assert r["scores"] == {"neg": 0.6, "pos": 0.4} and r["margin"] == pytest.approx(0.2)


def test_feedback_replaces_and_joins(plog):
    plog.add(_rows("r1", ["a", "b"]))
    plog.flush(10)
    plog.add_feedback("r1", 0, "neg", model="m", version=1, text="a", predicted="pos").result(10)
    plog.add_feedback("r1", 0, "pos", model="m", version=1, text="a", predicted="pos").result(10)
    fed = plog.fed_back("m")
    assert len(fed) == 1 and fed[0]["truth"] == "pos" and fed[0]["label"] == "pos"
    assert fed[0]["scores"] == {"pos": 0.9, "neg": 0.1} and fed[0]["version"] == 1
    assert fed[0]["at"] == 1.0 and fed[0]["fed_at"] > 1.0 and fed[0]["new_label"] is False
    assert plog.fed_back("m", version=2) == [] and len(plog.fed_back("m", version=1)) == 1
    assert plog.counts("m")[1] == {"predictions": 2, "feedback": 1}
    plog.add_examples("m", [("z", "neg"), ("z", "sport")], new_labels=["sport"]).result(10)
    assert sorted(plog.feedback_examples("m")) == [("a", "pos"), ("z", "sport")]
    assert plog.feedback_count("m") == 2
    assert plog.feedback_count("m", since=time.time() + 60) == 0
    assert plog.feedback_examples("m", since=time.time() + 60) == []
    assert plog.labels_seen("m") == {"pos", "sport"}


def test_review_uncertain_first_without_fed_back_or_repeated_texts(plog):
    scores = [{"pos": 0.9, "neg": 0.1}, {"pos": 0.55, "neg": 0.45}, {"pos": 0.7, "neg": 0.3},
              {"pos": 0.51, "neg": 0.49}]
    plog.add(_rows("r1", ["sure", "unsure", "middling", "coin"], scores=scores))
    plog.add(_rows("r2", ["unsure"], scores=[{"pos": 0.52, "neg": 0.48}]))
    plog.flush(10)
    plog.add_feedback("r1", 3, "neg", model="m", version=1, text="coin").result(10)
    items = plog.review("m", 10, "uncertain")
    assert [r["text"] for r in items] == ["unsure", "middling", "sure"]
    assert items[0]["request_id"] == "r2"  # the most uncertain row of a repeated text
    assert len(plog.review("m", 2, "random")) == 2
    assert {r["text"] for r in plog.review("m", 10, "random")} == {"sure", "unsure", "middling"}
    plog.add_examples("m", [("middling", "pos")]).result(10)  # a labelled text leaves it
    assert [r["text"] for r in plog.review("m", 10)] == ["unsure", "sure"]


def test_review_keeps_the_newest_first_among_equal_margins(plog):
    """The review queue's order (state/predlog_core.py review_pick): equal
    margins keep the log's order, newest first; a single-label top counts its
    distance to a tie; the limit holds."""
    same = {"pos": 0.6, "neg": 0.4}
    plog.add(_rows("r1", ["old", "older twin"], scores=[same, same]))
    plog.add(_rows("r2", ["new"], scores=[same]))
    plog.add(_rows("r3", ["sure alone"], scores=[{"pos": 0.95}]))
    plog.add(_rows("r4", ["unsure alone"], scores=[{"pos": 0.55}]))
    plog.flush(10)
    items = plog.review("m", 10)
    assert [r["text"] for r in items] == ["unsure alone", "new", "older twin", "old",
                                          "sure alone"]
    assert [round(r["margin"], 6) for r in items] == [0.1, 0.2, 0.2, 0.2, 0.9]
    assert [r["text"] for r in plog.review("m", 2)] == ["unsure alone", "new"]
    assert items[1] == {"at": 1.0, "request_id": "r2", "index": 0, "model": "m", "version": 1,
                        "text": "new", "label": "pos", "scores": same,
                        "margin": pytest.approx(0.2)}
    assert plog.review("empty", 10) == []


def test_scored_answers_read_back_as_top_lists(plog):
    """add_scores: the score rows read back as the top k /predict answered."""
    plog.add_scores(1.0, "sc", "m", 1, ["x", "y"], ["a", "b", "c"],
                    [[0.1, 0.7, 0.2], [0.5, 0.2, 0.3]], 2)
    plog.flush(10)
    got = plog.get("sc")
    assert [(r["text"], r["label"], r["scores"]) for r in got] == [
        ("x", "b", {"b": 0.7, "c": 0.2}), ("y", "a", {"a": 0.5, "c": 0.3})]
    assert got[0]["margin"] == pytest.approx(0.5)


def test_feedback_labels_newest_wins_and_counts(plog):
    """feedback_examples: oldest first, a text labelled again keeps its newest
    label (in the newest label's place); feedback_count and labels_seen
    count feedback and examples alike; new_label and a prediction never
    logged (scores {}, at None) in fed_back."""
    plog.add(_rows("r1", ["a", "b"]))
    plog.flush(10)
    plog.add_feedback_many([("r1", 0, "neg", "m", 1, "a", "pos", False),
                            ("r1", 1, "sport", "m", 1, "b", "pos", True)], at=100.0).result(10)
    plog.add_examples("m", [("c", "pos")], at=200.0).result(10)
    plog.add_examples("m", [("a", "pos")], at=300.0).result(10)  # a text labelled again
    plog.add_feedback("gone", 4, "neg", model="m", version=2, text="d", predicted="pos",
                      at=400.0).result(10)
    assert plog.feedback_examples("m") == [("b", "sport"), ("c", "pos"), ("a", "pos"),
                                           ("d", "neg")]
    assert plog.feedback_examples("m", since=250.0) == [("a", "pos"), ("d", "neg")]
    assert plog.feedback_count("m") == 5 and plog.feedback_count("m", since=150.0) == 3
    assert plog.labels_seen("m") == {"neg", "sport", "pos"} and plog.labels_seen("x") == set()
    fed = plog.fed_back("m")
    assert [(f["text"], f["truth"], f["new_label"]) for f in fed] == [
        ("a", "neg", False), ("b", "sport", True), ("d", "neg", False)]
    assert fed[2] == {"request_id": "gone", "index": 4, "version": 2, "text": "d",
                      "label": "pos", "truth": "neg", "new_label": False, "scores": {},
                      "at": None, "fed_at": 400.0}
    assert plog.counts("m") == {1: {"predictions": 2, "feedback": 2},
                                2: {"predictions": 0, "feedback": 1}}
    assert [r["text"] for r in plog.review("m")] == []  # every text labelled


def test_erasures_report_the_texts_they_erased(backend):
    """erase, purge and expire fill `erased` with {model: texts} (the policy's
    copies are erased by them): answers, feedback and examples alike."""
    _, plog, _ = backend
    now = time.time()
    plog.add_answer(now, "r1", "a", 1, ["one", "two"], PREDS * 2)
    plog.add_answer(now - 3 * 86400, "r2", "b", 1, ["old b"], PREDS)
    plog.add_answer(now, "r3", "c", 1, ["c text"], PREDS)
    plog.flush(30)
    plog.add_feedback("r1", 1, "neg", model="a", version=1, text="two").result(30)
    plog.add_examples("a", [("one", "pos"), ("other", "neg")]).result(30)
    plog.add_examples("b", [("old example", "pos")], at=now - 3 * 86400).result(30)
    plog.add_examples("c", [("c example", "pos")]).result(30)
    erased: dict[str, set[str]] = {}
    assert plog.erase("r1", erased=erased) == {"predictions": 2, "feedback": 1, "examples": 1}
    assert erased == {"a": {"one", "two"}}
    erased = {}
    assert plog.expire({"b": 1.0}, 0.0, now=now, erased=erased) == {
        "predictions": 1, "feedback": 0, "examples": 1}
    assert erased == {"b": {"old b", "old example"}}
    erased = {}
    assert plog.purge("c", erased=erased) == {"predictions": 1, "feedback": 0, "examples": 1}
    assert erased == {"c": {"c text", "c example"}}
    assert plog.feedback_examples("a") == [("other", "neg")]


def test_reads_from_many_threads_while_writing(plog):
    errors: list[Exception] = []
    stop = threading.Event()

    def reader() -> None:
        while not stop.is_set():
            try:
                plog.recent("m", limit=5)
                plog.counts("m")
            except Exception as exc:  # pragma: no cover - the failure itself
                errors.append(exc)
                return

    with concurrent.futures.ThreadPoolExecutor(4) as ex:
        futs = [ex.submit(reader) for _ in range(3)]
        for i in range(300):
            plog.add(_rows(f"r{i}", ["a"]))
        plog.flush(10)
        stop.set()
        for f in futs:
            f.result(10)
    assert not errors
    kept = len(plog.recent("m", limit=1000))
    assert 50 <= kept < 100, kept  # max_rows 50 (SQLite trims in steps of it)
    assert plog.recent("m", limit=1)[0]["request_id"] == "r299"  # the newest stay


def test_a_closed_log_refuses_writes(plog):
    plog.close()
    plog.add(_rows("r", ["a"]))  # dropped quietly: serving goes on
    with pytest.raises(RuntimeError):
        plog.add_feedback("r", 0, "x", model="m", version=1, text="a").result(1)
    plog.flush(1)  # a no-op, not a hang


def test_a_request_id_used_twice_keeps_its_first_answer(backend):
    _, plog, _ = backend
    _answer(plog, "client-1", ["first text"])
    plog.flush(30)
    _answer(plog, "client-1", ["second text", "and more"])
    plog.flush(30)
    assert [r["text"] for r in plog.get("client-1")] == ["first text"]


def test_erase_removes_a_requests_texts_everywhere(backend):
    name, plog, where = backend
    secret = f"erase-me-{os.urandom(4).hex()}"
    _answer(plog, "r-keep", ["kept text"])
    _answer(plog, "r-gone", [secret, f"{secret} two"])
    plog.flush(30)
    _answer(plog, "r-gone", [f"{secret} replayed"])  # the same id again: its entry too
    plog.add_feedback("r-gone", 0, "neg", model="m", version=1, text=secret).result(30)
    plog.add_feedback("r-keep", 0, "pos", model="m", version=1, text="kept text").result(30)
    plog.add_examples("m", [(secret, "neg"), ("another example", "pos")]).result(30)
    _answer(plog, "r-gone", [f"{secret} queued"])  # queued, not yet written: erased too
    removed = plog.erase("r-gone")
    assert removed == {"predictions": 4, "feedback": 1, "examples": 1}, removed
    assert plog.get("r-gone") == []
    assert [r["text"] for r in plog.get("r-keep")] == ["kept text"]
    assert [f["text"] for f in plog.fed_back("m")] == ["kept text"]
    assert plog.feedback_examples("m") and secret not in {t for t, _ in plog.feedback_examples("m")}
    assert all(secret not in r["text"] for r in plog.recent("m"))
    plog.flush(30)
    assert plog.erase("r-gone") == {"predictions": 0, "feedback": 0, "examples": 0}
    # erased means unreadable: no file of the store holds the text's bytes
    if name == "redis":  # the AOF is rewritten after an erasure
        wait_for(lambda: not _rewriting(plog), 60, "Redis's AOF rewrite")
    assert _files_hold(where, secret) == []


def _rewriting(plog) -> bool:
    info = plog.redis.info("persistence")
    return bool(info.get("aof_rewrite_in_progress") or info.get("aof_rewrite_scheduled"))


def test_purge_removes_one_models_log(backend):
    _, plog, _ = backend
    _answer(plog, "a-1", ["a text", "a text 2"], model="a")
    _answer(plog, "b-1", ["b text"], model="b")
    plog.flush(30)
    plog.add_feedback("a-1", 1, "pos", model="a", version=1, text="a text 2").result(30)
    plog.add_examples("a", [("free a", "pos")]).result(30)
    assert plog.purge("a") == {"predictions": 2, "feedback": 1, "examples": 1}
    assert plog.get("a-1") == [] and plog.recent("a") == [] and plog.fed_back("a") == []
    assert plog.feedback_examples("a") == []
    assert [r["text"] for r in plog.get("b-1")] == ["b text"]


def test_the_age_limit_erases_what_is_older(backend):
    """expire(): answers, feedback and free examples older than their model's
    limit go (a model's own limit over the default); the rest stays."""
    _, plog, _ = backend
    now = time.time()
    old, fresh = now - 3 * 86400, now - 3600
    plog.add_answer(old, "old-a", "a", 1, ["old a"], PREDS)
    plog.add_answer(fresh, "new-a", "a", 1, ["new a"], PREDS)
    plog.add_answer(old, "old-b", "b", 1, ["old b"], PREDS)
    plog.flush(30)
    plog.add_feedback("old-a", 0, "pos", model="a", version=1, text="old a", at=old).result(30)
    plog.add_feedback("new-a", 0, "pos", model="a", version=1, text="new a", at=fresh).result(30)
    plog.add_examples("a", [("an old example", "neg")], at=old).result(30)
    plog.add_examples("a", [("a new example", "pos")], at=fresh).result(30)
    assert plog.expire({}, 0.0, now=now) == {"predictions": 0, "feedback": 0, "examples": 0}
    # a: 2 days (its own); b: 5 days (the default): only a's old texts go
    removed = plog.expire({"a": 2.0}, 5.0, now=now)
    assert removed == {"predictions": 1, "feedback": 1, "examples": 1}, removed
    assert plog.get("old-a") == [] and [r["text"] for r in plog.get("new-a")] == ["new a"]
    assert [f["text"] for f in plog.fed_back("a")] == ["new a"]
    assert sorted(t for t, _ in plog.feedback_examples("a")) == ["a new example", "new a"]
    assert [r["text"] for r in plog.get("old-b")] == ["old b"]
    assert plog.expire({}, 1.0, now=now)["predictions"] == 1  # b's turn, by the default


def test_both_backends_have_the_whole_contract():
    """Each backend defines every member of the Protocol, with its signature."""
    import inspect

    from cluster.redis_predlog import RedisPredictionLog
    from state.predlog import PredictionLog
    from state.predlog_api import PredictionLogBackend

    members = {n for n in dir(PredictionLogBackend) if not n.startswith("_")}
    members |= set(PredictionLogBackend.__annotations__)
    assert {"add_answer", "erase", "purge", "expire", "get", "review"} <= members
    for cls in (PredictionLog, RedisPredictionLog):
        for name in sorted(members):
            want = getattr(PredictionLogBackend, name, None)
            if name in PredictionLogBackend.__annotations__:
                continue  # attributes, set in __init__
            got = getattr(cls, name, None)
            assert got is not None, (cls.__name__, name)
            if inspect.isfunction(want):
                assert inspect.signature(got).parameters.keys() == \
                    inspect.signature(want).parameters.keys(), (cls.__name__, name)
