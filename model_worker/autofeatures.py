"""Views of a text for the automatic model search, computed with TF ops.

A *view* is one way of turning a text into a bag of tokens: word 1-2-grams,
character n-grams inside words, ... The trainer builds SciPy sparse count
matrices from the very same TensorFlow string ops that the served model's
`TextVectorization` layer runs, so the tokens scikit-learn trained on and
the tokens the model sees at serving time are identical by construction.

Tokens are identified by their 64-bit fingerprint while counting (fast
NumPy integer work instead of Python dictionaries of strings); the strings
are kept only for the vocabulary that is finally chosen.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

import keras
import numpy as np
import scipy.sparse as sp
import tensorflow as tf

from model_worker import layers

# Texts per TensorFlow call while tokenizing.
_BATCH = 1024
_HASH_BUCKETS = 2**63 - 1


@dataclass(frozen=True)
class View:
    """How one TextVectorization branch tokenizes (and how we mirror it)."""

    name: str
    standardize: str            # key of layers._STANDARDIZERS
    split: Callable[..., Any] | str       # "whitespace" or a registered split function
    ngrams: tuple[int, ...] | None

    def tokens(self, texts: tf.Tensor) -> tf.RaggedTensor:
        """Exactly TextVectorization._preprocess for this configuration."""
        x = layers._STANDARDIZERS[self.standardize](texts)
        x = tf.strings.split(x) if self.split == "whitespace" else self.split(x)  # type: ignore[operator]  # a function
        if self.ngrams is not None:
            x = tf.strings.ngrams(x, ngram_width=self.ngrams, separator=" ")
        return x


def views_for(tokenize: str) -> dict[str, View]:
    """The single views the search may combine, for this script family.

    "word": whitespace tokens (CJK text is spaced out per character by the
    "char" standardizer, so there it means character 1-2-grams across the
    text) as 1-2-grams. "char": character n-grams inside words, 2-5 for
    Latin scripts, 1-3 for CJK runs (which the word standardizer keeps whole).
    "punct": the char view's n-grams with punctuation and symbols kept, inside
    whitespace-separated tokens (lowercased only): for texts whose signal
    lies partly in "%s", "--option", "E123:", emoticons.
    """
    if tokenize == "char":
        return {"word": View("word", "char", "whitespace", (1, 2)),
                "char": View("char", "word", layers.split_char_1_3, None),
                "punct": View("punct", "lower", layers.split_char_1_3, None)}
    return {"word": View("word", "word", "whitespace", (1, 2)),
            "char": View("char", "word", layers.split_char_2_5, None),
            "punct": View("punct", "lower", layers.split_char_2_5, None)}


@dataclass
class Counts:
    """Raw token counts of the training texts for one view."""

    matrix: sp.csr_matrix   # (n_texts, n_vocab) float64 counts
    vocabulary: list[str]   # column j <-> vocabulary[j]


def _first_places(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """np.unique(values, return_index=True): the distinct values and the
    first place of each, through one stable argsort."""
    order = np.argsort(values, kind="stable")
    ordered = values[order]
    new = np.empty(len(ordered), dtype=bool)
    new[:1] = True
    np.not_equal(ordered[1:], ordered[:-1], out=new[1:])
    return ordered[new], order[new]


def count_matrix(view: View, texts: list[str], max_tokens: int) -> Counts:
    """Counts of the `max_tokens` most document-frequent tokens of `texts`.

    Ties in document frequency are broken by the fingerprint, so the
    vocabulary depends only on the set of texts, not on their order.

    Batch by batch: each batch's tokens counted against the batch's own
    distinct fingerprints, whose columns then map to the distinct
    fingerprints of all batches (both sorted: the map keeps each row's
    columns in order). No array holds every token of every text: on 4,666
    texts (6.4 million character n-grams), np.unique over all of them and
    the arrays that held them took most of the 8 s this took.
    """
    parts, seen_hash, seen_text = [], [], []
    for start in range(0, len(texts), _BATCH):
        batch = texts[start:start + _BATCH]
        ragged = view.tokens(tf.constant(batch))
        flat = ragged.flat_values
        h = tf.strings.to_hash_bucket_fast(flat, _HASH_BUCKETS).numpy()
        uniq, first = _first_places(h)
        seen_hash.append(uniq)
        seen_text.append(tf.gather(flat, first).numpy())
        part = sp.csr_matrix((np.ones(len(h)), (ragged.value_rowids().numpy(), np.searchsorted(uniq, h))),
                             shape=(len(batch), len(uniq)))
        part.sum_duplicates()
        parts.append(part)
    # every batch's distinct fingerprints, and where each is first seen
    # (the strings of the kept ones, below)
    uniq, first = _first_places(np.concatenate(seen_hash)) if seen_hash else (np.zeros(0, np.int64),) * 2
    counts = sp.vstack([sp.csr_matrix((p.data, np.searchsorted(uniq, u)[p.indices], p.indptr),
                                      shape=(p.shape[0], len(uniq))) for p, u in zip(parts, seen_hash)],
                       format="csr") if parts else sp.csr_matrix((0, 0))
    df = np.bincount(counts.indices, minlength=len(uniq))  # each text's token once: summed above
    # most document-frequent first; lexsort's last key is the primary one
    order = np.lexsort((uniq, -df))[:max_tokens]
    order.sort()  # keep column order = fingerprint order (cheap slicing)
    # strings for the kept fingerprints, from the per-batch first sightings
    # (the union of the per-batch first sightings is exactly `uniq`)
    if not len(order):
        raise ValueError("training texts contain no tokens")
    strings = np.concatenate(seen_text)[first]
    vocab = [s.decode("utf-8") for s in strings[order]]
    return Counts(counts[:, order].tocsr(), vocab)


def idf_weights(counts: sp.csr_matrix) -> np.ndarray:
    """Smoothed inverse document frequency, as scikit-learn's TfidfTransformer."""
    n = counts.shape[0]
    df = np.bincount(counts.indices, minlength=counts.shape[1])
    return np.log((1.0 + n) / (1.0 + df)) + 1.0


