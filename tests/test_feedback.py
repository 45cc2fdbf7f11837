"""Request ids, the prediction log and POST /feedback on the real service
(tiny real models, real worker processes, real HTTP); the review queue."""
from __future__ import annotations

import concurrent.futures
import http.client
import json
import os
import shutil
import signal

import pytest

from tests.helpers import Service, request, wait_for
from state.config import load_config
from state.predlog import FILENAME as PREDLOG, PredictionLog

TOKEN = "fb-secret-a-key-of-32-characters-or-more"
MGMT = "mgmt-a-management-key-of-32-characters-or-more"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _post(port: int, path: str, body: dict, headers: dict | None = None
          ) -> tuple[int, dict, dict]:
    """(status, body, headers) of a POST."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", path, body=json.dumps(body).encode(),
                     headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"null"), dict(resp.getheaders())
    finally:
        conn.close()


@pytest.fixture(scope="module")
def svc(tiny_store, tmp_path_factory):
    s = _start(tiny_store, tmp_path_factory.mktemp("feedback"))
    yield s
    s.stop()


@pytest.fixture
def own_svc(tiny_store, tmp_path):
    """A service of the test's own, for a test that stops it."""
    s = _start(tiny_store, tmp_path)
    yield s
    s.stop()


def _start(tiny_store: str, base) -> Service:
    root = str(base / "models")
    shutil.copytree(tiny_store, root)
    cfg = base / "config.yaml"
    cfg.write_text(f"rollout:\n  probation_s: 0\nfeedback:\n  token: {TOKEN}\n  max_items: 64\n"
                   "management:\n  token: " + MGMT + "\n")
    s = Service(root, args=["--config", str(cfg)])
    s.cfg = str(cfg)
    code, body = s.mpost("/apply", {"name": "sent"}, headers={"Authorization": f"Bearer {MGMT}"})
    assert code == 200, body
    return s


def feedback(svc: Service, body: dict, headers: dict | None = AUTH) -> tuple[int, dict]:
    return request(svc.port, "POST", "/feedback", body, headers=headers)


def mget(svc: Service, path: str) -> tuple[int, dict]:
    return svc.mget(path, headers={"Authorization": f"Bearer {MGMT}"})


def predict(svc: Service, body: dict, headers: dict | None = None) -> tuple[int, dict, dict]:
    return _post(svc.port, "/predict", body, headers)


def log_of(svc: Service) -> PredictionLog:
    return PredictionLog(os.path.join(svc.models_dir, PREDLOG))


# -- request ids ------------------------------------------------------------------------------
def test_every_answer_has_a_request_id_also_as_header(svc):
    code, body, headers = predict(svc, {"text": "很好"})
    assert code == 200 and body["request_id"] == headers["X-Request-Id"]
    code, other, _ = predict(svc, {"texts": ["很好", "很差"]})
    assert other["request_id"] != body["request_id"]


def test_status_counts_the_logged_texts(svc):
    def plog_status():
        return mget(svc, "/status")[1]["prediction_log"]
    before = plog_status()
    assert set(before) == {"logged", "dropped", "queued"} and before["dropped"] == 0
    predict(svc, {"texts": ["计数 一", "计数 二", "计数 三"]})
    wait_for(lambda: plog_status()["logged"] >= before["logged"] + 3, 30,
             "the three texts committed by the writer process")
    assert plog_status()["dropped"] == 0


def test_a_clients_id_is_used_and_a_malformed_one_refused(svc):
    code, body, headers = predict(svc, {"text": "很好"}, {"X-Request-Id": "ticket:42_a.b-c"})
    assert code == 200 and body["request_id"] == "ticket:42_a.b-c"
    assert headers["X-Request-Id"] == "ticket:42_a.b-c"
    for bad in ("has space", "x" * 65, "semi;colon", "", "ünï"):
        code, body, _ = predict(svc, {"text": "很好"}, {"X-Request-Id": bad})
        assert code == 400 and body["error"]["code"] == "invalid_request_id", bad


def test_oip_infer_uses_its_id_and_logs_it(svc):
    req = {"id": "oip-7", "inputs": [{"name": "text", "datatype": "BYTES", "shape": [2],
                                      "data": ["喜欢", "讨厌"]}]}
    code, body, headers = _post(svc.port, "/v2/models/sent/infer", req)
    assert code == 200 and body["id"] == "oip-7" and headers["X-Request-Id"] == "oip-7"
    code, fb = feedback(svc, {"request_id": "oip-7", "labels": ["pos", "neg"]})
    assert code == 200 and fb["stored"] == 2
    req.pop("id")
    code, body, headers = _post(svc.port, "/v2/models/sent/infer", req)
    assert code == 200 and "id" not in body  # the protocol's body as asked...
    assert predict(svc, {"text": "x"})[2]["X-Request-Id"] != headers["X-Request-Id"]
    code, fb = feedback(svc, {"request_id": headers["X-Request-Id"], "labels": ["pos", "neg"]})
    assert code == 200 and fb["stored"] == 2  # ... and the id made up for it in the header


