"""The training-data profile stored with each version (`profile.json`), and
the pure-Python tokenization that both sides of drift detection share.

Written by the trainer before publish (model_worker/trainer.py); read by the
supervisor (control/quality.py), which compares live traffic with it. This
module imports no TensorFlow, no NumPy: plain Python only, so the supervisor
can use it.

What the profile holds:

- `ngrams`: the n-grams of the training texts, as a compact set of 32-bit
  hashes (CRC-32 of the UTF-8 n-gram; sorted, delta-coded as varints,
  zlib, base64). N-grams are a fixed tokenization independent of the model's
  own, the one bow uses by default: CJK text by characters and character
  bigrams, other scripts by lowercased words (letters and digits). The same
  rule for every architecture makes the signal comparable across them and
  computable without the model.
- `known_share`: the share of each text's n-grams that the rest of the
  training data holds, measured leave-one-out (an n-gram is known when at
  least one *other* training text has it). Measured on the texts themselves
  every n-gram would be known, and in-domain traffic would look foreign.
- `labels`: the training label distribution, and the distribution of the
  labels the model predicted on texts it was not fitted on (out-of-fold for
  auto, the validation split for bow/cnn) when there are such predictions.
- `top_score`: the histogram (fixed bins TOP_SCORE_BINS) of the top score on
  those same held-out predictions; null when nothing was held out.
"""
from __future__ import annotations

import base64
import json
import math
import os
import re
import zlib
from collections import Counter
from typing import Any, Iterable, Sequence

from model_worker.params import _CJK_RANGES

FILENAME = "profile.json"
FORMAT = 1
# Fixed bins: [0, 0.1), [0.1, 0.2), ... [0.9, 1.0]
TOP_SCORE_BINS = [round(i / 10, 1) for i in range(11)]
KNOWN_SHARE_BINS = TOP_SCORE_BINS
# At most this many n-grams are stored (the most document-frequent first):
# ~2.5 bytes each once coded.
MAX_NGRAMS = 200_000

_CJK_CLASS = "".join(f"\\U{low:08x}-\\U{high:08x}" for low, high in _CJK_RANGES)
# A run of CJK characters, or a run of other letters/digits (a word).
_RUNS = re.compile(f"[{_CJK_CLASS}]+|(?:(?![{_CJK_CLASS}])[^\\W_])+")
_IS_CJK = re.compile(f"[{_CJK_CLASS}]")


def ngrams(text: str) -> set[str]:
    """The distinct n-grams of one text: CJK characters and bigrams of
    adjacent CJK characters, and lowercased words of other scripts."""
    out: set[str] = set()
    for run in _RUNS.findall(text.lower()):
        if _IS_CJK.match(run):
            out.update(run)
            out.update(run[i:i + 2] for i in range(len(run) - 1))
        else:
            out.add(run)
    return out


def ngram_hash(gram: str) -> int:
    return zlib.crc32(gram.encode("utf-8"))


def _hashes(text: str) -> set[int]:
    return {zlib.crc32(g.encode("utf-8")) for g in ngrams(text)}


# -- the hashed set ---------------------------------------------------------------------
def encode_set(hashes: Iterable[int]) -> str:
    out = bytearray()
    prev = 0
    for h in sorted(set(hashes)):
        d, prev = h - prev, h
        while d >= 0x80:
            out.append((d & 0x7F) | 0x80)
            d >>= 7
        out.append(d)
    return base64.b64encode(zlib.compress(bytes(out), 9)).decode("ascii")


def decode_set(data: str) -> frozenset[int]:
    raw = zlib.decompress(base64.b64decode(data))
    out, value, shift, prev = [], 0, 0, 0
    for byte in raw:
        value |= (byte & 0x7F) << shift
        if byte & 0x80:
            shift += 7
            continue
        prev += value
        out.append(prev)
        value = shift = 0
    return frozenset(out)


# -- histograms and divergence --------------------------------------------------------------
def histogram(values: Iterable[float], bins: Sequence[float] = TOP_SCORE_BINS) -> list[int]:
    """Counts per bin [b_i, b_i+1); the last bin includes its upper edge."""
    counts = [0] * (len(bins) - 1)
    top = len(counts) - 1
    low, width = bins[0], bins[1] - bins[0]
    for v in values:
        i = int((float(v) - low) / width)
        counts[min(max(i, 0), top)] += 1
    return counts


