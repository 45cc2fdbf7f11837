"""Zero-shot versions: a classifier from one description per label, no labelled data.

`POST /train` with `"labels": {"<label>": "<description>", ...}` and no `data`
trains architecture "zero_shot" (control/jobs.py; the job's data is the
descriptions, one row per label). Each description is embedded with the same
pretrained view as `auto` uses (model_worker/pretrained.py): the mean WordLlama
subword vector of its words. The served graph is an ordinary Keras model, raw
strings in:

    text -> PretrainedEmbedding (mean vector of the text's known words and
            punctuation marks, scaled
            to unit L2 norm) -> Dense "probs" without bias, its kernel the
            descriptions' unit vectors divided by TEMPERATURE -> softmax

so a label's logit is cos(text, description) / TEMPERATURE and the scores are
softmax(cosines / TEMPERATURE).

What the scores mean: a ranking of the labels by similarity to their
descriptions, and nothing more. Without labelled texts there is nothing to
calibrate on: TEMPERATURE is fixed, not fitted, so a score of 0.8 is not an
80 % chance of being right, and the version has no risk-coverage (abstain)
table; `min_score` thresholds on it are arbitrary until a retrain on labels
(the retrain policy's, see control/policies.py) gives a calibrated model. A text
with no known word (none in the word table) scores every label the same
(1 / number of labels).

The word table covers the descriptions' own words and the FREQUENT_WORDS most
frequent English words, so a version holds the same Llama 2-derived
vectors as the pretrained view, and the trainer copies the NOTICE beside it.
Imported in trainer processes only (model_worker/trainer.py).
"""
from __future__ import annotations

import time
from typing import Any

import keras
import numpy as np

from model_worker import pretrained
from model_worker.textmodel import TrainResult

# softmax(cos / T). Cosines of mean WordLlama vectors between a text and the
# descriptions of different labels differ by a few hundredths to a few tenths;
# at T = 0.07 a cosine 0.1 higher gives e^1.4 = 4 times the score. Fixed: there
# are no labels to fit it on (see the module docstring). 0.07 is where the
# expected calibration error of bench/zeroshot.py's set (debian_en, one-line
# descriptions) was lowest (0.05: ECE 0.149; 0.07: 0.056); other sets differ.
TEMPERATURE = 0.07
# Frequent English words in the zero-shot word table (auto's view takes 30,000
# beside its training texts' own words; here there are no training texts, so
# every word a served text may use must come from this list). On
# bench/zeroshot.py's set: 30,000 words cover 87.5 % of the test texts' running
# words (accuracy 0.563), 100,000 cover 92.7 % (0.585, the package's own
# mean-vector cosine rule on whole texts: 0.586), 200,000 cover 94.3 % (0.597).
# The table stores each subword vector its words use once and each word's
# subword ids (build_table pieces=True, PretrainedEmbedding `pieces`): with
# 100,000 words model.keras is 12.6 MB and a serving worker holds 100.6 MB
# private (a summed float16 vector a word, the layout before: 65.2 MB and
# 256.8 MB; docs/models.md); a retrain on labels goes back to auto's table.
FREQUENT_WORDS = 100_000
# How the zero-shot view splits a text: words as written (case kept, auto's
# case-kept table: LLaMA's pieces are case-sensitive and the package's own
# embedding of a text sees them as written), each punctuation mark a token of
# its own (layers.standardize_cased_punct): there are no training texts to
# bring "kernel," or "Linux." into the table, so marks are split off, each
# with its pieces as a word of its own ("▁."; its pieces attached to a
# word, ".", as embed() has them, measured lower on all four sets but
# wordnet_en: debian_en 0.5763 vs 0.5840, manpages_en 0.4074 vs 0.4444,
# fortunes_en 0.3210 vs 0.3233). A word the table lacks as written falls back to
# its lowercase, then capitalized form. The frequent words come lowercase and,
# the first CAPITALIZED of them, capitalized. bench/zeroshot.py compares it
# with the package's own rule (the cosine of embed(text) and
# embed(description), both as written) per set: docs/models.md.
STANDARDIZE = "cased_punct"
CAPITALIZED = 30_000


def description_vectors(view: pretrained.PretrainedView, descriptions: list[str]) -> np.ndarray:
    """Each description's mean subword vector, unit L2 norm (zeros: no known word)."""
    return view.features(descriptions)


def train(descriptions: list[str], labels: list[Any], params: dict[str, Any]) -> TrainResult:
    """A zero-shot model: `descriptions[i]` describes `labels[i]` (one row per label)."""
    started = time.monotonic()
    if not pretrained.available():
        raise RuntimeError("a zero-shot version needs the pretrained view: the wordllama "
                           "package is not installed")
    if not params.get("pretrained", True):
        raise ValueError("a zero-shot version needs the pretrained view (params.pretrained is "
                         "false)")
    names = [str(x) for x in labels]
    if len(set(names)) != len(names) or len(names) < 2:
        raise ValueError("zero-shot: one description per label, at least two labels")
    order = sorted(range(len(names)), key=lambda i: names[i])
    names = [names[i] for i in order]
    texts = [descriptions[i] for i in order]
    table = pretrained.build_table(texts, FREQUENT_WORDS, STANDARDIZE, CAPITALIZED, pieces=True)
    view = pretrained.PretrainedView(table, standardize=STANDARDIZE, scale=1.0)  # unit vectors: dot = cosine
    vectors = description_vectors(view, texts)
    empty = [n for n, v in zip(names, vectors) if not np.any(v)]
    if empty:
        raise ValueError(f"zero-shot: the description(s) of {empty} have no word in the "
                         f"pretrained view's table")

    text_input = keras.Input(shape=(), dtype="string", name="text")
    features = view.layer()(text_input)
    out = keras.layers.Dense(len(names), use_bias=False, activation="softmax", name="probs")
    model = keras.Model(text_input, out(features), name="textswap_zero_shot")
    out.set_weights([(vectors.T / TEMPERATURE).astype(np.float32)])

    sims = vectors @ vectors.T
    off = sims[~np.eye(len(names), dtype=bool)]
    metrics: dict[str, Any] = {
        "measured_on": "none", "zero_shot": True, "n_train": 0, "n_val": 0,
        "tokenize": STANDARDIZE, "vocabulary_size": len(table.words),
        "train_seconds": round(time.monotonic() - started, 3)}
    report: dict[str, Any] = {
        "method": "zero_shot",
        "scores": (f"softmax(cosine(text, description) / {TEMPERATURE}): a fixed temperature, "
                   "not calibrated (there are no labelled texts); a ranking of the labels, not "
                   "a probability of being right"),
        "temperature": TEMPERATURE,
        "descriptions": dict(zip(names, texts)),
        # labels whose descriptions are alike are hard to tell apart
        "description_cosine": {"max_between_labels": round(float(off.max()), 4),
                               "mean_between_labels": round(float(off.mean()), 4)},
        "pretrained": {"used": True, **table.describe(), "scale": 1.0, "pooling": "mean",
                       "split": STANDARDIZE,
                       "unknown_words": "ignored (a text's mean is over its known words; "
                                        "none known: every label scores the same)"},
        "risk_coverage_why": "no labelled texts: the abstain table comes with the first "
                             "training on labels",
    }
    warnings = ["zero-shot version: its scores are uncalibrated similarities to the label "
                "descriptions (no labelled data); feedback and a retrain on it give a "
                "calibrated model"]
    return TrainResult(model=model, labels=names, metrics=metrics, report=report,
                       warnings=warnings)
