"""Training parameters: defaults, validation and tokenizer detection.

The supervisor validates a training request before it starts a trainer
process, so this module must stay importable without TensorFlow or Keras:
plain Python only.

Every default below was chosen by measurement with `bench/accuracy.py`
(Chinese review sentiment and an English multi-class set), not by guess;
the bench prints the table the choices came from.
"""

from __future__ import annotations

import unicodedata
from typing import Any

# --------------------------------------------------------------------------
# Defaults
# --------------------------------------------------------------------------

DEFAULT_PARAMS: dict[str, Any] = {
    # "auto": choose by cross-validation among linear models on word and
    # character n-gram views and the two networks below (autoselect.py).
    # "bow": bag of n-grams (TF-IDF weights) into one softmax layer, the
    # fastText / TF-IDF+linear family. "cnn": embeddings + 1-D convolution.
    "architecture": "auto",
    # auto only: wall-clock seconds for the whole training (search, refit,
    # graph); candidates that would not fit are skipped and reported.
    "time_budget_s": 60.0,
    # auto only: stratified cross-validation folds (fewer when a label has
    # fewer examples than this). null: 5, or 3 from FEW_FOLDS_FROM training
    # texts on, where folds of that size score candidates steadily and 3
    # folds cost half the time of 5, so more of the grid fits the budget.
    "folds": None,
    # auto only: also try the bow and cnn networks when the budget allows.
    "include_networks": False,
    # auto only: among the candidates within one standard error of the best
    # cross-validated macro-F1, serve the cheapest (texts/s at batch 256 in
    # the final graph); false: always the most accurate.
    "cost_aware": True,
    # multi-label data only: a text gets at least this many labels (0 or 1);
    # with 1, a text whose scores all stay under their thresholds gets its
    # best-scoring label (what micro-F1 on data where every text has a
    # label rewards).
    "min_labels": 1,
    # auto only: the views the search may use (see AUTO_VIEWS). ["word"]
    # serves as fast as bow; character views read every character and cost
    # about 4x that on Latin text (README "Serving cost of auto").
    # "pretrained": the mean WordLlama word vector (model_worker/pretrained.py),
    # tried alone and beside the n-gram views on word-tokenized text; it joins
    # the views when they are left at this default, and otherwise only when
    # listed (`views: ["word"]` stays the one cheap view).
    "views": ["word", "char", "punct"],
    # auto only: false: the pretrained view is never tried, whatever `views`
    # says (its vectors derive from Llama 2, under the Llama 2 Community
    # License: see NOTICE and docs/models.md).
    "pretrained": True,
    # "auto" looks at the training texts: CJK-dominant -> "char" (every CJK
    # character is a token, Latin words stay whole), otherwise "word".
    "tokenize": "auto",
    # Highest n-gram order (bow only). 1-2 grams beat 1-3 on both datasets
    # (zh 84.95 vs 84.85, en 73.1 vs 72.5) and train faster.
    "ngrams": 2,
    # Vocabulary size, most document-frequent n-grams first.
    "max_tokens": 100_000,
    # How each n-gram is weighted in the bag (bow only).
    "output_mode": "tf_idf",
    # Scale each text's bag to unit L2 norm (bow only).
    "normalize": True,
    # Use 1 + log(count) instead of the raw count (bow, tf_idf/count).
    "sublinear_tf": False,
    # cnn only: tokens kept per text and embedding width.
    "sequence_length": 200,
    "embedding_dim": 64,
    # Dropout on the pooled vector before the output layer (cnn only; the
    # bow head is a single linear layer on sparse features).
    "dropout": 0.3,
    # L2 penalty on the output layer's kernel.
    "l2": 0.0,
    # An upper bound; early stopping ends training (zh stops after ~5, en
    # after ~20 epochs).
    "epochs": 40,
    "batch_size": 32,
    # Adam. With unit-norm bags 1e-2 reaches the 1e-3 accuracy in a quarter
    # of the epochs (1e-3 needed 20+ epochs, ~65 s on zh).
    "learning_rate": 1e-2,
    # Fraction held out (stratified per label) for early stopping and the
    # reported metrics. 0 trains on everything for `epochs` epochs with no
    # early stopping; metrics are then measured on the training rows.
    "validation_split": 0.1,
    "early_stopping_patience": 3,
    # After early stopping picked the epoch count on the validation rows,
    # train the served model again on all rows for that many epochs.
    # Reported metrics always come from the held-out model.
    "refit": True,
    "seed": 1337,
}

