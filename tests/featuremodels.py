"""Builds real trained models for the abstain / explain / multi-label tests.

Run as a script in its own process (it imports TensorFlow, which the test
process must not):  python -m tests.featuremodels MODELS_DIR

- "lin": architecture auto on a small English topic set (a linear model,
  explainable);
- "bowm": architecture bow on the same texts (cannot explain);
published with the meta.json keys and the lean plan (model_worker/lean.py)
the trainer writes.
"""
from __future__ import annotations

import os
import sys


def publish(models_dir: str, name: str, result, params: dict, extra: dict | None = None,
            texts: list[str] | None = None) -> int:
    from model_worker import lean, textmodel
    from state.store import ModelStore

    store = ModelStore(models_dir)
    store.ensure()
    staged = store.staging_dir()
    result.model.save(os.path.join(staged, "model.keras"))
    serving = lean.export(result.model, staged, texts or [], textmodel.make_predict_fn(result.model))
    assert serving["engine"] == "lean", serving
    meta = {"labels": result.labels, "params": params, "metrics": result.metrics, "serving": serving,
            **(extra or {})}
    if result.report is not None:
        meta["report"] = result.report
    return store.publish(name, staged, meta)


def main(models_dir: str) -> None:
    from model_worker import textmodel
    from model_worker.params import validate_params
    from tests.test_autoselect import english

    texts, labels = english()
    # n-gram views only: the explanation and highlight tests read word n-grams
    # (tests/test_pretrained*.py cover the pretrained view)
    p = validate_params({"architecture": "auto", "time_budget_s": 20, "folds": 3,
                         "pretrained": False})
    publish(models_dir, "lin", textmodel.train_model(texts, labels, p), p, texts=texts)
    p = validate_params({**textmodel.TINY_PARAMS})
    publish(models_dir, "bowm", textmodel.train_model(texts, labels, p), p, texts=texts)


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    main(sys.argv[1])
    print("ok")
