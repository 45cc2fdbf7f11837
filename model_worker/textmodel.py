"""End-to-end text classifiers: raw strings in, softmax probabilities out.

A trained model is one Keras functional model

    bow: strings (batch,) -> TextVectorization (sparse n-gram counts)
         -> TermWeighting (TF-IDF, unit L2 norm) -> Dense softmax (batch, n_labels)
    cnn: strings (batch,) -> TextVectorization (token ids) -> Embedding
         -> Conv1D -> global max pool -> Dropout -> Dense softmax

so the saved `model.keras` is all a worker needs. The vectorizer's
standardize functions are registered below under the "textswap" package;
importing this module before `keras.saving.load_model(..., safe_mode=True)`
is what makes a saved model loadable.

Training is split in two for speed: the vectorizer turns every text into
features once (cached), the small head trains on those features for many
epochs, and the same head layers are then wired behind the vectorizer to
form the served model. Re-vectorizing each epoch would cost more than the
training itself.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import keras
import numpy as np
import tensorflow as tf

from model_worker.params import resolve_tokenize, validate_params

log = logging.getLogger(__name__)

# --------------------------------------------------------------------------
# Tokenization (lives inside the saved model)
# --------------------------------------------------------------------------

# Runs of anything that is not a letter, mark or digit become one space:
# punctuation and emoji carry little signal for these tasks and would
# otherwise glue onto neighbouring words.
_NON_WORD = r"[^\p{L}\p{M}\p{N}]+"
# Scripts written without spaces: each character becomes its own token.
_CJK_CHAR = r"(\p{Han}|\p{Hiragana}|\p{Katakana})"


@keras.saving.register_keras_serializable(package="textswap")
def standardize_char(text: tf.Tensor) -> tf.Tensor:
    """Lowercase, drop punctuation, and space out every CJK character.

    Latin words stay whole, so mixed text such as "iPhone很好用" becomes
    "iphone 很 好 用".
    """
    text = tf.strings.lower(text, encoding="utf-8")
    text = tf.strings.regex_replace(text, _NON_WORD, " ")
    return tf.strings.regex_replace(text, _CJK_CHAR, r" \1 ")


@keras.saving.register_keras_serializable(package="textswap")
def standardize_word(text: tf.Tensor) -> tf.Tensor:
    """Lowercase and drop punctuation; tokens are whitespace-separated words.

    CJK runs stay whole, which suits Chinese that was segmented upstream.
    """
    text = tf.strings.lower(text, encoding="utf-8")
    return tf.strings.regex_replace(text, _NON_WORD, " ")


def _char_ngrams(text: tf.Tensor, widths: tuple[int, ...], unigrams: bool) -> tf.RaggedTensor:
    """Character n-grams inside each word, each word padded with one space.

    `text` is already standardized (rank 1); the result is one ragged row of
    n-grams per text, never crossing a word boundary (scikit-learn calls
    this "char_wb"). The padding marks word starts and ends; unigrams, when
    asked for, come unpadded so that no token is a bare space.
    """
    words = tf.strings.split(text)
    padded = tf.strings.unicode_split(tf.strings.join([" ", words.flat_values, " "]), "UTF-8")
    grams = tf.strings.ngrams(padded, ngram_width=widths, separator="")
    if unigrams:
        grams = tf.concat([tf.strings.unicode_split(words.flat_values, "UTF-8"), grams], axis=1)
    return words.with_flat_values(grams).merge_dims(1, 2)


@keras.saving.register_keras_serializable(package="textswap")
def split_char_2_5(text: tf.Tensor) -> tf.RaggedTensor:
    """Character 2-5-grams within words: the view that suits Latin scripts."""
    return _char_ngrams(text, (2, 3, 4, 5), unigrams=False)


@keras.saving.register_keras_serializable(package="textswap")
def split_char_1_3(text: tf.Tensor) -> tf.RaggedTensor:
    """Character 1-3-grams within runs: the view that suits CJK text."""
    return _char_ngrams(text, (2, 3), unigrams=True)


@keras.saving.register_keras_serializable(package="textswap")
def standardize_lower(text: tf.Tensor) -> tf.Tensor:
    """Lowercase only: punctuation, symbols and digits stay (format strings,
    option names, emoticons can be the signal); any whitespace run becomes
    one space. CJK runs stay whole."""
    text = tf.strings.lower(text, encoding="utf-8")
    return tf.strings.regex_replace(text, r"[\s\x0b\p{Z}]+", " ")


_STANDARDIZERS = {"char": standardize_char, "word": standardize_word, "lower": standardize_lower}
# The n-gram widths (and whether unigrams come too) of each char split, for
# CharNgramCounts, which computes the same counts by number.
CHAR_SPLIT_WIDTHS = {split_char_2_5: ((2, 3, 4, 5), False), split_char_1_3: ((2, 3), True)}


# What tf.strings.split splits on, as code points: " " and \t \n \v \f \r.
_BLANKS = frozenset((9, 10, 11, 12, 13, 32))


@keras.saving.register_keras_serializable(package="textswap")
class CharNgramCounts(keras.layers.Layer):
    """Sparse counts of character n-grams within words, looked up by number.

    Computes exactly what TextVectorization(standardize, split=_char_ngrams
    with these widths, output_mode="count", sparse=True) computes with the
    same vocabulary, except that out-of-vocabulary n-grams are left out
    (their column 0 has weight 0 downstream, so nothing changes), and
    faster: no n-gram string is ever built. The standardized text, padded
    with a space at each end, is decoded to code points once; every
    character maps to a small code (1..A for the A characters the
    vocabulary uses, A+1 for any other), and an n-gram's key is its codes
    packed `bits` apiece into one int64: exact (no hashing, no collisions),
    and distinct across widths because a code is never 0. In that padded
    sequence the n-grams of the padded words are exactly the windows with
    no space inside (first and last position excepted) other than a lone
    pair of spaces; no vocabulary token has a space inside, so every other
    window (across words or texts, past the end) simply finds no key.
    "Space" is whatever tf.strings.split splits on (" ", \\t, \\n, \\v, \\f,
    \\r), so runs of them and standardizers that keep them ("lower") count
    alike. Unigrams (CJK) are the non-space characters. Counting is one
    unique-with-counts over (row, column) cells, cheaper than a sparse
    bincount, which sorts every row.

    The output's rows ascend; within a row, columns come in order of first
    appearance (tf.sparse.reorder gives the lexicographic order).

    Needs bits * max(widths) <= 63; `fits` says whether a vocabulary does.
    """

    def __init__(self, widths=(2, 3, 4, 5), unigrams: bool = False, standardize: str = "word",
                 vocabulary=None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.widths, self.unigrams, self.standardize = tuple(widths), bool(unigrams), standardize
        self._vocab_size = 0
        if vocabulary is not None:
            self.set_vocabulary(vocabulary)

    @staticmethod
    def _alphabet_of(vocabulary: list[str]) -> np.ndarray:
        return np.array(sorted({ord(ch) for token in vocabulary for ch in token}), dtype=np.int64)

    @classmethod
    def fits(cls, vocabulary: list[str], widths) -> bool:
        return (len(cls._alphabet_of(vocabulary)) + 1).bit_length() * max(widths) <= 63

    def set_vocabulary(self, vocabulary: list[str]) -> None:
        alphabet = self._alphabet_of(vocabulary)
        bits = (len(alphabet) + 1).bit_length()
        code = {int(cp): i + 1 for i, cp in enumerate(alphabet)}
        keys = np.zeros(len(vocabulary), dtype=np.int64)
        for j, token in enumerate(vocabulary):
            inner = token[1:-1] if len(token) > 1 else token
            if not token or any(ord(ch) in _BLANKS for ch in inner):
                # windows with a space inside are left out by finding no key
                raise ValueError(f"n-gram {token!r} has a space inside")
            key = 0
            for ch in token:
                key = (key << bits) | code[ord(ch)]
            keys[j] = key
        self._set_tables(alphabet, keys)

    def _set_tables(self, alphabet: np.ndarray, keys: np.ndarray) -> None:
        self._alphabet_np, self._keys_np = alphabet, keys
        self._bits = (len(alphabet) + 1).bit_length()
        if self._bits * max(self.widths) > 63:
            raise ValueError(f"{len(alphabet)} distinct characters do not pack into 64 bits")
        if len(np.unique(keys)) != len(keys):
            raise ValueError("vocabulary has duplicate tokens")
        self._vocab_size = len(keys) + 1  # column 0: out of vocabulary, never emitted
        self.alphabet_table = tf.lookup.StaticHashTable(
            tf.lookup.KeyValueTensorInitializer(
                tf.constant(alphabet, tf.int64), tf.range(1, len(alphabet) + 1, dtype=tf.int64)),
            default_value=len(alphabet) + 1)
        self.ngram_table = tf.lookup.StaticHashTable(
            tf.lookup.KeyValueTensorInitializer(
                tf.constant(keys, tf.int64), tf.range(1, len(keys) + 1, dtype=tf.int64)),
            default_value=0)

    def get_vocabulary(self) -> list[str]:
        """The vocabulary, decoded back from the packed keys (OOV excluded)."""
        mask = (1 << self._bits) - 1
        vocab = []
        for key in self._keys_np.tolist():
            chars = []
            while key:
                chars.append(chr(int(self._alphabet_np[(key & mask) - 1])))
                key >>= self._bits
            vocab.append("".join(reversed(chars)))
        return vocab

    def vocabulary_size(self) -> int:
        return self._vocab_size

    def call(self, texts):
        texts = tf.convert_to_tensor(texts, tf.string)
        if self.standardize:
            texts = _STANDARDIZERS[self.standardize](texts)
        chars = tf.strings.unicode_decode(tf.strings.join([" ", texts, " "]), "UTF-8")
        points = tf.cast(chars.flat_values, tf.int64)
        n = tf.size(points)
        top = max(self.widths)
        # _BLANKS (what tf.strings.split splits on) all code as " "
        blank = tf.logical_or(tf.equal(points, 32), tf.logical_and(points >= 9, points <= 13))
        codes = tf.where(blank, self.alphabet_table.lookup(tf.constant(32, tf.int64)),
                         self.alphabet_table.lookup(points))
        # code 0 after the end: windows running past it match no key
        codes = tf.concat([codes, tf.zeros([top - 1], tf.int64)], 0)
        key = codes[:n]
        keys = [key] if self.unigrams else []
        for w in range(2, top + 1):
            key = tf.bitwise.bitwise_or(tf.bitwise.left_shift(key, self._bits), codes[w - 1:w - 1 + n])
            if w in self.widths:
                keys.append(key)
        # Every window is looked up, none is tested for spaces first: a key
        # with a space inside, a space unigram, or one running past the end
        # (code 0) or across two texts (spaces inside) is no vocabulary
        # token's key, so the table itself leaves those windows out.
        # Position-major, so that the rows of the kept windows stay sorted.
        ids = self.ngram_table.lookup(tf.reshape(tf.stack(keys, axis=1), [-1]))
        cells = tf.repeat(chars.value_rowids() * self._vocab_size, len(keys)) + ids
        cells, _, counts = tf.unique_with_counts(tf.boolean_mask(cells, ids > 0))
        # unique keeps first occurrences in order: rows ascending, columns in
        # order of appearance within a row (not lexicographic, which
        # TermWeighting and SparseLinear do not need; tf.sparse.reorder
        # makes it so)
        return tf.SparseTensor(tf.stack([cells // self._vocab_size, cells % self._vocab_size], axis=1),
                               tf.cast(counts, self.compute_dtype),
                               tf.stack([tf.shape(texts, out_type=tf.int64)[0],
                                         tf.constant(self._vocab_size, tf.int64)]))

    def compute_output_spec(self, texts):
        return keras.KerasTensor((texts.shape[0], self._vocab_size), dtype=self.compute_dtype, sparse=True)

    def save_own_variables(self, store) -> None:
        store["alphabet"] = self._alphabet_np
        store["keys"] = self._keys_np

    def load_own_variables(self, store) -> None:
        self._set_tables(np.asarray(store["alphabet"], dtype=np.int64), np.asarray(store["keys"], dtype=np.int64))

    def get_config(self) -> dict:
        return {**super().get_config(), "widths": list(self.widths), "unigrams": self.unigrams,
                "standardize": self.standardize, "vocabulary_size": self._vocab_size}

    @classmethod
    def from_config(cls, config: dict):
        config = dict(config)
        size = config.pop("vocabulary_size", 0)
        layer = cls(**config)
        layer._vocab_size = size  # the output width, before load_own_variables fills the tables
        return layer
# Training steps run per graph call (see train_model).
_STEPS_PER_EXECUTION = 32
# Texts per batch when tokenizing for the vocabulary or caching features.
_FEATURE_BATCH = 512


def _tokens(texts: list[str], tokenize: str, ngrams: int | None) -> tf.RaggedTensor:
    """Same tokens as TextVectorization produces (split on whitespace, n-grams)."""
    words = tf.strings.split(_STANDARDIZERS[tokenize](tf.constant(texts)))
    if ngrams is None:
        return words
    return tf.strings.ngrams(words, ngram_width=tuple(range(1, ngrams + 1)), separator=" ")


def _document_frequencies(texts: list[str], tokenize: str, ngrams: int | None) -> Counter:
    """How many texts each token occurs in.

    Counting in Python over TF-produced tokens is ~4x faster than
    TextVectorization.adapt on 11k reviews (measured; a tf.unique/NumPy
    variant was slower still) and yields the document frequencies that the
    IDF weights need anyway.
    """
    df: Counter = Counter()
    for start in range(0, len(texts), _FEATURE_BATCH):
        for row in _tokens(texts[start:start + _FEATURE_BATCH], tokenize, ngrams).to_list():
            df.update(set(row))
    return df


def _top_tokens(df: Counter, limit: int) -> tuple[list[bytes], np.ndarray]:
    """The `limit` most document-frequent tokens, ties broken by the token.

    The tie-break makes the vocabulary independent of input order. Only
    tokens at or above the cut-off frequency are sorted: sorting all ~600k
    distinct n-grams cost seconds.
    """
    tokens = list(df)
    counts = np.fromiter(df.values(), dtype=np.int64, count=len(tokens))
    if limit < len(tokens):
        cutoff = np.partition(counts, len(tokens) - limit)[len(tokens) - limit]
        keep = np.flatnonzero(counts >= cutoff)
    else:
        keep = np.arange(len(tokens))
    keep = sorted(keep.tolist(), key=lambda i: (-counts[i], tokens[i]))[:limit]
    return [tokens[i] for i in keep], counts[keep]


@keras.saving.register_keras_serializable(package="textswap")
class TermWeighting(keras.layers.Layer):
    """Turns per-text n-gram counts into the bag the linear layer sees.

    mode "tf_idf": count * idf; "count": count; "multi_hot": 1 if present.
    The OOV column gets weight 0: how many unknown n-grams a text has says
    more about its length than its class. With `normalize`, each row is
    scaled to unit L2 norm, as classic TF-IDF pipelines do; this keeps long
    reviews from producing huge logits and measured more accurate.

    Accepts a SparseTensor (training, on cached features) or a dense tensor
    and returns the same kind, so both graphs share one definition.
    """

    def __init__(self, vocab_size: int, mode: str = "tf_idf", normalize: bool = True,
                 sublinear_tf: bool = False, **kwargs) -> None:
        super().__init__(**kwargs)
        self.vocab_size, self.mode, self.normalize = vocab_size, mode, normalize
        self.sublinear_tf = sublinear_tf
        # Saved with the model's weights; set from the training data.
        self.weights_per_term = self.add_weight(
            shape=(vocab_size,), initializer="ones", trainable=False, name="term_weights")

    def call(self, counts):
        if isinstance(counts, tf.SparseTensor):
            values = tf.cast(counts.values, self.compute_dtype)
            if self.mode == "multi_hot":
                values = tf.ones_like(values)
            elif self.sublinear_tf:
                values = 1.0 + tf.math.log(values)
            values = values * tf.gather(tf.convert_to_tensor(self.weights_per_term), counts.indices[:, 1])
            if self.normalize:
                rows = counts.indices[:, 0]
                sq = tf.math.unsorted_segment_sum(tf.square(values), rows, counts.dense_shape[0])
                values = values * tf.gather(tf.math.rsqrt(tf.maximum(sq, 1e-12)), rows)
            return tf.SparseTensor(counts.indices, values, counts.dense_shape)
        x = tf.cast(counts, self.compute_dtype)
        if self.mode == "multi_hot":
            x = tf.minimum(x, 1.0)
        elif self.sublinear_tf:
            # 1 + log(count) where present; log(0) is masked out.
            x = tf.where(x > 0, 1.0 + tf.math.log(tf.maximum(x, 1.0)), tf.zeros_like(x))
        x = x * self.weights_per_term
        if self.normalize:
            x = x * tf.math.rsqrt(tf.maximum(tf.reduce_sum(tf.square(x), axis=-1, keepdims=True), 1e-12))
        return x

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self) -> dict:
        return {**super().get_config(), "vocab_size": self.vocab_size, "mode": self.mode,
                "normalize": self.normalize, "sublinear_tf": self.sublinear_tf}


@keras.saving.register_keras_serializable(package="textswap")
class Standardize(keras.layers.Layer):
    """One of the registered standardizers as a layer: run once, feed several views.

    When two branches of a model standardize alike (word 1-2-grams and
    character n-grams of Latin text both use "word"), the text is
    standardized once here and the branches get `standardize=None`.
    """

    def __init__(self, standardize: str, **kwargs) -> None:
        super().__init__(**kwargs)
        if standardize not in _STANDARDIZERS:
            raise ValueError(f"unknown standardizer {standardize!r}")
        self.standardize = standardize

    def call(self, texts):
        return _STANDARDIZERS[self.standardize](tf.convert_to_tensor(texts, tf.string))

    def compute_output_spec(self, texts):
        return keras.KerasTensor(texts.shape, dtype="string")

    def get_config(self) -> dict:
        return {**super().get_config(), "standardize": self.standardize}


# SparseLinear: kernel columns per sparse x dense matmul (see there).
_COLUMNS_PER_MATMUL = 24


@keras.saving.register_keras_serializable(package="textswap")
class SparseLinear(keras.layers.Layer):
    """x @ kernel (+ bias) for sparse bags: the linear maps of `auto`.

    Keras' Dense on a SparseTensor goes through fill_empty_rows and
    embedding_lookup_sparse, which de-duplicates the column ids and gathers
    a kernel row per entry; for the hundreds of n-grams a text has that was
    most of the linear step's time. Here it is TensorFlow's sparse x dense
    matmul, which adds each entry's kernel row straight into its output row,
    over blocks of at most _COLUMNS_PER_MATMUL kernel columns (its CPU
    kernel has a fast path for narrow right-hand sides; 86 columns in one
    call measured 3x slower than in blocks of 24). Any order of the
    entries will do. Dense input is a plain matmul.
    """

    def __init__(self, units: int, use_bias: bool = True, **kwargs) -> None:
        super().__init__(**kwargs)
        self.units, self.use_bias = int(units), bool(use_bias)

    def build(self, input_shape) -> None:
        # one variable per block of columns: slicing columns out of one
        # (vocabulary x units) kernel would copy most of it on every call
        step = _COLUMNS_PER_MATMUL
        self.kernels = [self.add_weight(shape=(input_shape[-1], min(step, self.units - i)), initializer="zeros",
                                        name=f"kernel_{i // step}") for i in range(0, self.units, step)]
        self.bias = self.add_weight(shape=(self.units,), initializer="zeros", name="bias") if self.use_bias else None

    def set_kernel(self, kernel: np.ndarray, bias: np.ndarray | None = None) -> None:
        """Assign a whole (inputs x units) kernel (and the bias)."""
        step = _COLUMNS_PER_MATMUL
        for i, var in zip(range(0, self.units, step), self.kernels):
            var.assign(kernel[:, i:i + step])
        if self.use_bias:
            self.bias.assign(bias)

    def call(self, x):
        kernels = [tf.convert_to_tensor(k) for k in self.kernels]
        if isinstance(x, tf.SparseTensor):
            x = tf.SparseTensor(x.indices, tf.cast(x.values, kernels[0].dtype), x.dense_shape)
            blocks = [tf.sparse.sparse_dense_matmul(x, k) for k in kernels]
            out = blocks[0] if len(blocks) == 1 else tf.concat(blocks, axis=1)
        else:
            out = tf.matmul(tf.cast(x, kernels[0].dtype), tf.concat(kernels, axis=1))
        if self.bias is not None:
            out = out + self.bias
        return out

    def compute_output_shape(self, input_shape):
        return (input_shape[0], self.units)

    def get_config(self) -> dict:
        return {**super().get_config(), "units": self.units, "use_bias": self.use_bias}


def build_vectorizer(texts: list[str], params: dict, tokenize: str):
    """A TextVectorization layer with its vocabulary fitted on `texts`.

    For bags it emits sparse counts and comes with the TermWeighting layer
    (weights set from the document frequencies); for sequences the second
    value is None.
    """
    cnn = params["architecture"] == "cnn"
    ngrams = None if cnn else params["ngrams"]
    reserved = 2 if cnn else 1  # padding + OOV for sequences, OOV for bags
    tokens, counts = _top_tokens(_document_frequencies(texts, tokenize, ngrams), params["max_tokens"] - reserved)
    vocab = [token.decode("utf-8") for token in tokens]
    if not vocab:
        raise ValueError("training texts contain no tokens")
    common = dict(max_tokens=len(vocab) + reserved, standardize=_STANDARDIZERS[tokenize], split="whitespace")
    if cnn:
        layer = keras.layers.TextVectorization(
            output_mode="int", output_sequence_length=params["sequence_length"], name="vectorizer", **common)
        layer.set_vocabulary(vocab)
        return layer, None
    # Counts come from TextVectorization, weighting from our own layer:
    # Keras' built-in tf_idf mode fails with sparse output, and sparse bags
    # are what make both training and serving fast (measured 5-7x faster
    # than dense 100k-wide rows at batch 64-1024).
    layer = keras.layers.TextVectorization(ngrams=ngrams, output_mode="count", sparse=True,
                                           name="vectorizer", **common)
    layer.set_vocabulary(vocab)
    weighting = TermWeighting(len(vocab) + 1, params["output_mode"], params["normalize"],
                              params["sublinear_tf"], name="weighting")
    weights = np.ones(len(vocab) + 1, dtype="float32")
    weights[0] = 0.0
    if params["output_mode"] == "tf_idf":
        weights[1:] = np.log1p(len(texts) / (1.0 + counts))
    weighting.weights_per_term.assign(weights)
    return layer, weighting


# --------------------------------------------------------------------------
# Heads
# --------------------------------------------------------------------------

def _head_layers(params: dict, vocab_size: int, n_labels: int) -> list[keras.layers.Layer]:
    """The trainable layers after the vectorizer, shared by both graphs."""
    reg = keras.regularizers.L2(params["l2"]) if params["l2"] > 0 else None
    out = keras.layers.Dense(n_labels, activation="softmax", kernel_regularizer=reg, name="probs")
    if params["architecture"] == "bow":
        # A linear model over the bag: what TF-IDF + logistic regression and
        # fastText are, and what measured best.
        return [out]
    return [
        keras.layers.Embedding(vocab_size, params["embedding_dim"], name="embed"),
        keras.layers.Conv1D(128, 5, padding="same", activation="relu", name="conv"),
        keras.layers.GlobalMaxPooling1D(name="pool"),
        keras.layers.Dropout(params["dropout"], name="dropout"),
        out,
    ]


def _apply(layers: list[keras.layers.Layer], x: keras.KerasTensor) -> keras.KerasTensor:
    for layer in layers:
        x = layer(x)
    return x


# --------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------

class TrainingCancelled(Exception):
    """Raised by train_model when should_stop() asked it to stop."""


@dataclass
class TrainResult:
    model: keras.Model
    labels: list[str]
    metrics: dict
    history: list[dict] = field(default_factory=list)
    # architecture "auto": the search report (candidates, choice, calibration)
    report: dict | None = None


def stratified_split(y: np.ndarray, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Shuffled train/validation indices holding `fraction` of every label.

    Keras' own validation_split takes the last rows, which is biased when
    data is sorted; here each label contributes its share (at least one row
    when it has two or more).
    """
    rng = np.random.default_rng(seed)
    train, val = [], []
    for label in np.unique(y):
        idx = rng.permutation(np.flatnonzero(y == label))
        n_val = int(round(len(idx) * fraction))
        if len(idx) >= 2 and fraction > 0:
            n_val = min(max(n_val, 1), len(idx) - 1)
        else:
            n_val = 0
        val.append(idx[:n_val])
        train.append(idx[n_val:])
    return rng.permutation(np.concatenate(train)), rng.permutation(np.concatenate(val))