def weighted(view: Any, counts: sp.csr_matrix, idf: np.ndarray) -> sp.csr_matrix:
    """A view's features as the graph weighs them: TF-IDF bags, or a dense
    view's own values (the pretrained view: no IDF)."""
    return counts if getattr(view, "dense", False) else weigh(counts, idf)


def weigh(counts: sp.csr_matrix, idf: np.ndarray) -> sp.csr_matrix:
    """(1 + log tf) * idf, each row scaled to unit L2 norm: TermWeighting's math."""
    x = counts.copy()
    x.data = (1.0 + np.log(x.data)) * idf[x.indices]
    norms = np.sqrt(np.asarray(x.multiply(x).sum(axis=1)).ravel())
    norms[norms == 0] = 1.0
    return sp.csr_matrix(sp.diags(1.0 / norms) @ x)


# --------------------------------------------------------------------------
# The served graph
# --------------------------------------------------------------------------

def branch(view: View, vocabulary: list[str], idf: np.ndarray, text_input: Any,
           standardized: bool = False) -> keras.KerasTensor:
    """Sparse counts -> TermWeighting for one view.

    Counts come from TextVectorization, or for character n-grams from
    layers.CharNgramCounts: the same counts without building n-gram
    strings (the char view cost ~3x more than the word view through
    TextVectorization; `bench/autoserve.py` measures the served model).
    Its tables need the vocabulary's characters to pack into 64 bits
    (at most 4,094 distinct characters for 2-5-grams); a vocabulary with
    more keeps TextVectorization. `standardized`: `text_input` is already
    standardized the view's way (a shared layers.Standardize).
    """
    if getattr(view, "dense", False):  # the pretrained view (model_worker.pretrained)
        return view.layer(standardized)(text_input)  # type: ignore[attr-defined]  # a dense view has layer()
    widths = layers.CHAR_SPLIT_WIDTHS.get(view.split)
    if widths is not None and view.ngrams is None and layers.CharNgramCounts.fits(vocabulary, widths[0]):
        vec = layers.CharNgramCounts(widths[0], widths[1], None if standardized else view.standardize,
                                        vocabulary, name=f"vectorizer_{view.name}")
    else:
        vec = keras.layers.TextVectorization(
            max_tokens=len(vocabulary) + 1,
            standardize=None if standardized else layers._STANDARDIZERS[view.standardize],
            split=view.split, ngrams=view.ngrams, output_mode="count", sparse=True,
            name=f"vectorizer_{view.name}")
        vec.set_vocabulary(vocabulary)
    weighting = layers.TermWeighting(len(vocabulary) + 1, "tf_idf", True, True,
                                        name=f"weighting_{view.name}")
    weights = np.zeros(len(vocabulary) + 1, dtype="float32")
    weights[1:] = idf  # column 0 is the OOV bucket: weight 0, as in training
    weighting.weights_per_term.assign(weights)
    return weighting(vec(text_input))


