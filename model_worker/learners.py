"""Linear learners for the automatic search, reduced to (kernel, bias).

Every learner here ends as one linear map from the weighted bag to one
logit per label, which is what lets the winner become a single Keras
`Dense` layer: logistic regression (softmax cross-entropy), a linear SVM
(squared hinge, one-vs-rest) and NB-SVM (the SVM on features scaled by
naive-Bayes log-count ratios; since (x * r_c) . w_c = x . (r_c * w_c), the
ratios fold into the kernel column of each label).

Binary problems give scikit-learn one decision value d; it becomes the two
logits (-d/2, d/2), whose softmax is sigmoid(d): the same probabilities.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp
from sklearn.exceptions import ConvergenceWarning
from sklearn.linear_model import LogisticRegression
from sklearn.svm import LinearSVC

# Iteration caps: enough for unit-norm TF-IDF bags (they converge in tens
# of iterations); a capped fit is still a usable model, so the warning is
# silenced rather than turned into a failure.
_LR_MAX_ITER = 100
_SVM_MAX_ITER = 2000
# Additive smoothing of the naive-Bayes document counts.
_NB_ALPHA = 1.0


@dataclass(frozen=True)
class Linear:
    kernel: np.ndarray  # (n_features, n_labels)
    bias: np.ndarray    # (n_labels,)

    def decision(self, x: sp.csr_matrix) -> np.ndarray:
        return np.asarray(x @ self.kernel) + self.bias


def _two_logits(coef: np.ndarray, intercept: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    w = coef.reshape(-1)
    b = float(np.ravel(intercept)[0])
    return np.stack([-w / 2, w / 2], axis=1), np.array([-b / 2, b / 2])


def _svm(c: float, seed: int) -> LinearSVC:
    return LinearSVC(C=c, loss="squared_hinge", dual=True, max_iter=_SVM_MAX_ITER, random_state=seed)


def nb_ratios(x: sp.csr_matrix, y: np.ndarray, label: int) -> np.ndarray:
    """log((p / |p|_1) / (q / |q|_1)) from binarized presence counts."""
    present = x.copy()
    present.data[:] = 1.0
    inside = np.asarray(present[y == label].sum(axis=0)).ravel() + _NB_ALPHA
    outside = np.asarray(present[y != label].sum(axis=0)).ravel() + _NB_ALPHA
    return np.log(inside / inside.sum()) - np.log(outside / outside.sum())


def fit(learner: str, c: float, x: sp.csr_matrix, y: np.ndarray, n_labels: int, seed: int) -> Linear:
    """Train one learner; returns its kernel (n_features, n_labels) and bias."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        if learner == "lr":
            # saga: softmax cross-entropy at a tenth of lbfgs' time on these
            # sparse bags for the same CV score (measured)
            model = LogisticRegression(C=c, solver="saga", max_iter=_LR_MAX_ITER, tol=1e-3,
                                       random_state=seed)
            model.fit(x, y)
            if n_labels == 2:
                return Linear(*_two_logits(model.coef_, model.intercept_))
            return Linear(model.coef_.T.copy(), model.intercept_.copy())
        if learner == "svm":
            model = _svm(c, seed).fit(x, y)
            if n_labels == 2:
                return Linear(*_two_logits(model.coef_, model.intercept_))
            return Linear(model.coef_.T.copy(), model.intercept_.copy())
        if learner == "nbsvm":
            targets = [1] if n_labels == 2 else range(n_labels)
            cols, biases = [], []
            for label in targets:
                r = nb_ratios(x, y, label)
                model = _svm(c, seed).fit(sp.csr_matrix(x.multiply(r)), (y == label).astype(int))
                cols.append(model.coef_.reshape(-1) * r)
                biases.append(float(model.intercept_[0]))
            if n_labels == 2:
                return Linear(*_two_logits(cols[0], np.array(biases)))
            return Linear(np.stack(cols, axis=1), np.array(biases))
    raise ValueError(f"unknown learner {learner!r}")
