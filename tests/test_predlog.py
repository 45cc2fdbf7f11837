"""The SQLite prediction log (state/predlog.py) on its own, beside the contract
both backends keep (tests/test_predlog_contract.py): trimming, a reopen
losing nothing, the schema migration, finding service-made ids by their time."""
from __future__ import annotations


import pytest

from tests.helpers import wait_for
from state.dataset import DataError, Dataset, merge_feedback
from state.predlog import PredictionLog


def _rows(rid: str, texts: list[str], model: str = "m", version: int = 1,
          scores: list[dict] | None = None) -> list[dict]:
    scores = scores or [{"pos": 0.9, "neg": 0.1}] * len(texts)
    return [{"at": 1.0, "request_id": rid, "index": i, "model": model, "version": version,
             "text": t, "label": max(s, key=s.get), "scores": s}
            for i, (t, s) in enumerate(zip(texts, scores))]


@pytest.fixture
def plog(tmp_path):
    p = PredictionLog(str(tmp_path / "p.db"), max_rows=50)
    yield p
    p.close()










def test_oldest_rows_dropped_beyond_max_rows(tmp_path):
    p = PredictionLog(str(tmp_path / "p.db"), max_rows=10)
    try:
        for i in range(30):
            p.add(_rows(f"r{i}", [f"t{i}"]))
        p.add(_rows("other", ["o"], model="n"))
        p.flush(10)
        kept = p.recent("m", limit=100)
        assert len(kept) <= 20 and kept[0]["text"] == "t29"  # trimmed in steps of max_rows
        p.add(_rows("last", ["x"] * 10))
        p.flush(10)
        assert len(p.recent("m", limit=100)) <= 20
        assert p.get("r0") == [] and p.get("other")  # another model keeps its rows
    finally:
        p.close()


def test_close_commits_everything_queued_and_reopen_reads_it(tmp_path):
    path = str(tmp_path / "p.db")
    p = PredictionLog(path)
    for i in range(200):
        p.add(_rows(f"r{i}", ["a", "b"]))
    fut = p.add_feedback("r5", 1, "neg", model="m", version=1, text="b")
    p.close()  # no flush before: close itself drains the queue
    assert fut.done() and fut.exception() is None
    q = PredictionLog(path)
    try:
        assert q.counts("m") == {1: {"predictions": 400, "feedback": 1}}
    finally:
        q.close()






def test_merge_feedback_wins_and_counts_new_labels():
    data = Dataset(["a", "b", "c", "d"], ["pos", "pos", "neg", "neg"], "inline",
                   {"pos": 2, "neg": 2})
    merged, info = merge_feedback(data, [("a", "neg"), ("e", "pos"), ("f", "sport"),
                                         ("g", "sport"), ("h", "lonely")])
    pairs = dict(zip(merged.texts, merged.labels))
    assert pairs["a"] == "neg" and pairs["e"] == "pos" and pairs["f"] == "sport"
    assert "h" not in pairs and info["waiting"] == {"lonely": 1}
    assert info["rows"] == 4 and info["relabelled"] == 1 and info["added"] == 3
    assert info["new_labels"] == ["sport"] and info["new_label_rows"] == 2
    assert merged.counts == {"neg": 3, "pos": 2, "sport": 2}
    with pytest.raises(DataError):  # feedback that leaves one label
        merge_feedback(data, [("a", "neg"), ("b", "neg")])
    # a label left with one example trains (never tested, warned about)
    merged, _ = merge_feedback(data, [("a", "neg")])
    assert merged.single_example_labels() == ["pos"] and "single example" in merged.summary()["warnings"][0]
    with pytest.raises(DataError, match="every label has a single example"):
        merge_feedback(Dataset(["a", "b"], ["pos", "neg"], "t", {"pos": 1, "neg": 1}), [])