class _Progress(keras.callbacks.Callback):
    """Reports each epoch and turns should_stop() into TrainingCancelled."""

    def __init__(self, epochs: int, on_epoch, should_stop, history: list[dict]) -> None:
        super().__init__()
        self.epochs, self.on_epoch, self.should_stop, self.history = epochs, on_epoch, should_stop, history

    def on_train_batch_end(self, batch: int, logs=None) -> None:
        # Keras calls this once per graph call (_STEPS_PER_EXECUTION steps),
        # so a cancel lands within a fraction of an epoch.
        if self.should_stop is not None and self.should_stop():
            raise TrainingCancelled("training cancelled")

    def on_epoch_end(self, epoch: int, logs=None) -> None:
        logs = logs or {}
        row = {
            "epoch": epoch + 1,
            "epochs": self.epochs,
            "loss": float(logs.get("loss", float("nan"))),
            # None (not NaN, which JSON cannot carry) when nothing is held out.
            "val_loss": float(logs["val_loss"]) if "val_loss" in logs else None,
            "val_accuracy": float(logs["val_accuracy"]) if "val_accuracy" in logs else None,
        }
        self.history.append(row)
        if self.on_epoch is not None:
            self.on_epoch(row)
        if self.should_stop is not None and self.should_stop():
            raise TrainingCancelled("training cancelled")