# "zero_shot": no labelled data, one description per label (POST /train with
# "labels": {label: description} and no "data"; model_worker/zeroshot.py);
# control/jobs.py sets it, and refuses it with data.
ARCHITECTURES = ("auto", "bow", "cnn", "zero_shot")
# word: word 1-2-grams; char: character n-grams inside words; punct: the
# same with punctuation and symbols kept (model_worker.autofeatures).
# pretrained: the mean pretrained word vector of the text (model_worker.pretrained).
AUTO_VIEWS = ("word", "char", "punct", "pretrained")
TOKENIZE_MODES = ("auto", "char", "word")
OUTPUT_MODES = ("tf_idf", "multi_hot", "count")

# Default folds of auto (params "folds": null): 5, or 3 from this many texts on.
# 3 folds cost about half the search time of 5, so more of the grid fits the
# budget: fortunes_en (6.9k texts) 0.6988 -> 0.7075 test accuracy with the
# 60 s budget. On wordnet_en (15.9k, 43 labels) the budget binds either way
# and the outcome varies from run to run (0.60-0.625, README "Accuracy").
FEW_FOLDS_FROM = 5000


def default_folds(n_texts: int) -> int:
    return 3 if n_texts >= FEW_FOLDS_FROM else 5


# field -> (inclusive low, inclusive high) for ints; floats use the same
# table with their own bounds. Limits are generous but keep a request from
# asking for something that cannot fit in a worker's memory or time.
_INT_RANGES: dict[str, tuple[int, int]] = {
    "ngrams": (1, 5),
    "max_tokens": (100, 2_000_000),
    "sequence_length": (4, 4096),
    "embedding_dim": (2, 1024),
    "epochs": (1, 500),
    "batch_size": (1, 8192),
    "early_stopping_patience": (0, 100),
    "seed": (0, 2**31 - 1),
    "folds": (2, 10),
    "min_labels": (0, 1),
}
_FLOAT_RANGES: dict[str, tuple[float, float, bool]] = {
    # (low, high, low is exclusive)
    "learning_rate": (0.0, 1.0, True),
    "validation_split": (0.0, 0.5, False),
    "dropout": (0.0, 0.9, False),
    "l2": (0.0, 1.0, False),
    "time_budget_s": (1.0, 3600.0, False),
}
_BOOL_FIELDS = ("normalize", "sublinear_tf", "refit", "include_networks", "cost_aware", "pretrained")
_CHOICES: dict[str, tuple[str, ...]] = {
    "architecture": ARCHITECTURES,
    "tokenize": TOKENIZE_MODES,
    "output_mode": OUTPUT_MODES,
}


def multi_label_refusal(architecture: str) -> str:
    """Why `architecture` does not train on multi-label data (a 400's message)."""
    return (f"multi-label data (several labels per text) trains with architecture 'auto' "
            f"only (one-vs-rest linear models with a decision threshold per label chosen by "
            f"cross-validation); {architecture!r} has a softmax head that picks one label")


