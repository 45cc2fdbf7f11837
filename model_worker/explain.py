"""Exact explanations of auto's linear models: which n-grams made the label.

A linear member's logit for label c is a sum over the views' weighted bags:

    z_c = sum_v sum_j x_vj * K_v[j, c] + b_c

where x_vj is n-gram j's value after TermWeighting ((1 + log tf) * idf, unit
L2 row) and K_v the SparseLinear kernel (already divided by the member's
temperature, NB-SVM's ratios folded in). So each n-gram's contribution is
x_vj * K_v[j, c], exactly, and the contributions plus the bias are the
logit. The pretrained view (a dense mean word vector p, kernel block K_p)
adds p . K_p[:, c] to the logit; p is a scaled sum of the known words'
subword-vector sums, so that part splits exactly by word: each word is
reported with view "pretrained", value = its occurrences, weight = one
occurrence's contribution (see Explainer._pretrained_terms). An ensemble of M members averages the members' probabilities; its
explanation averages their contributions, biases and logits with the same
weights (1/M each), so the sum property holds for the averaged logit.

`bow` and `cnn` models answer `cannot_explain` (a 422). cnn has no
additive decomposition: a gradient method (saliency, integrated gradients)
would only approximate, cost several model calls per text, and promise a
precision it does not have. bow's Dense layer on its bag is linear too, so
the same exact arithmetic would apply; it is not wired up here, since bow is
no longer the default and its layers are named differently (left for later).

Explanations are asked for per request; nothing here runs otherwise. The
explaining graph is built on the first request that asks (same layers,
same variables, one more output per view).
"""
from __future__ import annotations

from typing import Any

import keras
import numpy as np
import tensorflow as tf

from model_worker import layers


class CannotExplain(Exception):
    """The model has no exact additive explanation."""


def _vocabulary(vec: Any) -> list[str]:
    if isinstance(vec, layers.CharNgramCounts):
        return ["[UNK]", *vec.get_vocabulary()]
    return list(vec.get_vocabulary())