def linear_graph(views: list[tuple[View, list[str], np.ndarray]],
                 members: list[tuple[dict[str, np.ndarray], np.ndarray]],
                 activation: str = "softmax", fuse: bool = True) -> keras.Model:
    """One end-to-end model: each view's bag -> linear maps -> softmax.

    `views` are the branches (shared by all members); each member is a
    kernel block per view name (rows = that view's vocabulary, no OOV row)
    plus a bias, already divided by the member's temperature. A member's
    logits are the sum over its views, exactly a linear model on the
    concatenated features. Several members are averaged after their
    softmax (the ensemble's averaged probabilities). Each view has one
    SparseLinear holding every member's block side by side, so a bag is
    read once however many members there are. `activation` "sigmoid"
    (multi-label, one member): an independent score per label.

    A dense view that is linear in its words (the pretrained view of
    pretrained.fit_view) has its linear map folded into its table instead
    (layers.PretrainedLogits, when the view says it is `fusable` for this
    many logit columns; `fuse` false never folds). Views that standardize
    alike share one Standardize.
    """
    text_input = keras.Input(shape=(), dtype="string", name="text")
    n_members, n_labels = len(members), len(members[0][1])
    units = n_members * n_labels
    used = [(view, vocab, idf) for view, vocab, idf in views
            if any(view.name in blocks for blocks, _ in members)]
    uses = Counter(view.standardize for view, _, _ in used)
    shared = {std: layers.Standardize(std, name=f"standardize_{std}")(text_input)
              for std, n in uses.items() if n > 1}
    bias = np.concatenate([b for _, b in members]).astype("float32")
    logits = []
    for i, (view, vocab, idf) in enumerate(used):
        name = view.name
        # sparse bags have the OOV column 0 first (kernel row 0 stays zero); dense views do not
        offset = 0 if getattr(view, "dense", False) else 1
        kernel = np.zeros((len(vocab) + offset, units), dtype=np.float64)
        for m, (blocks, _) in enumerate(members):
            if name in blocks:  # a member without this view keeps zeros there
                kernel[offset:, m * n_labels:(m + 1) * n_labels] = blocks[name]
        source = shared.get(view.standardize, text_input)
        standardized = view.standardize in shared
        if fuse and getattr(view, "fusable", None) is not None and view.fusable(units):  # type: ignore[attr-defined]
            fused = view.fused_layer(kernel, bias if i == 0 else None, standardized)  # type: ignore[attr-defined]
            logits.append(fused(source))
            continue
        linear = layers.SparseLinear(units, use_bias=(i == 0), name=f"logits_{name}")
        out = linear(branch(view, vocab, idf, source, standardized))
        linear.set_kernel(kernel.astype("float32"), bias if i == 0 else None)
        logits.append(out)
    total = logits[0] if len(logits) == 1 else keras.layers.Add(name="logits")(logits)
    if n_members == 1:
        return keras.Model(text_input, keras.layers.Activation(activation, name="probs")(total),
                           name="textswap_auto")
    per_member = keras.layers.Reshape((n_members, n_labels), name="members")(total)
    probs = keras.layers.Activation("softmax", name="member_probs")(per_member)  # over the last axis
    return keras.Model(text_input, keras.layers.GlobalAveragePooling1D(name="probs")(probs),
                       name="textswap_auto")