def _features(vectorizer, texts: list[str], weighting=None):
    """Vectorize every text once; the head then trains on the cached result.

    Bags are kept as one SparseTensor (dense 100k-wide rows would not fit in
    memory beyond a few thousand texts); sequences as a dense int matrix.
    """
    parts = [vectorizer(tf.constant(texts[i:i + _FEATURE_BATCH])) for i in range(0, len(texts), _FEATURE_BATCH)]
    if weighting is None:
        return tf.concat(parts, 0)
    return weighting(tf.sparse.concat(0, parts))


def _dataset(features, y: np.ndarray, batch_size: int, seed: int | None) -> tf.data.Dataset:
    ds = tf.data.Dataset.from_tensor_slices((features, y))
    if seed is not None:
        ds = ds.shuffle(len(y), seed=seed, reshuffle_each_iteration=True)
    return ds.batch(batch_size).prefetch(tf.data.AUTOTUNE)


def _fit_head(params: dict, vocab_size: int, n_labels: int, train: tuple, val: tuple | None,
              epochs: int, callbacks: list) -> list[keras.layers.Layer]:
    """Train fresh head layers on cached features; returns the layers."""
    head = _head_layers(params, vocab_size, n_labels)
    if params["architecture"] == "bow":
        feat_input = keras.Input(shape=(vocab_size,), sparse=True, name="features")
    else:
        feat_input = keras.Input(shape=(params["sequence_length"],), dtype="int64", name="features")
    trainer = keras.Model(feat_input, _apply(head, feat_input))
    trainer.compile(
        optimizer=keras.optimizers.Adam(params["learning_rate"]),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
        # Several steps per graph call: per-step Python overhead dominated
        # the tiny linear head (measured ~35% less CPU per epoch).
        steps_per_execution=_STEPS_PER_EXECUTION,
    )
    train_ds = _dataset(train[0], train[1], params["batch_size"], params["seed"])
    val_ds = _dataset(val[0], val[1], 1024, None) if val is not None else None
    trainer.fit(train_ds, validation_data=val_ds, epochs=epochs, callbacks=callbacks, verbose=0,
                shuffle=False)  # the dataset shuffles itself, seeded
    return head


