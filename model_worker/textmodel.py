"""End-to-end text classifiers: raw strings in, softmax probabilities out.

A trained model is one Keras functional model

    bow: strings (batch,) -> TextVectorization (sparse n-gram counts)
         -> TermWeighting (TF-IDF, unit L2 norm) -> Dense softmax (batch, n_labels)
    cnn: strings (batch,) -> TextVectorization (token ids) -> Embedding
         -> Conv1D -> global max pool -> Dropout -> Dense softmax

so the saved `model.keras` is all a worker needs. The vectorizer's
standardize functions and the project's layers live in
model_worker.layers, registered under the "textswap" package (re-exported
here); importing either module before
`keras.saving.load_model(..., safe_mode=True)` is what makes a saved model
loadable.

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
from typing import Any, Callable

import keras
import numpy as np
import tensorflow as tf

from model_worker.layers import (  # noqa: F401  (re-exported: registered layers)
    _BLANKS,
    _STANDARDIZERS,
    CHAR_SPLIT_WIDTHS,
    CharNgramCounts,
    SparseLinear,
    Standardize,
    TermWeighting,
    _char_ngrams,
    split_char_1_3,
    split_char_2_5,
    standardize_char,
    standardize_lower,
    standardize_word,
)
from model_worker.params import resolve_tokenize, validate_params
from model_worker.scoring import (  # noqa: F401
    classification_metrics,
    evaluate,
    make_predict_fn,
    predict_proba,
    risk_coverage,
)

log = logging.getLogger(__name__)

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


def _document_frequencies(texts: list[str], tokenize: str, ngrams: int | None) -> Counter[bytes]:
    """How many texts each token occurs in.

    Counting in Python over TF-produced tokens is ~4x faster than
    TextVectorization.adapt on 11k reviews (measured; a tf.unique/NumPy
    variant was slower still) and yields the document frequencies that the
    IDF weights need anyway.
    """
    df: Counter[bytes] = Counter()
    for start in range(0, len(texts), _FEATURE_BATCH):
        for row in _tokens(texts[start:start + _FEATURE_BATCH], tokenize, ngrams).to_list():
            df.update(set(row))
    return df


def _top_tokens(df: Counter[bytes], limit: int) -> tuple[list[bytes], np.ndarray]:
    """The `limit` most document-frequent tokens, ties broken by the token.

    The tie-break makes the vocabulary independent of input order. Only
    tokens at or above the cut-off frequency are sorted: sorting all ~600k
    distinct n-grams cost seconds.
    """
    tokens = list(df)
    counts = np.fromiter(df.values(), dtype=np.int64, count=len(tokens))
    keep: np.ndarray | list[int]
    if limit < len(tokens):
        cutoff = np.partition(counts, len(tokens) - limit)[len(tokens) - limit]
        keep = np.flatnonzero(counts >= cutoff)
    else:
        keep = np.arange(len(tokens))
    keep = sorted(keep.tolist(), key=lambda i: (-counts[i], tokens[i]))[:limit]
    return [tokens[i] for i in keep], counts[keep]



def build_vectorizer(texts: list[str], params: dict[str, Any], tokenize: str) -> tuple[Any, Any]:
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

def _head_layers(params: dict[str, Any], vocab_size: int, n_labels: int) -> list[keras.layers.Layer]:
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
    metrics: dict[str, Any]
    history: list[dict[str, Any]] = field(default_factory=list)
    # architecture "auto": the search report (candidates, choice, calibration)
    report: dict[str, Any] | None = None
    # probabilities on texts the model was not fitted on, for profile.json
    held_out_probs: np.ndarray | None = None
    held_out_on: str | None = None
    # the training rows held_out_probs belong to, in order (None: every row)
    held_out_rows: np.ndarray | None = None
    # for the report, meta.json and the job's result (e.g. single-example labels)
    warnings: list[str] = field(default_factory=list)


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

    def __init__(self, epochs: int, on_epoch: Callable[[dict[str, Any]], None] | None,
                 should_stop: Callable[[], bool] | None, history: list[dict[str, Any]]) -> None:
        super().__init__()
        self.epochs, self.on_epoch, self.should_stop, self.history = epochs, on_epoch, should_stop, history

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        # Keras calls this once per graph call (_STEPS_PER_EXECUTION steps),
        # so a cancel lands within a fraction of an epoch.
        if self.should_stop is not None and self.should_stop():
            raise TrainingCancelled("training cancelled")

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
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


def _features(vectorizer: Any, texts: list[str], weighting: Any = None) -> Any:
    """Vectorize every text once; the head then trains on the cached result.

    Bags are kept as one SparseTensor (dense 100k-wide rows would not fit in
    memory beyond a few thousand texts); sequences as a dense int matrix.
    """
    parts = [vectorizer(tf.constant(texts[i:i + _FEATURE_BATCH])) for i in range(0, len(texts), _FEATURE_BATCH)]
    if weighting is None:
        return tf.concat(parts, 0)
    return weighting(tf.sparse.concat(0, parts))


def _dataset(features: Any, y: np.ndarray, batch_size: int, seed: int | None) -> tf.data.Dataset:
    ds = tf.data.Dataset.from_tensor_slices((features, y))
    if seed is not None:
        ds = ds.shuffle(len(y), seed=seed, reshuffle_each_iteration=True)
    return ds.batch(batch_size).prefetch(tf.data.AUTOTUNE)


def _fit_head(params: dict[str, Any], vocab_size: int, n_labels: int, train: tuple[Any, ...], val: tuple[Any, ...] | None,
              epochs: int, callbacks: list[Any]) -> list[keras.layers.Layer]:
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
    params: dict[str, Any],
    on_epoch: Callable[[dict[str, Any]], None] | None = None,
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
    if params["architecture"] == "zero_shot":  # the trainer calls model_worker.zeroshot
        raise ValueError("architecture 'zero_shot' trains with model_worker.zeroshot.train "
                         "(one description per label), not from labelled examples")
    multi = bool(labels) and isinstance(labels[0], (list, tuple))
    tally = Counter(x for one in labels for x in one) if multi else Counter(labels)
    single = sorted(k for k, v in tally.items() if v == 1)
    result: TrainResult
    if multi:  # several labels per text
        result = _train_multilabel(texts, [list(x) for x in labels], params, on_epoch, should_stop)
    else:
        label_names = sorted(set(labels))
        if len(label_names) < 2:
            raise ValueError("need at least two distinct labels")
        if params["architecture"] == "auto":
            result = _train_auto(texts, labels, label_names, params, on_epoch, should_stop)
        else:
            result = _train_network(texts, labels, params, on_epoch, should_stop)
    if single:  # trained on, never tested: autoselect.cv_folds, stratified_split
        from state.dataset import single_example_warning

        result.warnings.append(single_example_warning(single))
        result.metrics["single_example_labels"] = single
    if result.report is not None:
        result.report["warnings"] = list(result.warnings)
    return result


def _train_auto(texts: list[str], labels: list[str], label_names: list[str], params: dict[str, Any],
                on_progress: Callable[[dict[str, Any]], None] | None,
                should_stop: Callable[[], bool] | None) -> TrainResult:
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

    def progress(row: dict[str, Any]) -> None:
        if should_stop is not None and should_stop():
            raise TrainingCancelled("training cancelled")
        if on_progress is not None:
            on_progress(row)

    auto = autoselect.train_auto(texts, labels, label_names, params, tokenize, started, progress,
                                 network_cv, network_fit)
    auto.metrics["train_seconds"] = round(time.monotonic() - started, 3)
    return TrainResult(model=auto.model, labels=label_names, metrics=auto.metrics,
                       history=auto.history, report=auto.report,
                       held_out_probs=auto.held_out_probs, held_out_on="out_of_fold",
                       held_out_rows=auto.held_out_rows)


def _train_multilabel(texts: list[str], label_sets: list[list[str]], params: dict[str, Any],
                      on_progress: Callable[[dict[str, Any]], None] | None,
                      should_stop: Callable[[], bool] | None) -> TrainResult:
    """Multi-label data: architecture "auto" only (autoselect.train_auto_multilabel)."""
    from model_worker import autoselect
    from model_worker.params import multi_label_refusal

    if params["architecture"] != "auto":
        raise ValueError(multi_label_refusal(params["architecture"]))
    label_names = sorted({x for labels in label_sets for x in labels})
    if len(label_names) < 2:
        raise ValueError("need at least two distinct labels")
    started = time.monotonic()
    keras.utils.set_random_seed(params["seed"])

    def progress(row: dict[str, Any]) -> None:
        if should_stop is not None and should_stop():
            raise TrainingCancelled("training cancelled")
        if on_progress is not None:
            on_progress(row)

    auto = autoselect.train_auto_multilabel(texts, label_sets, label_names, params,
                                            resolve_tokenize(params, texts), started, progress)
    auto.metrics["train_seconds"] = round(time.monotonic() - started, 3)
    return TrainResult(model=auto.model, labels=label_names, metrics=auto.metrics,
                       history=auto.history, report=auto.report,
                       held_out_probs=auto.held_out_probs, held_out_on="out_of_fold",
                       held_out_rows=auto.held_out_rows)


def top_true_labels(label_sets: list[list[str]], label_names: list[str], probs: np.ndarray) -> list[str]:
    """One label per multi-label text, for single-label summaries (profile.json):
    of its labels, the one its held-out scores rank highest."""
    index = {name: i for i, name in enumerate(label_names)}
    return [max(labels, key=lambda x: probs[i][index[x]]) for i, labels in enumerate(label_sets)]


def calibrated_network(texts: list[str], labels: list[str], params: dict[str, Any], temperature: float,
                       should_stop: Callable[[], bool] | None = None) -> keras.Model:
    """A bow/cnn network on every row, its softmax sharpened or softened by 1/T.

    softmax(z / T) is the same softmax layer with kernel and bias divided by
    T, so the calibrated model has exactly the network's architecture.
    """
    res = _train_network(texts, labels, validate_params(params), None, should_stop)
    out = res.model.get_layer("probs")
    out.set_weights([w / temperature for w in out.get_weights()])
    return res.model


def _train_network(texts: list[str], labels: list[str], params: dict[str, Any],
                   on_epoch: Callable[[dict[str, Any]], None] | None,
                   should_stop: Callable[[], bool] | None) -> TrainResult:
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

    history: list[dict[str, Any]] = []
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
        val_probs = predict_proba(make_predict_fn(held_out), val_texts)
        metrics = classification_metrics(y[val_idx], val_probs.argmax(axis=1), label_names)
        metrics["measured_on"] = "validation"
        metrics["risk_coverage"] = risk_coverage(val_probs, y[val_idx])
    else:
        metrics = evaluate(make_predict_fn(held_out), train_texts, y[train_idx], label_names)
        metrics["measured_on"] = "train"
    metrics.update(n_train=len(train_idx), n_val=len(val_idx), train_seconds=round(train_seconds, 3),
                   tokenize=tokenize, vocabulary_size=vocab_size, epochs_run=len(history))
    return TrainResult(model=model, labels=label_names, metrics=metrics, history=history,
                       held_out_probs=val_probs if len(val_idx) else None, held_out_on="validation")



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
TINY_PARAMS: dict[str, Any] = {
    "architecture": "bow",
    "max_tokens": 2000,
    "epochs": 30,
    "batch_size": 8,
    "learning_rate": 0.05,
    # A handful of rows cannot pick an epoch count: train on all of them.
    "validation_split": 0.0,
}


def train_tiny(texts: list[str], labels: list[str], on_epoch: Callable[[dict[str, Any]], None] | None = None,
               should_stop: Callable[[], bool] | None = None, **overrides: Any) -> TrainResult:
    """Train a small model quickly (tests, demos); overrides are params."""
    return train_model(texts, labels, {**TINY_PARAMS, **overrides}, on_epoch, should_stop)
