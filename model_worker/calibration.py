"""Temperature scaling and calibration error, on out-of-fold decision values.

Users threshold on the top score, so the softmax of the served logits should
mean what it says. One temperature T (probabilities softmax(z / T)) is fitted
by minimising the negative log-likelihood of the out-of-fold predictions:
a single scalar cannot overfit, keeps the ranking (and so accuracy and F1)
unchanged, and folds into the final linear layer's kernel and bias.
"""

from __future__ import annotations

import numpy as np
from scipy.optimize import minimize_scalar

ECE_BINS = 15
# log-temperature search interval: T in [e^-5, e^5] covers SVM margins
# (often too confident once scaled) and averaged ensembles alike
_LOG_T_BOUNDS = (-5.0, 5.0)


def softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


def nll(probs: np.ndarray, y: np.ndarray) -> float:
    return float(-np.mean(np.log(np.clip(probs[np.arange(len(y)), y], 1e-12, 1.0))))


def fit_temperature(logits: np.ndarray, y: np.ndarray) -> float:
    """The T > 0 minimising NLL of softmax(logits / T)."""
    def loss(log_t: float) -> float:
        return nll(softmax(logits / np.exp(log_t)), y)
    res = minimize_scalar(loss, bounds=_LOG_T_BOUNDS, method="bounded", options={"xatol": 1e-4})
    if res.x > _LOG_T_BOUNDS[0] + 1e-2:
        return float(np.exp(res.x))
    # The likelihood keeps growing as T -> 0: the out-of-fold predictions
    # separate the labels perfectly (small sets; the pretrained view on an easy
    # topic set), and the bound, not the data, would set T (top scores of
    # exactly 1.0 in float32, even for a text with no known word). Take the
    # T at which no out-of-fold top score exceeds Laplace's (n + 1) / (n + 2)
    # instead: what n correct answers out of n support.
    n = len(y)
    target = (n + 1) / (n + 2)
    lo, hi = _LOG_T_BOUNDS
    for _ in range(60):  # the top scores fall as T grows
        mid = (lo + hi) / 2
        if softmax(logits / np.exp(mid)).max() > target:
            lo = mid
        else:
            hi = mid
    return float(np.exp(max(hi, res.x)))


def ece(probs: np.ndarray, y: np.ndarray, bins: int = ECE_BINS) -> float:
    """Top-label expected calibration error with equal-width confidence bins."""
    conf = probs.max(axis=1)
    correct = probs.argmax(axis=1) == y
    edges = np.linspace(0.0, 1.0, bins + 1)
    total = 0.0
    for lo, hi in zip(edges[:-1], edges[1:]):
        inside = (conf > lo) & (conf <= hi)
        if inside.any():
            total += inside.mean() * abs(conf[inside].mean() - correct[inside].mean())
    return float(total)