def test_counts_of_logged_dropped_and_queued_texts(tmp_path):
    """stats(): what the writer process committed, what was never written, what
    waits here; the trim keeps max_rows (and at most 5 % more between trims)."""
    p = PredictionLog(str(tmp_path / "p.db"), max_rows=100)
    try:
        for i in range(40):
            p.add(_rows(f"r{i}", ["a", "b", "c"]))
        p.flush(10)
        assert p.stats() == {"logged": 120, "dropped": 0, "queued": 0}
        assert 100 <= p.counts("m")[1]["predictions"] <= 105
        assert p.recent("m", limit=1)[0]["request_id"] == "r39"
    finally:
        p.close()
    p.add(_rows("late", ["x"]))  # closed: not queued, not counted as logged
    assert p.stats()["logged"] == 120 and p.stats()["queued"] == 0


def test_a_schema_1_log_is_migrated_on_open(tmp_path):
    """A log written by the previous layout (a row per text in `predictions`)
    opens with every prediction and its feedback readable as before."""
    import json
    import sqlite3
    path = str(tmp_path / "p.db")
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("""CREATE TABLE predictions (
        id INTEGER PRIMARY KEY AUTOINCREMENT, at REAL NOT NULL, request_id TEXT NOT NULL,
        idx INTEGER NOT NULL, model TEXT NOT NULL, version INTEGER, text TEXT NOT NULL,
        label TEXT, scores TEXT, margin REAL)""")
    conn.execute("""CREATE TABLE feedback (
        request_id TEXT NOT NULL, idx INTEGER NOT NULL, model TEXT NOT NULL, version INTEGER,
        text TEXT NOT NULL, predicted TEXT, label TEXT NOT NULL,
        new_label INTEGER NOT NULL DEFAULT 0, at REAL NOT NULL, PRIMARY KEY (request_id, idx))""")
    rows = [(1.0, "r1", 0, "m", 1, "a", "pos", {"pos": 0.9, "neg": 0.1}),
            (1.0, "r1", 1, "m", 1, "b", "neg", {"neg": 0.6, "pos": 0.4}),
            (2.0, "r2", 0, "m", 2, "c", "pos", {"pos": 0.7, "neg": 0.3}),
            (3.0, "r3", 0, "n", 1, "d", "x", {"x": 1.0})]
    for at, rid, idx, model, version, text, label, scores in rows:
        conn.execute("INSERT INTO predictions (at, request_id, idx, model, version, text, "
                     "label, scores, margin) VALUES (?, ?, ?, ?, ?, ?, ?, ?, 0)",
                     (at, rid, idx, model, version, text, label, json.dumps(scores)))
    conn.execute("INSERT INTO feedback VALUES ('r1', 1, 'm', 1, 'b', 'neg', 'pos', 0, 5.0)")
    conn.execute("PRAGMA user_version = 1")
    conn.close()
    p = PredictionLog(path)
    try:
        assert [r["text"] for r in p.get("r1")] == ["a", "b"]
        assert p.get("r1", 1)[0]["scores"] == {"neg": 0.6, "pos": 0.4}
        assert p.get("r1", 1)[0]["margin"] == pytest.approx(0.2)
        assert p.counts("m") == {1: {"predictions": 2, "feedback": 1},
                                 2: {"predictions": 1, "feedback": 0}}
        assert [r["text"] for r in p.recent("m")] == ["c", "b", "a"]
        fed = p.fed_back("m")
        assert len(fed) == 1 and fed[0]["truth"] == "pos" and fed[0]["scores"]["neg"] == 0.6
        assert p.get("r3")[0]["model"] == "n"
        p.add(_rows("r4", ["e"]))  # and new predictions go beside them
        p.flush(10)
        assert p.counts("m")[1]["predictions"] == 3
    finally:
        p.close()
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == 2
    assert not conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'predictions'").fetchall()
    conn.close()


def test_trim_cuts_a_batch_and_keeps_the_newest_texts_exactly(tmp_path):
    """One write holding more than max_rows texts: the trim cuts the oldest
    texts off inside the stored batch, and a trimmed request reads as gone."""
    p = PredictionLog(str(tmp_path / "p.db"), max_rows=10)
    try:
        p.add(_rows("big", [f"t{i}" for i in range(25)]))
        p.flush(10)
        assert p.counts("m")[1]["predictions"] == 10
        kept = p.get("big")
        assert [r["index"] for r in kept] == list(range(15, 25))
        assert p.get("big", 3) == [] and p.get("big", 20)[0]["text"] == "t20"
    finally:
        p.close()