def train_model(
    texts: list[str],
    labels: list[str],
    params: dict,
    on_epoch: Callable[[dict], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> TrainResult:
    """Train an end-to-end classifier; see the module docstring for the shape.

    `params` is validated (and completed with defaults) again here so the
    trainer never depends on the caller having done it. architecture "auto"
    searches (model_worker.autoselect); on_epoch then receives one row per
    candidate evaluated.
    """
    params = validate_params(params)
    if len(texts) != len(labels):
        raise ValueError(f"{len(texts)} texts but {len(labels)} labels")
    label_names = sorted(set(labels))
    if len(label_names) < 2:
        raise ValueError("need at least two distinct labels")
    if params["architecture"] == "auto":
        return _train_auto(texts, labels, label_names, params, on_epoch, should_stop)
    return _train_network(texts, labels, params, on_epoch, should_stop)


def _train_auto(texts: list[str], labels: list[str], label_names: list[str], params: dict,
                on_progress, should_stop) -> TrainResult:
    """The automatic search, with the bow/cnn networks as candidates."""
    from model_worker import autoselect  # scikit-learn: trainer processes only

    started = time.monotonic()
    keras.utils.set_random_seed(params["seed"])
    tokenize = resolve_tokenize(params, texts)

    def network_cv(arch: str, train: np.ndarray, test: np.ndarray, deadline: float) -> np.ndarray:
        def stop() -> bool:
            if should_stop is not None and should_stop():
                raise TrainingCancelled("training cancelled")
            return time.monotonic() > deadline
        try:
            res = _train_network([texts[i] for i in train], [labels[i] for i in train],
                                 {**params, "architecture": arch}, None, stop)
        except TrainingCancelled as exc:
            if should_stop is not None and should_stop():
                raise
            raise autoselect.BudgetExceeded("time budget ran out inside a fold") from exc
        if res.labels != label_names:  # cannot happen with stratified folds
            raise RuntimeError("a fold lacks a label")
        probs = predict_proba(make_predict_fn(res.model), [texts[i] for i in test])
        return np.log(np.clip(probs, 1e-12, 1.0))

    def network_fit(arch: str, temperature: float) -> keras.Model:
        return calibrated_network(texts, labels, {**params, "architecture": arch}, temperature,
                                  should_stop)

    def progress(row: dict) -> None:
        if should_stop is not None and should_stop():
            raise TrainingCancelled("training cancelled")
        if on_progress is not None:
            on_progress(row)

    auto = autoselect.train_auto(texts, labels, label_names, params, tokenize, started, progress,
                                 network_cv, network_fit)
    auto.metrics["train_seconds"] = round(time.monotonic() - started, 3)
    return TrainResult(model=auto.model, labels=label_names, metrics=auto.metrics,
                       history=auto.history, report=auto.report)


def calibrated_network(texts: list[str], labels: list[str], params: dict, temperature: float,
                       should_stop=None) -> keras.Model:
    """A bow/cnn network on every row, its softmax sharpened or softened by 1/T.

    softmax(z / T) is the same softmax layer with kernel and bias divided by
    T, so the calibrated model has exactly the network's architecture.
    """
    res = _train_network(texts, labels, validate_params(params), None, should_stop)
    out = res.model.get_layer("probs")
    out.set_weights([w / temperature for w in out.get_weights()])
    return res.model


def _train_network(texts: list[str], labels: list[str], params: dict, on_epoch, should_stop) -> TrainResult:
    """architecture "bow" or "cnn": a network trained with Adam on one split."""
    label_names = sorted(set(labels))
    started = time.monotonic()
    # One seed for Python, NumPy, TF and Keras initializers: the same data
    # and params give the same model.
    keras.utils.set_random_seed(params["seed"])

    index = {name: i for i, name in enumerate(label_names)}
    y = np.array([index[label] for label in labels], dtype="int32")
    train_idx, val_idx = stratified_split(y, params["validation_split"], params["seed"])
    train_texts = [texts[i] for i in train_idx]
    val_texts = [texts[i] for i in val_idx]

    # The vocabulary comes from the training part only, so validation
    # metrics are honest about unseen n-grams.
    tokenize = resolve_tokenize(params, train_texts)
    vectorizer, weighting = build_vectorizer(train_texts, params, tokenize)
    vocab_size = vectorizer.vocabulary_size()
    log.info("vocabulary: %d tokens (%s) after %.1fs", vocab_size, tokenize, time.monotonic() - started)
    bow = params["architecture"] == "bow"
    train_feats = _features(vectorizer, train_texts, weighting)
    val_feats = _features(vectorizer, val_texts, weighting) if len(val_idx) else None
    log.info("features cached after %.1fs", time.monotonic() - started)

    history: list[dict] = []
    callbacks: list[keras.callbacks.Callback] = []
    if val_feats is not None:
        callbacks.append(keras.callbacks.EarlyStopping(
            monitor="val_loss", patience=params["early_stopping_patience"], restore_best_weights=True))
    callbacks.append(_Progress(params["epochs"], on_epoch, should_stop, history))
    head = _fit_head(params, vocab_size, len(label_names), (train_feats, y[train_idx]),
                     (val_feats, y[val_idx]) if val_feats is not None else None, params["epochs"], callbacks)
    log.info("fit done after %.1fs", time.monotonic() - started)
    held_out_head = head
    if params["refit"] and val_feats is not None:
        # Estimate, then refit: the validation rows chose the epoch count and
        # gave the metrics; now every row trains the served model for that
        # many epochs (measured +0.3-1 point; the same idea as GridSearchCV's
        # refit). Metrics below come from the held-out model.
        best_epoch = min(history, key=lambda h: h["val_loss"])["epoch"] if history else 1
        all_feats = tf.sparse.concat(0, [train_feats, val_feats]) if bow else tf.concat([train_feats, val_feats], 0)
        all_y = np.concatenate([y[train_idx], y[val_idx]])
        head = _fit_head(params, vocab_size, len(label_names), (all_feats, all_y), None, best_epoch,
                         [_Progress(best_epoch, None, should_stop, [])])
        log.info("refit (%d epochs) done after %.1fs", best_epoch, time.monotonic() - started)

    # The served model: raw strings -> the same vectorizer -> the same
    # (now trained) head layers.
    log.info("fit done after %.1fs", time.monotonic() - started)
    text_input = keras.Input(shape=(), dtype="string", name="text")
    features = vectorizer(text_input)
    if weighting is not None:
        features = weighting(features)
    model = keras.Model(text_input, _apply(head, features), name="textswap_classifier")
    train_seconds = time.monotonic() - started

    held_out = model if held_out_head is head else keras.Model(text_input, _apply(held_out_head, features))
    if len(val_idx):
        metrics = evaluate(make_predict_fn(held_out), val_texts, y[val_idx], label_names)
        metrics["measured_on"] = "validation"
    else:
        metrics = evaluate(make_predict_fn(held_out), train_texts, y[train_idx], label_names)
        metrics["measured_on"] = "train"
    metrics.update(n_train=len(train_idx), n_val=len(val_idx), train_seconds=round(train_seconds, 3),
                   tokenize=tokenize, vocabulary_size=vocab_size, epochs_run=len(history))
    return TrainResult(model=model, labels=label_names, metrics=metrics, history=history)


# --------------------------------------------------------------------------
# Evaluation
# --------------------------------------------------------------------------

def predict_proba(predict_fn: Callable[[list[str]], np.ndarray], texts: list[str],
                  batch_size: int = 1024) -> np.ndarray:
    """Probabilities for many texts in large batches through the serving path."""
    chunks = [predict_fn(texts[i:i + batch_size]) for i in range(0, len(texts), batch_size)]
    return np.concatenate(chunks) if chunks else np.zeros((0, 0), dtype="float32")


def classification_metrics(y_true: np.ndarray, y_pred: np.ndarray, labels: list[str]) -> dict:
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


def evaluate(predict_fn, texts: list[str], y: np.ndarray, labels: list[str]) -> dict:
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
    """
    @tf.function(input_signature=[tf.TensorSpec([None], tf.string)])
    def serve(texts: tf.Tensor) -> tf.Tensor:
        return model(texts, training=False)

    # calling the traced graph directly skips tf.function's per-call
    # argument matching (~1 ms of a 3-4 ms single-text call)
    concrete = serve.get_concrete_function()

    def predict(texts: list[str]) -> np.ndarray:
        if not texts:
            return np.zeros((0, model.output_shape[-1]), dtype="float32")
        return concrete(tf.constant(texts, dtype=tf.string)).numpy()

    return predict


# --------------------------------------------------------------------------
# Portable export
# --------------------------------------------------------------------------

# Folder of the TensorFlow SavedModel inside a version folder.
SAVED_MODEL_DIR = "saved_model"


def export_saved_model(model: keras.Model, path: str, probe: list[str], expected: np.ndarray) -> None:
    """Write `model` as a TensorFlow SavedModel: raw strings in, probabilities out.

    The tokenization (our standardize/split functions, the vocabularies)
    is traced into the graph, so `tf.saved_model.load(path).serve(texts)`
    works in any TensorFlow process without this project; TF Serving
    serves it as is (signature "serving_default"). Checked here against
    `expected` (the Keras model's outputs on `probe`) before it is kept.
    """
    # A plain tf.Module holding the model and one traced string function:
    # measured ~35% cheaper than keras' model.export (which adds endpoints
    # and re-traces), with the same interface (`serve`, "serving_default").
    module = tf.Module()
    module.model = model  # tracks the variables and vocabulary tables

    @tf.function(input_signature=[tf.TensorSpec([None], tf.string, name="text")])
    def serve(texts: tf.Tensor) -> tf.Tensor:
        return model(texts, training=False)

    module.serve = serve
    tf.saved_model.save(module, path, signatures={"serving_default": serve})
    loaded = tf.saved_model.load(path)
    got = loaded.serve(tf.constant(probe, dtype=tf.string)).numpy()
    if not np.allclose(got, expected, atol=1e-5):
        raise RuntimeError("SavedModel export does not reproduce the model's outputs")


# --------------------------------------------------------------------------
# Tiny models for tests
# --------------------------------------------------------------------------

# Small enough to train in a second or two on a laptop core; used by the
# worker and supervisor tests that need a real model artifact.
TINY_PARAMS: dict = {
    "architecture": "bow",
    "max_tokens": 2000,
    "epochs": 30,
    "batch_size": 8,
    "learning_rate": 0.05,
    # A handful of rows cannot pick an epoch count: train on all of them.
    "validation_split": 0.0,
}


def train_tiny(texts: list[str], labels: list[str], on_epoch: Callable[[dict], None] | None = None,
               should_stop: Callable[[], bool] | None = None, **overrides) -> TrainResult:
    """Train a small model quickly (tests, demos); overrides are params."""
    return train_model(texts, labels, {**TINY_PARAMS, **overrides}, on_epoch, should_stop)