# -- feedback ---------------------------------------------------------------------------------
def test_feedback_single_index_and_whole_batch(svc):
    _, one, _ = predict(svc, {"text": "非常好用"})
    code, fb = feedback(svc, {"request_id": one["request_id"], "label": "pos"})
    assert code == 200 and fb["stored"] == 1 and fb["new_label"] is False
    assert fb["predicted"] == one["predictions"][0]["label"] and fb["index"] == 0

    _, batch, _ = predict(svc, {"texts": ["很好", "很差", "桌子"]})
    rid = batch["request_id"]
    code, fb = feedback(svc, {"request_id": rid, "labels": ["pos", "neg", "furniture"]})
    assert code == 200 and fb["stored"] == 3 and fb["new_label"] is True
    assert [i["new_label"] for i in fb["items"]] == [False, False, True]
    # the same (request id, index) again replaces the earlier label
    code, fb = feedback(svc, {"request_id": rid, "index": 2, "label": "neg"})
    assert code == 200 and fb["new_label"] is False
    plog = log_of(svc)
    try:
        rows = {(r["request_id"], r["index"]): r for r in plog.fed_back("sent")}
        assert rows[(rid, 2)]["truth"] == "neg" and rows[(rid, 0)]["truth"] == "pos"
        assert sum(1 for k in rows if k[0] == rid) == 3
        assert rows[(rid, 1)]["scores"] and rows[(rid, 1)]["version"] == 2
    finally:
        plog.close()


@pytest.mark.parametrize("body,status,code", [
    ({"request_id": "never-seen", "label": "pos"}, 404, "unknown_request_id"),
    ({"request_id": "bad id", "label": "pos"}, 400, "invalid_request_id"),
    ({"request_id": 7, "label": "pos"}, 400, "invalid_request_id"),
    ({"label": "pos"}, 400, "missing_field"),
    ({"request_id": "x", "label": "pos", "labels": ["pos"]}, 400, "bad_request"),
    ({"request_id": "x", "label": ""}, 400, "invalid_field"),
    ({"request_id": "x", "label": ["pos"]}, 400, "invalid_field"),
    ({"request_id": "x", "label": "pos", "index": -1}, 400, "invalid_field"),
    ({"request_id": "x", "labels": []}, 400, "invalid_field"),
    ({"request_id": "x", "labels": ["pos"] * 65}, 413, "too_many_items"),
    ({"request_id": "x", "label": "pos", "extra": 1}, 400, "unknown_field"),
    ({"model": "sent"}, 400, "bad_request"),
    ({"model": "nosuch", "examples": [{"text": "a", "label": "b"}]}, 404, "not_found"),
    ({"model": "sent", "examples": [{"text": "", "label": "b"}]}, 400, "empty_text"),
    ({"model": "sent", "examples": [{"text": "a"}]}, 400, "invalid_field"),
    ({"model": "sent", "examples": [{"text": "a", "label": "b", "x": 1}]}, 400, "invalid_field"),
    ({"model": "sent", "examples": [{"text": "a", "label": "b"}] * 65}, 413, "too_many_items"),
    ({"model": "sent", "request_id": "x", "examples": []}, 400, "bad_request"),
])
def test_bad_feedback_is_refused_with_what_is_wrong(svc, body, status, code):
    got, answer = feedback(svc, body)
    assert got == status, answer
    assert answer["error"]["code"] == code and answer["error"]["message"]


def test_batch_feedback_of_the_wrong_length_or_index(svc):
    _, batch, _ = predict(svc, {"texts": ["很好", "很差"]})
    rid = batch["request_id"]
    for labels in (["pos"], ["pos", "neg", "neg"]):
        code, fb = feedback(svc, {"request_id": rid, "labels": labels})
        assert code == 400 and fb["error"]["code"] == "wrong_length"
        assert fb["error"]["expected"] == 2
    code, fb = feedback(svc, {"request_id": rid, "label": "pos"})  # which of the two?
    assert code == 400 and "index" in fb["error"]["message"]
    code, fb = feedback(svc, {"request_id": rid, "index": 2, "label": "pos"})
    assert code == 404 and fb["error"]["code"] == "unknown_index"
    plog = log_of(svc)
    try:
        assert not [r for r in plog.fed_back("sent") if r["request_id"] == rid]
    finally:
        plog.close()


