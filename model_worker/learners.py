"""Linear learners for the automatic search, reduced to (kernel, bias).

Every learner here ends as one linear map from the weighted bag to one
logit per label, which is what lets the winner become a single Keras
`SparseLinear` layer: logistic regression (softmax cross-entropy), a linear SVM
(squared hinge, one-vs-rest) and NB-SVM (the SVM on features scaled by
naive-Bayes log-count ratios; since (x * r_c) . w_c = x . (r_c * w_c), the
ratios fold into the kernel column of each label).

Binary problems give scikit-learn one decision value d; it becomes the two
logits (-d/2, d/2), whose softmax is sigmoid(d): the same probabilities.

Multi-label data (`fit_ovr`): one independent binary learner per label
(one-vs-rest), each column a label's logit, served through a sigmoid.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp
from sklearn.exceptions import ConvergenceWarning
from sklearn.linear_model import LogisticRegression
from sklearn.multiclass import OneVsRestClassifier
from sklearn.svm import LinearSVC

# Iteration caps: enough for unit-norm TF-IDF bags (they converge in tens
# of iterations); a capped fit is still a usable model, so the warning is
# silenced rather than turned into a failure.
_LR_MAX_ITER = 100
_SVM_MAX_ITER = 2000
# Up to this many labels "lr" is multinomial (softmax cross-entropy, saga);
# beyond, one-vs-rest logistic regression (liblinear), see fit().
_SOFTMAX_MAX_LABELS = 5
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


def _svm(c: float, seed: int, balanced: bool) -> LinearSVC:
    return LinearSVC(C=c, loss="squared_hinge", dual=True, max_iter=_SVM_MAX_ITER, random_state=seed,
                     class_weight="balanced" if balanced else None)


def nb_ratios(x: sp.csr_matrix, y: np.ndarray, n_labels: int) -> np.ndarray:
    """(n_labels, n_features): log((p / |p|_1) / (q / |q|_1)) per label, from
    binarized presence counts inside (p) and outside (q) the label."""
    present = sp.csr_matrix((np.ones_like(x.data), x.indices, x.indptr), shape=x.shape)
    onehot = sp.csr_matrix((np.ones(len(y)), (y, np.arange(len(y)))), shape=(n_labels, len(y)))
    inside = np.asarray((onehot @ present).todense())  # docs of each label holding each token
    outside = inside.sum(axis=0, keepdims=True) - inside
    inside += _NB_ALPHA
    outside += _NB_ALPHA
    return (np.log(inside / inside.sum(axis=1, keepdims=True))
            - np.log(outside / outside.sum(axis=1, keepdims=True)))


def _scale_columns(x: sp.csr_matrix, r: np.ndarray) -> sp.csr_matrix:
    """x * r per column, in O(nnz) without scipy's generic broadcasting."""
    return sp.csr_matrix((x.data * r[x.indices], x.indices, x.indptr), shape=x.shape)


def fit(learner: str, c: float, x: sp.csr_matrix, y: np.ndarray, n_labels: int, seed: int,
        balanced: bool = False) -> Linear:
    """Train one learner; returns its kernel (n_features, n_labels) and bias.

    `balanced` weighs each label inversely to its frequency (rare labels
    count as much as common ones, which is what macro-F1 rewards).
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        if learner == "lr":
            weight = "balanced" if balanced else None
            if n_labels <= _SOFTMAX_MAX_LABELS:
                # saga: softmax cross-entropy at a tenth of lbfgs' time on these
                # sparse bags for the same CV score (measured)
                model = LogisticRegression(C=c, solver="saga", max_iter=_LR_MAX_ITER, tol=1e-3,
                                           random_state=seed, class_weight=weight)
                model.fit(x, y)
            else:
                # many labels: saga's cost grows with the label count (it took
                # 60% of a 19-label search); one-vs-rest logistic loss in
                # liblinear's dual solver scored the same at a fraction of it
                model = OneVsRestClassifier(LogisticRegression(
                    C=c, solver="liblinear", dual=True, max_iter=_LR_MAX_ITER, random_state=seed,
                    class_weight=weight)).fit(x, y)
                coef = np.vstack([e.coef_ for e in model.estimators_])
                bias = np.concatenate([e.intercept_ for e in model.estimators_])
                return Linear(coef.T.copy(), bias)
            if n_labels == 2:
                return Linear(*_two_logits(model.coef_, model.intercept_))
            return Linear(model.coef_.T.copy(), model.intercept_.copy())
        if learner == "svm":
            model = _svm(c, seed, balanced).fit(x, y)
            if n_labels == 2:
                return Linear(*_two_logits(model.coef_, model.intercept_))
            return Linear(model.coef_.T.copy(), model.intercept_.copy())
        if learner == "nbsvm":
            targets = [1] if n_labels == 2 else range(n_labels)
            ratios = nb_ratios(x, y, n_labels)
            weights = None
            if balanced:
                counts = np.bincount(y, minlength=n_labels)
                weights = len(y) / (n_labels * counts[y])
            cols, biases = [], []
            for label in targets:
                r = ratios[label]
                model = _svm(c, seed, False).fit(_scale_columns(x, r), (y == label).astype(int),
                                                 sample_weight=weights)
                cols.append(model.coef_.reshape(-1) * r)
                biases.append(float(model.intercept_[0]))
            if n_labels == 2:
                return Linear(*_two_logits(cols[0], np.array(biases)))
            return Linear(np.stack(cols, axis=1), np.array(biases))
    raise ValueError(f"unknown learner {learner!r}")


# A label with no positive (or no negative) rows in a fold's training part
# gets a constant logit of this size: never (always) above any threshold.
_CONSTANT_LOGIT = 10.0


def fit_ovr(learner: str, c: float, x: sp.csr_matrix, y: np.ndarray, seed: int) -> Linear:
    """One-vs-rest for multi-label data: y is (n, n_labels) 0/1; one binary
    svm / lr / nbsvm per label (nbsvm's ratios from that label's rows)."""
    n_labels = y.shape[1]
    cols, biases = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        for j in range(n_labels):
            target = y[:, j].astype(int)
            positives = int(target.sum())
            if positives in (0, len(target)):
                cols.append(np.zeros(x.shape[1]))
                biases.append(_CONSTANT_LOGIT if positives else -_CONSTANT_LOGIT)
                continue
            if learner == "svm":
                model = _svm(c, seed, False).fit(x, target)
                cols.append(model.coef_.reshape(-1))
            elif learner == "lr":
                model = LogisticRegression(C=c, solver="liblinear", dual=True, max_iter=_LR_MAX_ITER,
                                           random_state=seed).fit(x, target)
                cols.append(model.coef_.reshape(-1))
            elif learner == "nbsvm":
                r = nb_ratios(x, target, 2)[1]
                model = _svm(c, seed, False).fit(_scale_columns(x, r), target)
                cols.append(model.coef_.reshape(-1) * r)
            else:
                raise ValueError(f"unknown learner {learner!r}")
            biases.append(float(model.intercept_[0]))
    return Linear(np.stack(cols, axis=1), np.array(biases))