class Explainer:
    """The bags and logits of a linear auto model, and the arithmetic above."""

    def __init__(self, model: keras.Model) -> None:
        linear = [lay for lay in model.layers if isinstance(lay, (layers.SparseLinear, layers.PretrainedLogits))]
        if model is None or not linear:
            raise CannotExplain(
                "this model cannot explain its predictions exactly: only the linear models of "
                "architecture 'auto' can (bow and cnn cannot)")
        self.views: list[str] = []
        self.vocab: list[list[str]] = []
        self.kernels: list[np.ndarray] = []
        self.dense: dict[int, Any] = {}  # bag index -> the PretrainedEmbedding or PretrainedLogits layer
        bags: list[Any] = []
        n_units = linear[0].units
        for lay in linear:
            view = lay.name.removeprefix("logits_")
            self.views.append(view)
            if isinstance(lay, layers.PretrainedLogits):  # the view and its kernel in one table
                self.vocab.append(lay.lookup.get_vocabulary())
                self.dense[len(bags)] = lay
                bags.append(lay.input)
                self.kernels.append(np.zeros((0, n_units)))  # in the table
                continue
            vec = model.get_layer(f"vectorizer_{view}")
            if isinstance(vec, layers.PretrainedEmbedding):
                # the pretrained view: its input texts; split into words in __call__
                self.vocab.append(vec.lookup.get_vocabulary())
                self.dense[len(bags)] = vec
                bags.append(vec.input)
            else:
                self.vocab.append(_vocabulary(vec))
                bags.append(model.get_layer(f"weighting_{view}").output)
            self.kernels.append(np.concatenate([k.numpy() for k in lay.kernels], axis=1))
        bias = next(lay.bias.numpy() for lay in linear if lay.bias is not None)
        self.n_labels = int(model.output.shape[-1])
        self.members = n_units // self.n_labels
        m, n = self.members, self.n_labels
        # the members' average, per label: what an explanation reports
        self.kernels = [k.reshape(k.shape[0], m, n).mean(axis=1) for k in self.kernels]
        self.bias = bias.reshape(m, n).mean(axis=0)
        total = model.get_layer("logits").output if len(linear) > 1 else linear[0].output
        graph = keras.Model(model.inputs, [*bags, total, model.output])

        @tf.function(input_signature=[tf.TensorSpec([None], tf.string)])
        def run(texts: tf.Tensor) -> Any:
            return graph(texts, training=False)

        self._run = run.get_concrete_function()

    def __call__(self, texts: list[str], k: int, best: np.ndarray | None = None
                 ) -> tuple[np.ndarray, list[dict[str, Any]]]:
        """(probabilities as the model serves them, one explanation per text:
        of its label `best`, else of the label the model scores highest)."""
        out = self._run(tf.constant(texts, dtype=tf.string))
        bags, total, probs = out[:-2], out[-2].numpy(), out[-1].numpy()
        logits = total.reshape(len(texts), self.members, self.n_labels).mean(axis=1)
        n = len(texts)
        if best is None:
            best = probs.argmax(axis=1)
        # every (text, n-gram) entry of every view at once, as flat arrays: the
        # per-text work is then only the k entries shown (batches stay cheap)
        parts: list[tuple[np.ndarray, ...]] = []
        # the words of a view that add their pieces (col -1 - k: the k-th)
        pieced: dict[int, list[str]] = {}
        for v, bag in enumerate(bags):
            if v in self.dense:
                *part, pieced[v] = self._pretrained_terms(v, bag, best, n)
                parts.append(tuple(part))
                continue
            idx = bag.indices.numpy()
            vals = bag.values.numpy().astype(np.float64)
            # entries that weigh nothing (an unknown word's "[UNK]" column,
            # its idf 0) contribute nothing and are no feature of the text
            weighs = vals != 0
            idx, vals = idx[weighs], vals[weighs]
            rows, cols = idx[:, 0], idx[:, 1]
            weights = self.kernels[v][cols, best[rows]].astype(np.float64)
            parts.append((rows, np.full(len(rows), v), cols, vals, weights, vals * weights))
        rows, view, col, val, wt, con = (np.concatenate([p[i] for p in parts]) if parts
                                         else np.zeros(0) for i in range(6))
        order = np.lexsort((col, view, -con, rows))  # by text, then largest contribution
        rows, view, col, val, wt, con = (a[order] for a in (rows, view, col, val, wt, con))
        totals = np.bincount(rows.astype(np.int64), weights=con, minlength=n) if len(rows) \
            else np.zeros(n)
        starts = np.searchsorted(rows, np.arange(n), side="left")
        ends = np.searchsorted(rows, np.arange(n), side="right")
        explained = []
        for i in range(n):
            c = int(best[i])
            a, b = int(starts[i]), int(min(ends[i], starts[i] + k))
            shown = [{"ngram": self.vocab[int(view[e])][int(col[e])] if col[e] >= 0
                      else pieced[int(view[e])][-1 - int(col[e])],
                      "view": self.views[int(view[e])], "value": round(float(val[e]), 6),
                      "weight": round(float(wt[e]), 6), "contribution": round(float(con[e]), 6)}
                     for e in range(a, b)]
            explained.append({
                "label_index": c,
                "logit": round(float(logits[i, c]), 6),
                "bias": round(float(self.bias[c]), 6),
                "features": shown,
                # the n-grams not listed, summed: listed + others + bias = logit
                "others": round(float(totals[i] - con[a:b].sum()), 6),
            })
        return probs, explained


    def _pretrained_terms(self, v: int, texts: Any, best: np.ndarray, n: int) -> tuple[Any, ...]:
        """The pretrained view's part, word by word, exactly: its vector is
        f * sum_w s_w (s_w: the sum of word w's subword vectors, f = 1 / the
        text's known subwords, times scale / the mean's norm when scaled), so
        its logit p . K[:, c] is sum_w occurrences of w * f * (s_w . K[:, c]):
        value = occurrences, weight = f * s_w . K[:, c] (one occurrence's
        contribution). Unknown words add nothing. Without the per-text norm
        (`l2` false) f is scale / C; a PretrainedLogits table holds s_w . K
        itself (every member's columns). A word a PretrainedLogits table
        lacks in every form adds its pieces' rows (their count among the
        text's subwords): it is one feature, the word as written, its weight
        the sum of its pieces' rows; the last item returned lists those
        words (entry col -1 - k: the k-th)."""
        lay = self.dense[v]
        texts = tf.convert_to_tensor(texts, tf.string)
        if lay.standardize:
            texts = layers._STANDARDIZERS[lay.standardize](texts)
        words = tf.strings.split(texts)
        ids = lay.word_ids(words.flat_values).numpy().astype(np.int64)
        rows = words.value_rowids().numpy().astype(np.int64)
        sums, counts = lay.table_rows(ids)   # the rows of the text's words, in order
        known = np.bincount(rows, weights=counts, minlength=n)
        fused = isinstance(lay, layers.PretrainedLogits)  # rows hold s_w @ K already
        names: list[str] = []
        split: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        if fused and lay.pieces and (ids == 0).any():
            miss = np.flatnonzero(ids == 0)
            found = lay.piece_rows(tf.gather(words.flat_values, miss))
            lengths = found.row_lengths().numpy()
            known += np.bincount(rows[miss], weights=lengths, minlength=n)
            split = (miss, lengths, found.flat_values.numpy())
        f = 1.0 / np.maximum(known, 1.0)
        if lay.scale and (fused or not lay.l2):
            f = f * lay.scale
        elif lay.scale:
            total = np.zeros((n, sums.shape[1]))
            np.add.at(total, rows, sums)
            mean = total / np.maximum(known, 1.0)[:, None]
            f = f * lay.scale / np.maximum(np.linalg.norm(mean, axis=1), 1e-12)
        extra = None
        if split is not None:  # the words that add pieces: one entry per (text, word)
            miss, lengths, flat = split
            piece_sums, _ = lay.table_rows(flat)
            owner = np.repeat(np.arange(len(miss)), lengths)
            word_rows = np.zeros((len(miss), piece_sums.shape[1]))
            np.add.at(word_rows, owner, piece_sums)
            text = words.flat_values.numpy()
            index: dict[tuple[int, bytes], int] = {}
            first: list[int] = []
            occ_of: list[int] = []
            for k, j in enumerate(miss):
                if not lengths[k]:
                    continue
                key = (int(rows[j]), text[j])
                if key in index:
                    occ_of[index[key]] += 1
                    continue
                index[key] = len(first)
                first.append(k)
                occ_of.append(1)
                names.append(text[j].decode("utf-8"))
            if first:
                at = np.array(first, dtype=np.int64)
                e_rows = rows[miss[at]]
                per = word_rows[at].reshape(len(at), self.members, self.n_labels).mean(axis=1)
                e_w = f[e_rows] * per[np.arange(len(at)), best[e_rows]]
                e_val = np.array(occ_of, dtype=np.float64)
                extra = (e_rows, np.full(len(at), v), -1 - np.arange(len(at)), e_val, e_w, e_val * e_w)
        keep = ids > 0
        rows, ids = rows[keep], ids[keep]
        # one entry per (text, word): occurrences summed
        size = lay.vocabulary_size + 1
        cell, occ = np.unique(rows * size + ids, return_counts=True)
        rows, ids = cell // size, cell % size
        sums, _ = lay.table_rows(ids)
        if fused:  # the members' average of s_w @ K, for each entry's label
            per_label = sums.reshape(len(ids), self.members, self.n_labels).mean(axis=1)
            weights = f[rows] * per_label[np.arange(len(ids)), best[rows]]
        else:
            kernel = self.kernels[v].astype(np.float64)
            weights = f[rows] * (np.einsum("ed,de->e", sums, kernel[:, best[rows]]) if len(ids) else np.zeros(0))
        vals = occ.astype(np.float64)
        out: tuple[np.ndarray, ...] = (rows, np.full(len(rows), v), ids, vals, weights, vals * weights)
        if extra is not None:
            out = tuple(np.concatenate([a, b]) for a, b in zip(out, extra))
        return (*out, names)


def explainer_for(model: Any) -> Explainer:
    if not isinstance(model, keras.Model):
        raise CannotExplain("no model to explain")
    return Explainer(model)