def test_free_examples_are_stored_and_new_labels_flagged(svc):
    code, fb = feedback(svc, {"model": "sent", "examples": [
        {"text": "比赛赢了", "label": "sport"}, {"text": "讨厌下雨", "label": "neg"}]})
    assert code == 200 and fb["stored"] == 2 and fb["new_labels"] == ["sport"]
    plog = log_of(svc)
    try:
        assert ("比赛赢了", "sport") in plog.feedback_examples("sent")
    finally:
        plog.close()


def test_wrong_or_missing_token_is_refused_with_401(svc):
    _, one, _ = predict(svc, {"text": "很好"})
    body = {"request_id": one["request_id"], "label": "pos"}
    for headers in (None, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
        code, fb = feedback(svc, body, headers)
        assert code == 401 and fb["error"]["code"] == "unauthorized", headers
    # the admin key is a key of another scope: never taken on the inference
    # port, and answered as an unknown key is (no oracle for stolen keys)
    code, fb = feedback(svc, body, {"Authorization": f"Bearer {MGMT}"})
    assert code == 401 and fb["error"]["code"] == "unauthorized", fb
    plog = log_of(svc)
    try:
        assert not [r for r in plog.fed_back("sent") if r["request_id"] == one["request_id"]]
    finally:
        plog.close()
    assert feedback(svc, body)[0] == 200


def test_which_keys_the_older_token_settings_set(tmp_path, monkeypatch):
    """management.token is the admin key and feedback.token the feedback key
    (existing deployments keep working); auth.<name>_key and the environment
    win; a key under 32 characters is refused."""
    import pytest

    from state.keys import KeyError_, configured_keys

    for var in ("TEXTSWAP_MANAGEMENT_TOKEN", "TEXTSWAP_FEEDBACK_TOKEN", "TEXTSWAP_ADMIN_KEY",
                "TEXTSWAP_FEEDBACK_KEY", "TEXTSWAP_REVIEW_KEY", "TEXTSWAP_PREDICT_KEY"):
        monkeypatch.delenv(var, raising=False)
    assert configured_keys(load_config(None)) == {}  # a default local install: the key file
    f, m, a = "f" * 32, "m" * 32, "a" * 32
    both = {"feedback": {"token": f}, "management": {"token": m}}
    assert configured_keys(load_config(None, both)) == {"admin": m, "feedback": f}
    assert configured_keys(load_config(None, {**both, "auth": {"admin_key": a}}))["admin"] == a
    monkeypatch.setenv("TEXTSWAP_FEEDBACK_TOKEN", "e" * 32)
    assert configured_keys(load_config(None, both))["feedback"] == "e" * 32
    with pytest.raises(KeyError_, match="at least 32"):
        configured_keys(load_config(None, {"management": {"token": "short"}}))


def test_a_feedback_flood_is_answered_and_stored_whole(svc):
    texts = [f"很好 {i}" for i in range(40)]
    rids = []
    for i in range(0, 40, 20):
        _, batch, _ = predict(svc, {"texts": texts[i:i + 20]})
        rids.append(batch["request_id"])
    jobs = [(rid, i) for rid in rids for i in range(20)] * 3  # every label three times

    def send(job):
        rid, i = job
        return feedback(svc, {"request_id": rid, "index": i, "label": "neg" if i % 2 else "pos"})
    with concurrent.futures.ThreadPoolExecutor(24) as ex:
        answers = list(ex.map(send, jobs))
    assert all(code == 200 for code, _ in answers), [a for a in answers if a[0] != 200][:3]
    plog = log_of(svc)
    try:
        fed = [r for r in plog.fed_back("sent") if r["request_id"] in rids]
        assert len(fed) == 40  # each (request id, index) once: repeats replaced
        assert all(r["truth"] == ("neg" if r["index"] % 2 else "pos") for r in fed)
    finally:
        plog.close()
    assert svc.get("/healthz")[0] == 200


# -- the review queue --------------------------------------------------------------------------
def test_review_lists_unlabelled_predictions_uncertain_first(svc):
    _, batch, _ = predict(svc, {"texts": ["评审一号 好", "评审二号 差", "评审三号"]})
    code, body = mget(svc, "/models/sent/review?limit=1000")
    assert code == 200 and body["strategy"] == "uncertain"
    items = body["items"]
    margins = [i["margin"] for i in items]
    assert margins == sorted(margins)
    mine = [i for i in items if i["request_id"] == batch["request_id"]]
    assert len(mine) == 3 and {"request_id", "index", "text", "label", "top"} <= set(mine[0])
    assert mine[0]["top"][0]["label"] == mine[0]["label"]
    feedback(svc, {"request_id": batch["request_id"], "index": 0, "label": "pos"})
    code, body = mget(svc, "/models/sent/review?limit=1000&strategy=random")
    left = [i for i in body["items"] if i["request_id"] == batch["request_id"]]
    assert code == 200 and sorted(i["index"] for i in left) == [1, 2]
    for path, status in (("/models/sent/review?limit=0", 400),
                         ("/models/sent/review?limit=x", 400),
                         ("/models/sent/review?strategy=best", 400),
                         ("/models/sent/review?color=red", 400),
                         ("/models/nosuch/review", 404)):
        code, body = mget(svc, path)
        assert code == status and body["error"]["message"], path


# -- the command line ---------------------------------------------------------------------------
def _cli(svc: Service, *args: str):
    import subprocess
    import sys
    env = {**os.environ, "TEXTSWAP_URL": f"http://127.0.0.1:{svc.mport}",
           "TEXTSWAP_PREDICT_URL": f"http://127.0.0.1:{svc.port}",
           "TEXTSWAP_MANAGEMENT_TOKEN": MGMT, "TEXTSWAP_FEEDBACK_TOKEN": TOKEN}
    return subprocess.run([sys.executable, "-m", "textswap_cli", *args], capture_output=True,
                          text=True, env=env, timeout=120)


def test_cli_review_export_then_feedback_file(svc, tmp_path):
    import csv
    _, batch, _ = predict(svc, {"texts": ["命令行 一", "命令行 二"]})
    rid = batch["request_id"]
    out = _cli(svc, "review", "sent", "--limit", "1000", "--export", str(tmp_path / "q.csv"))
    assert out.returncode == 0, out.stderr
    with open(tmp_path / "q.csv", encoding="utf-8", newline="") as fh:
        rows = list(csv.DictReader(fh))
    mine = [r for r in rows if r["request_id"] == rid]
    assert len(mine) == 2 and all(r["label"] == "" and r["predicted"] for r in mine)
    for r in rows:  # label only this request's rows; the others stay blank (skipped)
        if r["request_id"] == rid:
            r["label"] = "pos" if r["index"] == "0" else "angry"
    with open(tmp_path / "q.csv", "w", encoding="utf-8", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    out = _cli(svc, "--json", "feedback", "--file", str(tmp_path / "q.csv"))
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"stored": 2, "new_labels": ["angry"], "failed": []}
    out = _cli(svc, "--json", "feedback", rid, "neg", "--index", "1")
    assert out.returncode == 0 and json.loads(out.stdout)["label"] == "neg", out.stderr
    out = _cli(svc, "feedback", "no-such-request", "pos")
    assert out.returncode != 0 and "404" in out.stderr
    out = _cli(svc, "--json", "policy", "sent", "--retrain-after", "1000", "--apply", "none")
    assert out.returncode == 0 and json.loads(out.stdout)["policy"]["apply"] == "none"
    assert _cli(svc, "policy", "sent", "--delete").returncode == 0


# -- a restart ----------------------------------------------------------------------------------
def test_a_restart_loses_nothing_logged_or_fed_back(own_svc):
    svc = own_svc
    _, before, _ = predict(svc, {"texts": ["重启前 好", "重启前 差"]})
    rid = before["request_id"]
    assert feedback(svc, {"request_id": rid, "index": 0, "label": "pos"})[0] == 200
    rids = [predict(svc, {"text": f"重启 {i}"})[1]["request_id"] for i in range(30)]
    root, cfg = svc.models_dir, svc.cfg
    assert svc.stop(signal.SIGTERM) == 0
    again = Service(root, args=["--config", cfg])
    try:
        plog = log_of(again)
        try:
            assert all(plog.get(r) for r in rids)  # every answered prediction was logged
            assert [r["truth"] for r in plog.fed_back("sent") if r["request_id"] == rid] == ["pos"]
        finally:
            plog.close()
        wait_for(lambda: again.get("/readyz")[0] == 200, 90, "sent serving again")
        # feedback on a prediction made before the restart
        code, fb = feedback(again, {"request_id": rid, "index": 1, "label": "neg"})
        assert code == 200 and fb["predicted"] == before["predictions"][1]["label"]
    finally:
        again.stop()


def test_a_reused_client_id_is_refused_and_never_replaces_the_logged_answer(svc):
    """A client that sends its X-Request-Id again (someone who learnt the id,
    or a retry of an answered request) gets 409 request_id_taken; nothing is
    logged, and the answer feedback refers to stays the one logged first."""
    rid = "reused-" + os.urandom(6).hex()
    code, first, _ = predict(svc, {"texts": ["非常好用", "很好"]}, {"X-Request-Id": rid})
    assert code == 200
    wait_for(lambda: len(log_of(svc).get(rid)) == 2, 30, "the first answer logged")
    refused = [f"重复{rid}-{i}" for i in range(3)]  # texts no other test sends
    code, again, headers = predict(svc, {"texts": refused}, {"X-Request-Id": rid})
    assert code == 409 and again["error"]["code"] == "request_id_taken", again
    assert rid in again["error"]["message"]
    # a request after it is logged (the log is written in order): the refused
    # one never was, under any id
    code, nxt, _ = predict(svc, {"texts": ["一", "二", "三", "四"]})
    assert code == 200
    wait_for(lambda: len(log_of(svc).get(nxt["request_id"])) == 4, 30, "the next answer logged")
    assert _store_holds(svc, f"重复{rid}") == []
    rows = log_of(svc).get(rid)
    assert [r["text"] for r in rows] == ["非常好用", "很好"]
    assert [r["label"] for r in rows] == [p["label"] for p in first["predictions"]]
    code, fb = feedback(svc, {"request_id": rid, "index": 1, "label": "pos"})
    assert code == 200 and fb["stored"] == 1, fb
    code, fb = feedback(svc, {"request_id": rid, "index": 2, "label": "neg"})
    assert code == 404, fb


def _store_holds(svc: Service, needle: str) -> list[str]:
    """The files of the model store whose bytes hold `needle` (the log, its WAL)."""
    found = []
    for dirpath, _dirs, files in os.walk(svc.models_dir):
        for fn in files:
            with open(os.path.join(dirpath, fn), "rb") as fh:
                if needle.encode() in fh.read():
                    found.append(os.path.join(dirpath, fn))
    return found


def test_delete_a_request_erases_its_texts_from_every_file(svc):
    secret = "擦除" + os.urandom(4).hex()
    code, body, headers = predict(svc, {"texts": [secret, "很好"]})
    rid = headers["X-Request-Id"]
    code, fb = feedback(svc, {"request_id": rid, "index": 0, "label": "neg"})
    assert code == 200 and fb["stored"] == 1, fb
    assert _store_holds(svc, secret), "the text is in the log before"
    mgmt = {"Authorization": f"Bearer {MGMT}"}
    code, got = request(svc.mport, "DELETE", f"/predictions/{rid}", headers=mgmt)
    assert code == 200 and got == {"request_id": rid, "removed": {
        "predictions": 2, "feedback": 1, "examples": 0},
        "copies": {"holdout": 0, "data_copy": 0}}, got
    assert log_of(svc).get(rid) == []
    assert _store_holds(svc, secret) == []  # the database and its WAL: zeroed, truncated
    code, fb = feedback(svc, {"request_id": rid, "index": 0, "label": "neg"})
    assert code == 404, fb  # nothing left to label
    code, hist = mget(svc, "/history?limit=5")
    assert any(h["kind"] == "erase" and h["details"]["request_id"] == rid
               for h in hist["history"]), hist
    code, got = request(svc.mport, "DELETE", "/predictions/bad%20id", headers=mgmt)
    assert code == 400 and got["error"]["code"] == "invalid_request_id", got
    code, got = request(svc.mport, "DELETE", f"/predictions/{rid}", auth=False)
    assert code == 401  # the admin key


def test_delete_a_models_predictions_purges_its_log(svc):
    code, body, headers = predict(svc, {"texts": ["清空 一", "清空 二"], "model": "sent"})
    assert code == 200
    mgmt = {"Authorization": f"Bearer {MGMT}"}
    code, got = request(svc.mport, "DELETE", "/models/sent/predictions", headers=mgmt)
    assert code == 200 and got["model"] == "sent" and got["removed"]["predictions"] >= 2, got
    assert log_of(svc).recent("sent") == []
    assert _store_holds(svc, "清空 一") == []
    code, got = request(svc.mport, "DELETE", "/models/..bad/predictions", headers=mgmt)
    assert code == 400, got
