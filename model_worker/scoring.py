"""The serving call path and the evaluation figures, shared by the trainers.

`make_predict_fn` is how every process (worker, trainer, bench) calls a
model; `classification_metrics` is what every training reports. Below
textmodel and autoselect, so neither imports the other for these.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import keras
import numpy as np
import tensorflow as tf

# --------------------------------------------------------------------------
# Evaluation
# --------------------------------------------------------------------------

def predict_proba(predict_fn: Callable[[list[str]], np.ndarray], texts: list[str],
                  batch_size: int = 1024) -> np.ndarray:
    """Probabilities for many texts in large batches through the serving path."""
    chunks = [predict_fn(texts[i:i + batch_size]) for i in range(0, len(texts), batch_size)]
    return np.concatenate(chunks) if chunks else np.zeros((0, 0), dtype="float32")


def classification_metrics(y_true: np.ndarray, y_pred: np.ndarray, labels: list[str]) -> dict[str, Any]:
    """accuracy, macro_f1 and per-label precision/recall/f1/support."""
    per_label = {}
    f1s = []
    for i, name in enumerate(labels):
        tp = int(np.sum((y_pred == i) & (y_true == i)))
        predicted = int(np.sum(y_pred == i))
        support = int(np.sum(y_true == i))
        precision = tp / predicted if predicted else 0.0
        recall = tp / support if support else 0.0
        f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
        per_label[name] = {"precision": round(precision, 4), "recall": round(recall, 4),
                           "f1": round(f1, 4), "support": support}
        f1s.append(f1)
    accuracy = float(np.mean(y_pred == y_true)) if len(y_true) else 0.0
    return {"accuracy": round(accuracy, 4), "macro_f1": round(float(np.mean(f1s)), 4),
            "per_label": per_label}


def evaluate(predict_fn: Callable[[list[str]], np.ndarray], texts: list[str], y: np.ndarray, labels: list[str]) -> dict[str, Any]:
    if not texts:
        return classification_metrics(np.zeros(0, int), np.zeros(0, int), labels)
    probs = predict_proba(predict_fn, texts)
    return classification_metrics(np.asarray(y), probs.argmax(axis=1), labels)


# --------------------------------------------------------------------------
# Serving call path
# --------------------------------------------------------------------------

def make_predict_fn(model: keras.Model) -> Callable[[list[str]], np.ndarray]:
    """The fastest measured way to call `model` on a list of strings.

    A tf.function with a fixed input signature: one trace for every batch
    size (the shape is [None]), then graph execution without Keras'
    per-call Python overhead. model.predict costs ~100 ms a call building
    a dataset and a step function; eager model(x) re-runs the Python layer
    code each time. Numbers: `bench/accuracy.py --speed`.

    Traced without AutoGraph: the layers' calls hold no Python control flow
    on tensors, and AutoGraph's conversion of the call path left about 16 MB
    of private pages in every serving worker (bench/worker_memory.py); the
    graph, and so every score, is the same.
    """
    @tf.function(input_signature=[tf.TensorSpec([None], tf.string)], autograph=False)
    def serve(texts: tf.Tensor) -> tf.Tensor:
        return model(texts, training=False)

    # calling the traced graph directly skips tf.function's per-call
    # argument matching (~1 ms of a 3-4 ms single-text call)
    concrete = serve.get_concrete_function()

    def predict(texts: list[str]) -> np.ndarray:
        if not texts:
            return np.zeros((0, model.output_shape[-1]), dtype="float32")
        return concrete(tf.constant(texts, dtype=tf.string)).numpy()

    predict.model = model  # type: ignore[attr-defined]  # a function attribute; for what else is asked of it (model_worker/explain.py)
    return predict


# Thresholds of the risk-coverage table: 0.5, 0.55, ..., 0.95.
RISK_THRESHOLDS = tuple(round(0.5 + 0.05 * i, 2) for i in range(10))


def risk_coverage(probs: np.ndarray, y: np.ndarray, thresholds: Iterable[float] = RISK_THRESHOLDS) -> list[dict[str, Any]]:
    """Rows {"threshold", "coverage", "accuracy", "answered"}: answering only
    when the top score is at least the threshold (below it the service
    abstains, see /predict `min_score`), the share of texts answered and the
    accuracy on those. accuracy is None when nothing is answered."""
    probs, y = np.asarray(probs), np.asarray(y)
    top, correct = probs.max(axis=1), probs.argmax(axis=1) == y
    rows = []
    for t in thresholds:
        answered = top >= t
        n = int(answered.sum())
        rows.append({"threshold": float(t), "coverage": round(n / max(1, len(y)), 4),
                     "accuracy": round(float(correct[answered].mean()), 4) if n else None,
                     "answered": n})
    return rows