def test_service_made_ids_are_found_by_their_time_without_a_row_of_their_own(tmp_path):
    """An id the service made (frontend/request_ids.py new_id) carries its time: its
    answer, logged within moments, is found among the batches written then
    (no `rids` row); one logged long after its id's time, and any other id,
    gets a row; both read back the same."""
    import sqlite3
    import time

    from frontend.request_ids import new_id
    path = str(tmp_path / "p.db")
    p = PredictionLog(path)
    try:
        ids = [new_id() for _ in range(300)]
        # unguessable: 96 random bits (24 hex digits) after the time, new for each id
        assert all(len(r) == 42 and int(r[18:], 16) >= 0 for r in ids)
        assert len({r[18:] for r in ids}) == 300
        now = time.time()  # logged after the ids were made, as a request does
        for k, rid in enumerate(ids):
            rows = _rows(rid, [f"t{k}", f"u{k}"])
            for r in rows:
                r["at"] = now
            p.add(rows)
        late = f"{ids[0][:8]}{int((now - 30) * 1000) % 10**10:010d}1"  # made 30 s before
        p.add([{**r, "at": now} for r in _rows(late, ["late"])])
        p.add([{**r, "at": now} for r in _rows("client-7", ["c"])])
        p.flush(10)
        assert [r["text"] for r in p.get(ids[123])] == ["t123", "u123"]
        assert p.get(ids[299], 1)[0]["text"] == "u299" and p.get(ids[5], 2) == []
        assert p.get(late)[0]["text"] == "late" and p.get("client-7")[0]["text"] == "c"
        assert p.get(f"{ids[0][:18]}ffff") == []  # well-formed, never logged
        p.add_feedback(ids[7], 1, "neg", model="m", version=1, text="u7").result(10)
        fed = p.fed_back("m", 1)
        assert fed[0]["scores"] == {"pos": 0.9, "neg": 0.1} and fed[0]["at"] == now
    finally:
        p.close()
    conn = sqlite3.connect(path)
    assert {r[0] for r in conn.execute("SELECT request_id FROM rids")} == {late, "client-7"}
    conn.close()


def test_score_rows_read_back_as_top_lists_and_are_cut_by_the_trim(tmp_path):
    """add_scores (the /predict path for models with few labels) stores the
    score rows; reads give the same rows as a logged top list would, and a
    trim inside the entry keeps the right texts with their scores."""
    p = PredictionLog(str(tmp_path / "p.db"), max_rows=3)
    try:
        p.add_scores(1.0, "s1", "m", 1, ["a", "b", "c", "d", "e"], ["x", "y", "z"],
                     [[0.1, 0.7, 0.2], [0.5, 0.2, 0.3], [0.3, 0.3, 0.4], [0.9, 0.05, 0.05],
                      [0.2, 0.2, 0.6]], 2)
        p.flush(10)
        got = p.get("s1")
        assert [r["index"] for r in got] == [2, 3, 4]  # the oldest two trimmed
        assert got[1]["label"] == "x" and got[1]["scores"] == {"x": 0.9, "y": 0.05}
        assert got[0]["margin"] == pytest.approx(0.1)
        assert [r["text"] for r in p.review("m", 5)] == ["c", "e", "d"]
    finally:
        p.close()


def test_the_counts_reach_a_write_that_follows_a_report(plog):
    """`logged` reaches every committed text without more writes: the writer
    process reported a write only with acknowledgements, an error change, or
    a second after its last report, so a write ~0.5 s after a flush's
    acknowledgement stayed uncounted until the next write came."""
    plog.add(_rows("r1", ["a"]))
    plog.flush(10)  # acknowledged: a report
    assert plog.logged == 1
    plog.add(_rows("r2", ["b", "c"]))  # written ~0.5 s later, no acknowledgement
    wait_for(lambda: plog.logged == 3, 10, "the second write counted")
    assert plog.dropped == 0
