"""Scores shared by the benches: accuracy, macro-F1 and expected calibration error.

Plain NumPy on label indices (0..k-1) so that every model, ours or a baseline, is scored
by the same code.
"""

from __future__ import annotations

import numpy as np

ECE_BINS = 15


def accuracy(y_true: np.ndarray, y_pred: np.ndarray) -> float:
    return float(np.mean(np.asarray(y_true) == np.asarray(y_pred))) if len(y_true) else 0.0


def macro_f1(y_true: np.ndarray, y_pred: np.ndarray, n_labels: int) -> float:
    """Unweighted mean of per-label F1 over all `n_labels` labels (a label never
    predicted and never present would count 0, but the bench's test splits hold every label)."""
    y_true, y_pred = np.asarray(y_true), np.asarray(y_pred)
    f1s = []
    for label in range(n_labels):
        tp = int(np.sum((y_pred == label) & (y_true == label)))
        predicted = int(np.sum(y_pred == label))
        support = int(np.sum(y_true == label))
        precision = tp / predicted if predicted else 0.0
        recall = tp / support if support else 0.0
        f1s.append(2 * precision * recall / (precision + recall) if precision + recall else 0.0)
    return float(np.mean(f1s))


def expected_calibration_error(probs: np.ndarray, y_true: np.ndarray, bins: int = ECE_BINS) -> float:
    """ECE of the top score: texts binned by their highest probability into `bins` equal-width
    bins over [0, 1]; the mean |accuracy - mean confidence| of the bins, weighted by bin size.

    0 means a score of 0.8 is right 80 % of the time; users threshold on that score.
    """
    probs = np.asarray(probs, dtype="float64")
    y_true = np.asarray(y_true)
    if not len(y_true):
        return 0.0
    confidence = probs.max(axis=1)
    correct = probs.argmax(axis=1) == y_true
    # Bin i holds (i/bins, (i+1)/bins]; a confidence of exactly 0 goes to the first bin.
    which = np.clip(np.ceil(confidence * bins).astype(int) - 1, 0, bins - 1)
    ece = 0.0
    for b in range(bins):
        in_bin = which == b
        if in_bin.any():
            ece += in_bin.mean() * abs(correct[in_bin].mean() - confidence[in_bin].mean())
    return float(ece)