def shares(counts: Sequence[float]) -> list[float]:
    total = float(sum(counts))
    return [c / total if total else 0.0 for c in counts]


def js_divergence(p: Sequence[float], q: Sequence[float]) -> float:
    """Jensen-Shannon divergence (base 2: 0 = same, 1 = disjoint) of two
    distributions given as weights (normalized here)."""
    p, q = shares(p), shares(q)
    js = 0.0
    for a, b in zip(p, q):
        m = (a + b) / 2
        if a > 0:
            js += 0.5 * a * math.log2(a / m)
        if b > 0:
            js += 0.5 * b * math.log2(b / m)
    return max(0.0, js)


# -- building the profile ---------------------------------------------------------------------
def _known_share_loo(per_text: list[set[int]], df: Counter[int], kept: set[int] | None) -> list[float]:
    """Per text with n-grams: the share of them another training text holds."""
    out = []
    for grams in per_text:
        if not grams:
            continue
        known = sum(1 for g in grams if df[g] >= 2 and (kept is None or g in kept))
        out.append(known / len(grams))
    return out


def build(texts: Sequence[str], labels: Sequence[str], label_names: Sequence[str],
          held_out_probs: Any = None, held_out_on: str | None = None) -> dict[str, Any]:
    """The profile of a training set.

    held_out_probs: rows of probabilities (in label_names order) predicted
    for training texts by a model not fitted on them (out-of-fold, or the
    validation split); held_out_on says which ("out_of_fold", "validation").
    """
    per_text = [_hashes(t) for t in texts]
    df: Counter[int] = Counter()
    for grams in per_text:
        df.update(grams)
    kept: set[int] | None = None
    if len(df) > MAX_NGRAMS:
        kept = {g for g, _ in sorted(df.items(), key=lambda kv: (-kv[1], kv[0]))[:MAX_NGRAMS]}
    known = _known_share_loo(per_text, df, kept)
    label_counts = Counter(labels)
    profile: dict[str, Any] = {
        "format": FORMAT,
        "texts": len(texts),
        "ngrams": {"tokenization": "cjk characters + character bigrams; other scripts: "
                                   "lowercased words",
                   "hash": "crc32", "count": len(kept) if kept is not None else len(df),
                   "set": encode_set(kept if kept is not None else df)},
        "known_share": {"measured_on": "leave_one_out",
                        "mean": round(sum(known) / len(known), 6) if known else None,
                        "bins": KNOWN_SHARE_BINS, "counts": histogram(known, KNOWN_SHARE_BINS)},
        "labels": {"names": list(label_names),
                   "train": {name: round(label_counts[name] / max(1, len(labels)), 6)
                             for name in label_names}},
        "top_score": None,
    }
    if held_out_probs is not None and len(held_out_probs):
        rows = [list(map(float, row)) for row in held_out_probs]
        top = [max(row) for row in rows]
        predicted = Counter(label_names[row.index(max(row))] for row in rows)
        profile["labels"]["predicted"] = {name: round(predicted[name] / len(rows), 6)
                                          for name in label_names}
        profile["labels"]["predicted_on"] = held_out_on
        profile["top_score"] = {"measured_on": held_out_on, "n": len(rows),
                                "bins": TOP_SCORE_BINS, "counts": histogram(top)}
    return profile


def write(folder: str, texts: Sequence[str], labels: Sequence[str], label_names: Sequence[str],
          held_out_probs: Any = None, held_out_on: str | None = None) -> dict[str, Any]:
    """Build the profile and write it as folder/profile.json; returns it."""
    prof = build(texts, labels, label_names, held_out_probs, held_out_on)
    with open(os.path.join(folder, FILENAME), "w", encoding="utf-8") as fh:
        json.dump(prof, fh, ensure_ascii=False)
    return prof


def read(folder: str) -> dict[str, Any] | None:
    """A version folder's profile, or None when it has none (older versions)."""
    path = os.path.join(folder, FILENAME)
    try:
        with open(path, encoding="utf-8") as fh:
            prof = json.load(fh)
    except FileNotFoundError:
        return None
    if not isinstance(prof, dict) or prof.get("format") != FORMAT:
        return None
    return prof


def known_shares(texts: Iterable[str], known: frozenset[int]) -> list[float]:
    """Per text with n-grams: the share of them in `known` (a decoded set)."""
    out = []
    for text in texts:
        grams = _hashes(text)
        if grams:
            out.append(sum(1 for g in grams if g in known) / len(grams))
    return out