class ParamError(ValueError):
    """A training parameter is unknown, of the wrong type or out of range."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def _check_int(field: str, value: Any) -> int:
    # bool is a subclass of int in Python; `epochs: true` is a client bug,
    # not the number 1.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ParamError(field, f"must be an integer, got {type(value).__name__}")
    low, high = _INT_RANGES[field]
    if not low <= value <= high:
        raise ParamError(field, f"must be between {low} and {high}, got {value}")
    return value


def _check_float(field: str, value: Any) -> float:
    # JSON has one number type, so an integer such as `"l2": 0` is accepted.
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ParamError(field, f"must be a number, got {type(value).__name__}")
    try:
        value = float(value)
    except OverflowError:  # a JSON integer with hundreds of digits
        raise ParamError(field, "is far out of range") from None
    low, high, low_exclusive = _FLOAT_RANGES[field]
    if value != value or (value <= low if low_exclusive else value < low) or value > high:
        bracket = "(" if low_exclusive else "["
        raise ParamError(field, f"must be in {bracket}{low}, {high}], got {value}")
    return value


def _check_choice(field: str, value: Any) -> str:
    allowed = _CHOICES[field]
    if not isinstance(value, str) or value not in allowed:
        raise ParamError(field, f"must be one of {', '.join(allowed)}; got {value!r}")
    return value


def _check_views(value: Any) -> list[str]:
    if not isinstance(value, list) or not value:
        raise ParamError("views", f"must be a non-empty list of {', '.join(AUTO_VIEWS)}")
    for view in value:
        if not isinstance(view, str) or view not in AUTO_VIEWS:
            raise ParamError("views", f"each must be one of {', '.join(AUTO_VIEWS)}; got {view!r}")
    if len(set(value)) != len(value):
        raise ParamError("views", "lists a view twice")
    return [v for v in AUTO_VIEWS if v in value]


def pretrained_allowed(params: dict[str, Any]) -> bool:
    """Whether auto may try the pretrained view under these (validated) params."""
    return bool(params.get("pretrained", True)) and (
        "pretrained" in params["views"] or params["views"] == DEFAULT_PARAMS["views"])


def validate_params(user: dict[str, Any] | None) -> dict[str, Any]:
    """Merge `user` over DEFAULT_PARAMS, checking every given field.

    Returns a new dict holding every parameter. Raises ParamError for the
    first bad field (unknown name, wrong type, out of range).
    """
    if user is None:
        user = {}
    if not isinstance(user, dict):
        raise ParamError("params", f"must be an object, got {type(user).__name__}")
    merged = dict(DEFAULT_PARAMS)
    merged["views"] = list(DEFAULT_PARAMS["views"])
    for field in sorted(user):
        value = user[field]
        if not isinstance(field, str) or field not in DEFAULT_PARAMS:
            allowed = ", ".join(sorted(DEFAULT_PARAMS))
            raise ParamError(str(field), f"unknown parameter; allowed: {allowed}")
        if field == "views":
            merged[field] = _check_views(value)
        elif field == "folds" and value is None:
            merged[field] = None
        elif field in _BOOL_FIELDS:
            if not isinstance(value, bool):
                raise ParamError(field, f"must be true or false, got {type(value).__name__}")
            merged[field] = value
        elif field in _INT_RANGES:
            merged[field] = _check_int(field, value)
        elif field in _FLOAT_RANGES:
            merged[field] = _check_float(field, value)
        else:
            merged[field] = _check_choice(field, value)
    return merged


# --------------------------------------------------------------------------
# Tokenizer detection
# --------------------------------------------------------------------------

# Scripts written without spaces between words: each character is a token.
_CJK_RANGES = (
    (0x3040, 0x30FF),  # Hiragana, Katakana
    (0x3400, 0x4DBF),  # CJK Extension A
    (0x4E00, 0x9FFF),  # CJK Unified Ideographs
    (0xF900, 0xFAFF),  # CJK Compatibility Ideographs
    (0x20000, 0x2FA1F),  # CJK Extensions B.. and compatibility supplement
)

# Share of letters that must be CJK for "char" to win. Mixed Chinese text
# with English product names is still Chinese; an English text quoting a
# few characters is still English.
CJK_SHARE_FOR_CHAR = 0.3
# Looking at this many characters is plenty to decide and keeps detection
# cheap on large uploads.
_SAMPLE_CHARS = 200_000


def _is_cjk(code: int) -> bool:
    return any(low <= code <= high for low, high in _CJK_RANGES)


def detect_tokenize(texts: list[str]) -> str:
    """Return "char" when CJK characters dominate the letters, else "word"."""
    cjk = letters = seen = 0
    for text in texts:
        for ch in text:
            code = ord(ch)
            if _is_cjk(code):
                cjk += 1
                letters += 1
            elif ch.isalpha() or unicodedata.category(ch) == "Nd":
                letters += 1
        seen += len(text)
        if seen >= _SAMPLE_CHARS:
            break
    if letters and cjk / letters >= CJK_SHARE_FOR_CHAR:
        return "char"
    return "word"


def resolve_tokenize(params: dict[str, Any], texts: list[str]) -> str:
    """The concrete tokenizer for these params and training texts."""
    mode = params.get("tokenize", "auto")
    return detect_tokenize(texts) if mode == "auto" else mode
