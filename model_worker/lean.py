"""The lean serving engine: a linear text model answered without TensorFlow.

A worker forked from the zygote that loads a Keras model writes to about
41 MB of the zygote's pages (TensorFlow's context, Keras' load and the
function's trace: docs/benchmarks.md), whatever the model. Every model that
`auto` trains with its linear learners, every `bow` model and every
zero-shot model is a short chain of steps that NumPy computes as well:
standardize the text, split it into words or character n-grams, look them
up, weigh the bag (TF-IDF), one matrix product, softmax or sigmoid. So the
trainer writes that chain beside `model.keras` as `lean.npz` (a plan:
`export`), and a worker that finds it serves from it (`Plan`) and never
touches TensorFlow: its private memory is the model's own tables
(bench/worker_pages.py).

Equal answers are the contract. The steps here compute what the model's
layers (model_worker/layers.py, Keras' TextVectorization, Dense,
Activation) compute, in the same order, in float32; `export` runs the plan
against the Keras model on the training texts and a fixed set of awkward
texts (case, marks, CJK, Greek final sigma, tabs, NUL) and writes it only
when every score agrees within 1e-5; otherwise the version serves through
Keras as before. The character classes and the lowercasing are
TensorFlow's, not Python's: TensorFlow's regular expressions (RE2) and its
lowercasing (ICU) carry older Unicode tables than Python's, so the tables
in `tf_unicode.json` were read from TensorFlow itself, one code point at a
time (`python -m model_worker.lean --write-tables`;
tests/test_lean.py checks them against the TensorFlow installed).

How: a batch is standardized and split in NumPy (TextOps.words: each
character's category decides what every standardizer does with it), its
words and n-grams are keyed from their code points (64-bit polynomial
keys: no n-gram string is built), and the keys are looked up in each
vocabulary's hash table (Vocab), which the trainer builds and the plan
stores; then TF-IDF weights, the linear maps and the activation, in
float32 as the layers compute them.

Not planned (served through Keras): `cnn` models, layers this module does
not know, and versions trained before the plan existed. Explanations load
the Keras model on the first request that asks for one.

Imports NumPy, SciPy and the standard library only (the worker's zygote
holds them; the supervisor may import this module); `export` imports Keras
when it runs.
"""
from __future__ import annotations

import io
import json
import os
import re
import unicodedata
from itertools import accumulate, chain
from typing import Any, Callable

import numpy as np

from model_worker.pieces import greedy_pieces

# The plan's file inside a version folder.
PLAN_FILE = "lean.npz"
FORMAT = 2  # 1: vocabularies as strings (never served by a release)
# Scores may differ from the Keras graph's by float rounding only.
TOLERANCE = 1e-5
TABLES_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tf_unicode.json")


class _Restart(Exception):
    """Plan._pieced ran out of rows and forgot them: the call starts again."""


class Unsupported(Exception):
    """The model holds a step the lean engine does not compute."""


# --------------------------------------------------------------------------
# TensorFlow's text operations, in Python
# --------------------------------------------------------------------------

def _char_class(ranges: list[list[int]], negate: bool = False) -> str:
    """A regular expression class of these code points (one that matches
    nothing, or anything, when there are none)."""
    if not ranges:
        return r"[^\x00-\U0010ffff]" if not negate else r"[\x00-\U0010ffff]"
    body = "".join(f"\\U{lo:08x}" if lo == hi else f"\\U{lo:08x}-\\U{hi:08x}" for lo, hi in ranges)
    return f"[{'^' if negate else ''}{body}]"


_UNICODE = 0x110000


def _mask(ranges: list[list[int]]) -> np.ndarray:
    """A code point set as a boolean array over all of Unicode."""
    m = np.zeros(_UNICODE, dtype=bool)
    for lo, hi in ranges:
        m[lo:hi + 1] = True
    return m


def _as_ranges(mask: np.ndarray) -> list[list[int]]:
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    return [[int(lo), int(hi) - 1] for lo, hi in zip(edges[::2], edges[1::2])]


# What tf.strings.split splits on: " \t\n\v\f\r"
_BLANKS = [[9, 13], [32, 32]]

# A code point's category (TextOps.category): what every standardizer does
# with it follows from it (_ROLES)
BLANK, SPACE, CJK, WORD, MARK = range(5)
# per standardizer (None: the text split as it is), what each category is in
# its words: 0 a separator, 1 part of a run (a word), 2 a word of its own
_ROLES = {
    "word": (0, 0, 1, 1, 0),         # letters, marks, digits; CJK runs whole
    "char": (0, 0, 2, 1, 0),         # ... each CJK character a word of its own
    "lower": (0, 0, 1, 1, 1),        # anything but whitespace
    "word_punct": (0, 1, 1, 1, 2),   # each mark or symbol a word of its own
    "cased": (0, 1, 1, 1, 1),        # anything but the split's blanks
    "cased_punct": (0, 1, 1, 1, 2),
}
_LOWERED = ("word", "char", "lower", "word_punct")


class Words:
    """A batch's words, as code points: word k is cps[starts[k]:starts[k] +
    lengths[k]], from text text[k] (ascending; a text's words in order)."""
    __slots__ = ("cps", "starts", "lengths", "text", "n", "_keys")

    def __init__(self, cps: np.ndarray, starts: np.ndarray, lengths: np.ndarray, text: np.ndarray,
                 n: int) -> None:
        self.cps, self.starts, self.lengths, self.text, self.n = cps, starts, lengths, text, n
        self._keys: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.starts)

    def keys(self) -> np.ndarray:
        """Each word's key (_poly_keys), computed once."""
        if self._keys is None:
            self._keys = _poly_keys(self.cps, self.starts, self.lengths)
        return self._keys

    def strings(self, which: np.ndarray | None = None) -> list[str]:
        idx = range(len(self.starts)) if which is None else which.tolist()
        cps, starts, lengths = self.cps, self.starts, self.lengths
        return [cps[starts[k]:starts[k] + lengths[k]].tobytes().decode("utf-32-le") for k in idx]

    def per_text(self) -> list[list[str]]:
        out: list[list[str]] = [[] for _ in range(self.n)]
        for t, w in zip(self.text.tolist(), self.strings()):
            out[t].append(w)
        return out


class TextOps:
    """The standardizers of layers.py followed by tf.strings.split, on a
    whole batch at once in NumPy (`words`), with TensorFlow's character
    classes and lowercasing (tf_unicode.json). Every lean step reads a text
    as the words of its split, so a standardizer's spacing is never built:
    what a standardizer does to a character depends only on its category
    (blank, other whitespace, CJK letter, other letter or digit, mark or
    symbol), and the words are the runs and singles it leaves."""

    def __init__(self, tables: dict[str, Any]) -> None:
        word, cjk, space = (_mask(tables[k]) for k in ("word", "cjk", "space"))
        blank = _mask(_BLANKS)
        cat = np.full(_UNICODE, MARK, dtype=np.uint8)
        cat[word & ~cjk] = WORD
        cat[word & cjk] = CJK
        cat[space & ~blank] = SPACE
        cat[blank] = BLANK
        self.category = cat
        self.is_word = word  # the class strip_marks keeps (layers.strip_marks)
        self._ascii_marks = "".join(chr(cp) for cp in range(128) if not word[cp])
        self._roles = {k: np.array(v, dtype=np.uint8) for k, v in _ROLES.items()}
        # Python's re tests a class with characters past U+FFFF range by
        # range; restricted to the BMP it is a bitmap: a text takes the
        # narrowest pattern it fits
        self._edges = []
        self._differ_res: list[Any] = []
        tf_lower = {int(k): v for k, v in tables["lower"].items()}
        if tables.get("python_unicode") == unicodedata.unidata_version:
            differ = [int(k) for k in tables["python_differs"]]
        else:
            differ = [cp for cp in range(1, 0x110000) if not 0xD800 <= cp <= 0xDFFF
                      and chr(cp).lower() != tf_lower.get(cp, chr(cp))]
        # TensorFlow's lowercase of each code point it changes; where Python's
        # str.lower (its own Unicode version) says otherwise, TensorFlow's wins
        self._differ = {cp: tf_lower.get(cp, chr(cp)) for cp in differ}
        for top in (0x80, 0x10000, _UNICODE):
            non_word = _char_class(_as_ranges(word[:top]), negate=True)
            self._edges.append(re.compile(f"^{non_word}+|{non_word}+\\Z").sub)
            here = [cp for cp in differ if cp < top]
            self._differ_res.append(re.compile(_char_class([[cp, cp] for cp in here])).search if here else None)

    def _narrowest(self, text: str) -> int:
        if text.isascii():
            return 0
        return 1 if max(text) <= "\uffff" else 2

    def lower(self, text: str) -> str:
        """tf.strings.lower(text, encoding="utf-8"): ICU's full lowercase
        (final sigma included), the text cut at its first NUL (TensorFlow
        reads it as a C string there)."""
        text = text.partition("\x00")[0]
        if text.isascii() and self._differ_res[0] is None:  # TensorFlow's ASCII lowercase is Python's
            return text.lower()
        search = self._differ_res[self._narrowest(text)]
        if search is None or not search(text):
            return text.lower()
        out, pos = [], 0
        for ch_pos, ch in enumerate(text):
            if ord(ch) in self._differ:
                out.append(text[pos:ch_pos].lower())
                out.append(self._differ[ord(ch)])
                pos = ch_pos + 1
        out.append(text[pos:].lower())
        return "".join(out)

    def strip_marks(self, word: str) -> str:
        if word.isascii():  # str.strip of the ASCII characters outside the word class
            return word.strip(self._ascii_marks)
        return self._edges[self._narrowest(word)]("", word)

    def fallback_keys(self, words: Words, miss: np.ndarray, strip: bool) -> np.ndarray:
        """(forms, len(miss)) keys of the other forms of the words `miss`
        (layers._lookup): lowercased; with `strip`, also without the marks at
        their ends, as written, then lowercased. ASCII words (most words
        unknown as written) are lowercased and stripped in NumPy, without a
        string each; the others go through lower and strip_marks, and so do
        all of a few words (a single text's: fewer NumPy calls)."""
        if len(miss) <= self._FEW_WORDS:
            return self._fallback_strings(words.strings(miss), strip)
        lengths = words.lengths[miss]
        cps, starts = _gather(words.cps, words.starts[miss], lengths)
        lowered = np.where((cps >= 65) & (cps <= 90), cps + 32, cps)
        if not strip:
            rows = [_segment_keys(lowered, starts, lengths)]
        else:
            m = len(miss)
            seg = np.repeat(np.arange(m, dtype=np.int64), lengths)
            inner = self.is_word[cps]
            through = np.cumsum(inner, dtype=np.int64)  # word characters up to here...
            through -= (through[starts] - inner[starts])[seg]  # ...from the word's start
            total = np.bincount(seg, weights=inner, minlength=m).astype(np.int64)
            lead = np.bincount(seg, weights=through == 0, minlength=m).astype(np.int64)
            trail = np.bincount(seg, weights=(through == total[seg]) & ~inner, minlength=m).astype(np.int64)
            keep = np.where(total > 0, lengths - lead - trail, 0)
            # the three forms' segments in one array (lowered, then as
            # written without the marks, then lowered without them): one
            # key pass
            both = np.concatenate([lowered, cps])
            n = len(cps)
            forms, at = _gather(both, np.concatenate([starts, starts + lead + n, starts + lead]),
                                np.concatenate([lengths, keep, keep]))
            rows = list(_segment_keys(forms, at, np.concatenate([lengths, keep, keep])).reshape(3, m))
        keys = np.stack(rows)
        # the rest as strings: another script's lowercase is TensorFlow's
        # table's, and a NUL cuts the lowercase there
        plain = (np.maximum.reduceat(cps, starts) < 128) & (np.minimum.reduceat(cps, starts) > 0) \
            if len(cps) else np.ones(len(miss), dtype=bool)
        other = np.flatnonzero(~plain)
        if len(other):
            keys[:, other] = self._fallback_strings(words.strings(miss[other]), strip)
        return keys

    _FEW_WORDS = 32

    def fallback_forms(self, word: str, strip: bool) -> list[str]:
        """A word's other forms, in the order layers._lookup tries them:
        lowercased; with `strip`, without the marks at its ends as written,
        then that lowercased."""
        if not strip:
            return [self.lower(word)]
        bare = self.strip_marks(word)
        return [self.lower(word), bare, self.lower(bare)]

    def _fallback_strings(self, unknown: list[str], strip: bool) -> np.ndarray:
        """fallback_keys of the words `unknown`, through their strings."""
        forms = [self.fallback_forms(w, strip) for w in unknown]
        return string_keys([f[i] for i in range(3 if strip else 1) for f in forms]).reshape(-1, len(unknown))

    def words(self, texts: list[str], standardize: str | None) -> Words:
        """The words of each text, standardized `standardize`'s way and split
        (None: split only), as tf.strings.split(_STANDARDIZERS[...](texts))."""
        if standardize in _LOWERED:
            texts = [self.lower(t) for t in texts]
        roles = self._roles[standardize or "cased"]
        n = len(texts)
        # "\n" is a blank: no word runs from one text into the next
        cps = np.frombuffer("\n".join(texts).encode("utf-32-le"), dtype=np.uint32)
        role = roles[self.category[cps]]
        member = role != 0
        after_run = np.empty(len(role), dtype=bool)
        if len(role):
            after_run[0] = False
            after_run[1:] = role[:-1] == 1
        start = member & ((role == 2) | ~after_run)
        pos = np.flatnonzero(member)
        first = np.flatnonzero(start[pos])
        lengths = np.empty(len(first), dtype=np.int64)
        lengths[:-1] = first[1:] - first[:-1]
        if len(first):
            lengths[-1] = len(pos) - first[-1]
        chars = np.fromiter(map(len, texts), dtype=np.int64, count=n)
        text_of = np.repeat(np.arange(n, dtype=np.int64), chars + 1)
        return Words(cps[pos], first, lengths, text_of[pos[first]], n)

    def tokenize(self, texts: list[str], standardize: str | None) -> list[list[str]]:
        """The words as strings, text by text (tests, and what a person reads)."""
        return self.words(texts, standardize).per_text()


# --------------------------------------------------------------------------
# Keys: 64-bit numbers for tokens, computed alike from a batch's code points
# and from a vocabulary's strings
# --------------------------------------------------------------------------

# odd multipliers: a string's key is its code points (each + 1, so that no
# digit is 0) as a number in base _P, modulo 2^64; an n-gram of words is its
# words' keys in base _Q
_P = np.uint64(0x9E3779B97F4A7C15)
_Q = np.uint64(0xC2B2AE3D27D4EB4F)
_MAX_POW = 1 << 12
_SLOT_MIX = np.uint64(0xD6E8FEB86659FD93)


def _powers(n: int) -> np.ndarray:
    out = np.empty(max(n, 1), dtype=np.uint64)
    out[0] = 1
    with np.errstate(over="ignore"):
        for i in range(1, len(out)):  # small n: the longest word
            out[i] = out[i - 1] * _P
    return out


_POW = _powers(_MAX_POW)


def _poly_keys(cps: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Each segment's key: sum of (cp + 1) * P^(places after it), mod 2^64."""
    if not len(starts):
        return np.zeros(0, dtype=np.uint64)
    seg = np.repeat(np.arange(len(starts), dtype=np.int64), lengths)
    after = (starts + lengths)[seg] - 1 - np.arange(len(cps), dtype=np.int64)
    pw = _POW if int(after.max(initial=0)) < _MAX_POW else _powers(int(after.max()) + 1)
    with np.errstate(over="ignore"):
        terms = (cps.astype(np.uint64) + np.uint64(1)) * pw[after]
        keys = np.add.reduceat(terms, starts) if len(terms) else np.zeros(len(starts), np.uint64)
    keys = keys.astype(np.uint64)
    keys[lengths == 0] = 1
    keys[keys == 0] = 1  # 0 marks an empty slot in Vocab
    return keys


_PY_P, _LOW64 = int(_P), (1 << 64) - 1


def python_key(token: str) -> int:
    """A string's key (string_keys), in Python integers: for a few strings,
    cheaper than a NumPy pass."""
    h = 0
    for c in token.encode() if token.isascii() else map(ord, token):
        h = (h * _PY_P + c + 1) & _LOW64
    return h or 1


def hash_key(token: str) -> int:
    """A string's key in a table of words keyed by Python's own str hash
    (hashed_words): computed in C, where python_key takes a Python step a
    character. Python's hash differs from process to process: such a table
    is built where it is used, from the words themselves."""
    return (hash(token) & _LOW64) or 1


def hashed_words(blob: np.ndarray, size: int) -> "Vocab | None":
    """The table of the words in `blob` (UTF-8, one word a line, word i
    having id i), keyed by hash_key; None when it cannot be built (the
    count differs from `size`, or two words share a key). It is
    only ever probed with find, so it may be fuller than lookup's half
    (1.5 MB for 70,000 words). The words are read a few thousand at a
    time: the strings of all of them at once would take megabytes that
    Python's allocator may keep."""
    raw = blob.tobytes()
    keys = np.empty(size, dtype=np.uint64)
    at = done = 0
    while at <= len(raw) and done <= size:
        end = raw.find(b"\n", at + 65536)
        end = len(raw) if end < 0 else end
        part = [hash_key(w) for w in raw[at:end].decode("utf-8").split("\n")]
        if done + len(part) > size:
            return None
        keys[done:done + len(part)] = part
        done, at = done + len(part), end + 1
    if done != size or len(np.unique(keys)) != size:
        return None
    return Vocab.of_keys(keys, max(4, (size * 8 // 5).bit_length()))


def string_keys(tokens: list[str]) -> np.ndarray:
    """Each string's key, as _poly_keys computes it from code points."""
    cps = np.frombuffer("".join(tokens).encode("utf-32-le"), dtype=np.uint32)
    lengths = np.fromiter(map(len, tokens), dtype=np.int64, count=len(tokens))
    starts = np.zeros(len(tokens), dtype=np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    return _segment_keys(cps, starts, lengths)


def _gather(cps: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The segments cps[starts[k]:starts[k] + lengths[k]], one after the
    other, and where each now starts."""
    at = np.cumsum(lengths) - lengths
    idx = np.repeat(starts - at, lengths) + np.arange(int(lengths.sum()), dtype=np.int64)
    return cps[idx], at


def _segment_keys(cps: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Each segment's key, as string_keys gives its string's (segments one
    after the other in cps; an empty one is the empty string's)."""
    keys = np.ones(len(starts), dtype=np.uint64)
    full = lengths > 0
    if full.any():
        keys[full] = _poly_keys(cps, starts[full], lengths[full])
    return keys


def _fold(parts: list[np.ndarray]) -> np.ndarray:
    """The key of n-grams whose words' keys are parts[0], parts[1], ..."""
    h = parts[0].copy()
    with np.errstate(over="ignore"):
        for k in parts[1:]:
            h = h * _Q + k
    h[h == 0] = 1
    return h


def ngram_string_keys(tokens: list[str]) -> np.ndarray:
    """Keys of word n-grams written as strings ("the striker": words joined by
    one space), as the batch's word keys fold them (_fold)."""
    words = [t.split(" ") for t in tokens]
    counts = np.fromiter(map(len, words), dtype=np.int64, count=len(words))
    flat = string_keys(list(chain.from_iterable(words)))
    first = np.zeros(len(words), dtype=np.int64)
    np.cumsum(counts[:-1], out=first[1:])
    out = flat[first].copy()
    with np.errstate(over="ignore"):
        for i in range(1, int(counts.max(initial=1))):
            more = counts > i
            out[more] = out[more] * _Q + flat[first[more] + i]
    out[out == 0] = 1
    return out


def word_ngram_keys(words: Words, widths: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """(keys, texts) of the batch's word n-grams of `widths` (no n-gram
    spans two texts), as tf.strings.ngrams with separator " "."""
    k, text = words.keys(), words.text
    keys, rows = [], []
    for w in widths:
        m = len(k) - w + 1
        if m <= 0:
            continue
        same = text[:m] == text[w - 1:w - 1 + m]
        keys.append(_fold([k[i:i + m] for i in range(w)])[same] if w > 1 else k)
        rows.append(text[:m][same] if w > 1 else text)
    if not keys:
        return np.zeros(0, dtype=np.uint64), np.zeros(0, dtype=np.int64)
    return np.concatenate(keys), np.concatenate(rows)


def char_ngram_keys(words: Words, widths: tuple[int, ...], unigrams: bool) -> tuple[np.ndarray, np.ndarray]:
    """(keys, texts) of each word's character n-grams of `widths` within the
    word padded with a space at each end (layers._char_ngrams), and with
    `unigrams` its characters; keyed as string_keys keys the n-gram."""
    n_words = len(words)
    if not n_words:
        return np.zeros(0, dtype=np.uint64), np.zeros(0, dtype=np.int64)
    lengths = words.lengths
    padded = lengths + 2
    out_start = np.zeros(n_words, dtype=np.int64)
    np.cumsum(padded[:-1], out=out_start[1:])
    total = int(padded.sum())
    top = max(widths)
    digits = np.full(total + top, 33, dtype=np.uint64)  # " " + 1
    digits[total:] = 0
    of_char = np.repeat(np.arange(n_words, dtype=np.int64), lengths)
    char_at = np.arange(len(words.cps), dtype=np.int64) + 2 * of_char + 1
    digits[char_at] = words.cps.astype(np.uint64) + np.uint64(1)
    of_place = np.repeat(np.arange(n_words, dtype=np.int64), padded)
    room = (out_start + padded)[of_place] - np.arange(total, dtype=np.int64)
    keys, rows = [], []
    if unigrams:
        keys.append(digits[char_at])
        rows.append(words.text[of_char])
    h = digits[:total].copy()
    with np.errstate(over="ignore"):
        for w in range(2, top + 1):
            h = h * _P + digits[w - 1:w - 1 + total]
            if w in widths:
                ok = room >= w
                keys.append(h[ok])
                rows.append(words.text[of_place[ok]])
    if not keys:
        return np.zeros(0, dtype=np.uint64), np.zeros(0, dtype=np.int64)
    out = np.concatenate(keys)
    out[out == 0] = 1
    return out, np.concatenate(rows)


_TEXT_OPS: TextOps | None = None


def text_ops() -> TextOps:
    global _TEXT_OPS
    if _TEXT_OPS is None:
        with open(TABLES_FILE, encoding="utf-8") as fh:
            _TEXT_OPS = TextOps(json.load(fh))
    return _TEXT_OPS


# --------------------------------------------------------------------------
# The plan: steps and their arrays
# --------------------------------------------------------------------------

class Bag:
    """A batch's sparse rows: (row, column) cells in row order, float32 values."""
    __slots__ = ("rows", "cols", "vals", "n", "width")

    def __init__(self, rows: np.ndarray, cols: np.ndarray, vals: np.ndarray, n: int, width: int) -> None:
        self.rows, self.cols, self.vals, self.n, self.width = rows, cols, vals, n, width


class Vocab:
    """key -> id (0: unknown) for a vocabulary: an open-addressing hash
    table in two NumPy arrays, 12 bytes a slot, at most half full.

    A dict of the tokens would hold each as a Python string and an int
    object, about 150 bytes a token: 15 MB for a bag of 100,000 n-grams,
    most of a lean worker's memory, and a lookup would need each n-gram as
    a Python string. Here a batch's n-grams are keyed from its code points
    in NumPy (string_keys, word_ngram_keys, char_ngram_keys: the same key a
    vocabulary token's string gets) and all found at once. A token matches
    only a vocabulary token with the same 64-bit key: a false match needs a
    collision, about once in 10^14 lookups for 100,000 tokens. A vocabulary
    whose own keys collide cannot be planned (Unsupported).
    """

    def __init__(self, keys: np.ndarray, ids: np.ndarray, size: int) -> None:
        """The table as `build` made it (a plan stores it: a worker reads two
        arrays and builds nothing)."""
        bits = len(keys).bit_length() - 1
        if len(keys) != 1 << bits or len(ids) != len(keys) or bits < 4:
            raise Unsupported("a vocabulary table that is not a power of two of slots")
        self.keys, self.ids, self.size = np.asarray(keys, dtype=np.uint64), np.asarray(ids), int(size)
        self.mask = np.uint64((1 << bits) - 1)
        self.shift = np.uint64(64 - bits)
        self._mask, self._bits_out = (1 << bits) - 1, 64 - bits  # the same, as Python ints (find)
        # find reads single slots through these (a NumPy scalar read costs more)
        self._key_view, self._id_view = self.keys.data, self.ids.data
        self.reach: int | None = None

    @classmethod
    def build(cls, tokens: list[str], kind: str) -> "Vocab":
        """The table of a vocabulary (token i: id i). kind "ngrams": word
        n-grams written with single spaces; "strings": anything else."""
        keys = ngram_string_keys(tokens) if kind == "ngrams" else string_keys(tokens)
        if len(np.unique(keys)) != len(keys):
            raise Unsupported("two vocabulary tokens share a key")
        return cls.of_keys(keys, max(4, int(2 * len(keys) - 1).bit_length()))

    @classmethod
    def of_keys(cls, keys: np.ndarray, bits: int) -> "Vocab":
        """The table of distinct nonzero keys (key i: id i) in 2**bits slots."""
        self = cls(np.zeros(1 << bits, dtype=np.uint64),
                   np.zeros(1 << bits, dtype=np.int32 if len(keys) < 2**31 else np.int64), len(keys))
        pending = np.arange(len(keys), dtype=np.int64)
        slot = self._slot(keys)
        while len(pending):
            s = slot[pending]
            free = self.keys[s] == 0
            cand, cs = pending[free], s[free]
            taken, first = np.unique(cs, return_index=True)
            won = cand[first]
            self.keys[taken] = keys[won]
            self.ids[taken] = won
            placed = np.zeros(len(keys), dtype=bool)
            placed[won] = True
            pending = pending[~placed[pending]]
            slot[pending] = (slot[pending] + np.uint64(1)) & self.mask
        return self

    def __len__(self) -> int:
        return self.size

    def _slot(self, keys: np.ndarray) -> np.ndarray:
        """A key's first slot: the top bits of key * an odd constant (the low
        bits of a polynomial key depend on the low bits of its digits only)."""
        return (keys * _SLOT_MIX) >> self.shift  # an array's wrap-around is silent

    _WINDOW = 8  # slots compared at once for the last keys not found at their first slot
    _STEPS = np.arange(_WINDOW, dtype=np.uint64)[None, :]
    _FEW = 512  # "the last keys"

    def _reach(self) -> int:
        """The farthest any stored key sits from its first slot: a lookup
        that has looked that far without finding its key stops (computed
        once, at the first lookup that needs it)."""
        if self.reach is None:
            held = np.flatnonzero(self.keys)
            self.reach = int(((held.astype(np.uint64) - self._slot(self.keys[held])) & self.mask).max(initial=0))
        return self.reach

    def lookup(self, keys: np.ndarray) -> np.ndarray:
        """The keys' ids (int64), 0 where unknown."""
        slot = self._slot(keys)
        if len(keys) <= self._FEW:
            # few keys (a single text's): _WINDOW slots from the first, so
            # that nearly every lookup, found or not, ends in this one pass
            places = (slot[:, None] + self._STEPS) & self.mask
            held = self.keys[places]
            col = (held == keys[:, None]).argmax(axis=1)
            every = np.arange(len(keys))
            at = places[every, col]
            hit = held[every, col] == keys
            out = np.where(hit, self.ids[at], 0).astype(np.int64)
            if hit.all():
                return out
            go = ~hit & (held != 0).all(axis=1)  # an empty slot ends a miss
            if not go.any():
                return out
            todo = np.flatnonzero(go)
            return self._windows(out, todo, keys[todo], (slot[todo] + np.uint64(self._WINDOW)) & self.mask,
                                 self._WINDOW)
        held = self.keys[slot]
        hit = held == keys
        out = np.where(hit, self.ids[slot], 0).astype(np.int64)
        go = ~hit & (held != 0)
        if not go.any():  # most lookups end at their first slot
            return out
        # the rest, a slot at a time while many keys are left (each pass ends
        # most of them), then _WINDOW slots at a time: a few NumPy passes for
        # the last keys, where a slot a pass cost a pass per slot of the
        # longest probe (most of a single text's lookup)
        todo = np.flatnonzero(go)
        want = keys[todo]
        slot = (slot[todo] + np.uint64(1)) & self.mask
        reach, done = self._reach(), 1
        while len(todo) > self._FEW and done <= reach:
            held = self.keys[slot]
            hit = held == want
            out[todo[hit]] = self.ids[slot[hit]]
            go = ~hit & (held != 0)
            todo, want, slot = todo[go], want[go], (slot[go] + np.uint64(1)) & self.mask
            done += 1
        return self._windows(out, todo, want, slot, done)

    def find(self, key: int) -> int:
        """One key's id (0: unknown), in Python scalars: for a few keys,
        cheaper than lookup's NumPy calls (every table keeps empty slots:
        every probe ends at its key or an empty one)."""
        slot = ((key * self._MIX) & self._LOW64) >> self._bits_out
        keys, mask = self._key_view, self._mask
        while True:
            held = keys[slot]
            if held == key:
                return int(self._id_view[slot])
            if not held:
                return 0
            slot = (slot + 1) & mask

    _MIX, _LOW64 = int(_SLOT_MIX), _LOW64

    def _windows(self, out: np.ndarray, todo: np.ndarray, want: np.ndarray, slot: np.ndarray,
                 done: int) -> np.ndarray:
        """Find the keys `want` (of out's places `todo`), each looked for in
        `done` slots before `slot` already, _WINDOW slots a pass."""
        want, base = want[:, None], slot[:, None]
        reach = self._reach()
        while len(todo) and done <= reach:
            places = (base + self._STEPS) & self.mask
            held = self.keys[places]
            match = held == want
            found = match.any(axis=1)
            col = match.argmax(axis=1)
            out[todo[found]] = self.ids[places[found, col[found]]]
            go = ~found & (held != 0).all(axis=1)  # an empty slot ends a miss
            todo, want, base = todo[go], want[go], (base[go] + np.uint64(self._WINDOW)) & self.mask
            done += self._WINDOW
        return out


def _counts(rows: np.ndarray, cols: np.ndarray, n: int, width: int) -> Bag:
    """Each (row, column) pair once with how often it came, cells sorted."""
    cells, counts = np.unique(rows * width + cols, return_counts=True)
    return Bag(cells // width, cells % width, counts.astype(np.float32), n, width)


def _csr(rows: np.ndarray, cols: np.ndarray, vals: np.ndarray, n: int, width: int) -> Any:
    """The cells (rows ascending) as a SciPy CSR matrix."""
    import scipy.sparse as sp

    indptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.bincount(rows, minlength=n), out=indptr[1:])
    return sp.csr_matrix((vals, cols, indptr), shape=(n, width))


# Below this many gathered numbers a product is a gather and a sorted sum
# (a CSR matrix costs ~0.1 ms to build, most of a single text's call).
_GATHER_MAX = 1 << 20


_FIRST = np.zeros(1, dtype=np.int64)


def _segment_sum(values: np.ndarray, rows: np.ndarray, n: int) -> np.ndarray:
    """Sum of `values`' rows per text (rows ascending), float32; zeros for a text with none."""
    if n == 1 and len(rows):  # one text: the same sum, without finding where texts start
        return np.add.reduceat(values.astype(np.float32, copy=False), _FIRST, axis=0)
    out = np.zeros((n, values.shape[1]), dtype=np.float32)
    if len(rows):
        starts = np.flatnonzero(np.concatenate(([True], rows[1:] != rows[:-1])))
        out[rows[starts]] = np.add.reduceat(values.astype(np.float32, copy=False), starts, axis=0)
    return out


def _product(rows: np.ndarray, cols: np.ndarray, vals: np.ndarray, n: int, width: int,
             kernel: np.ndarray) -> np.ndarray:
    """The bag's rows times `kernel`: each cell's kernel row, scaled, summed per text."""
    if len(rows) * kernel.shape[1] <= _GATHER_MAX:
        return _segment_sum(kernel[cols] * vals[:, None], rows, n)
    return np.asarray(_csr(rows, cols, vals, n, width) @ kernel, dtype=np.float32)


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _activation(name: str, x: np.ndarray) -> np.ndarray:
    if name == "softmax":
        return _softmax(x)
    if name == "sigmoid":
        return (1.0 / (1.0 + np.exp(-x))).astype(np.float32)
    if name == "linear":
        return x
    raise Unsupported(f"activation {name!r}")


class Plan:
    """A loaded plan: `predict(texts)` -> float32 scores (texts x labels)."""

    def __init__(self, spec: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
        if spec.get("format") != FORMAT:
            raise Unsupported(f"plan format {spec.get('format')!r}, this engine reads {FORMAT}")
        self.ops = text_ops()
        self.steps = spec["steps"]
        self.output = spec["output"]
        self.units = int(spec["units"])
        self.data: dict[str, dict[str, Any]] = {}
        for step in self.steps:
            name, kind = step["name"], step["op"]
            own: dict[str, Any] = {}
            for key in step.get("arrays", ()):
                own[key] = arrays[f"{name}/{key}"]
            if "vocab_keys" in own:
                own["vocab"] = Vocab(own.pop("vocab_keys"), own.pop("vocab_ids"), step["vocab_size"])
            if kind in ("word_logits", "word_mean"):
                own["cache"], own["cache_old"] = {}, {}
                if "words" in own:  # plans from before it have none: python_key's way
                    own["hashed"] = hashed_words(own.pop("words"), own["vocab"].size)
            if "piece_names" in own:  # a word view whose unknown words get pieces
                own["piece_names"] = own["piece_names"].tobytes().decode("utf-8").split("\n")
                names = own["piece_names"]
                if len(names) != step["piece_names"] or names != sorted(set(names)):
                    raise Unsupported("the plan's pieces are not its layer's")
                self._forget_pieced(own)
            if kind == "linear":  # a bag's rows index the kernel: float32, contiguous
                own["kernel"] = np.ascontiguousarray(own["kernel"], dtype=np.float32)
            self.data[name] = own

    @classmethod
    def load(cls, folder: str) -> "Plan":
        with np.load(os.path.join(folder, PLAN_FILE), allow_pickle=False) as npz:
            arrays = {k: npz[k] for k in npz.files}
        spec = json.loads(arrays.pop("plan").tobytes().decode("utf-8"))
        return cls(spec, arrays)

    # -- the steps --------------------------------------------------------------
    def _words_of(self, name: str | None, values: Any) -> Words:
        """The batch's words: `values` are raw texts, standardized the `name`
        way and split, or a Standardize step's words already (name None)."""
        if isinstance(values, Words):
            if name:
                raise Unsupported("a standardizer after a Standardize step")
            return values
        return self.ops.words(values, name)

    def _lookup(self, vocab: Vocab, words: Words, fallback: bool, strip: bool) -> np.ndarray:
        """layers._lookup: as written; with `fallback`, a word unknown so
        lowercased; with `strip`, one still unknown without the marks at its
        ends, as written, then lowercased."""
        ids = vocab.lookup(words.keys())
        if not fallback:
            return ids
        miss = np.flatnonzero(ids == 0)
        if not len(miss):
            return ids
        forms = self.ops.fallback_keys(words, miss, strip)
        # every form at once: one lookup, the first form found wins
        found = vocab.lookup(forms.ravel()).reshape(forms.shape)
        first = (found > 0).argmax(axis=0)
        ids[miss] = found[first, np.arange(len(miss))]
        return ids

    def _run(self, step: dict[str, Any], args: list[Any]) -> Any:
        kind, own = step["op"], self.data[step["name"]]
        if kind == "standardize":
            if isinstance(args[0], Words):
                raise Unsupported("a Standardize step after another")
            return self._words_of(step["standardize"], args[0])
        if kind == "ngrams":  # TextVectorization, output_mode "count", sparse
            words = self._words_of(step["standardize"], args[0])
            vocab = own["vocab"]
            if step["split"] == "whitespace":
                keys, rows = word_ngram_keys(words, tuple(step["ngrams"] or (1,)))
            else:
                keys, rows = char_ngram_keys(words, tuple(step["char_widths"]), step["char_unigrams"])
            return _counts(rows, vocab.lookup(keys), words.n, len(vocab))
        if kind == "char_ngrams":  # CharNgramCounts: no OOV column emitted
            words = self._words_of(step["standardize"], args[0])
            vocab = own["vocab"]
            keys, rows = char_ngram_keys(words, tuple(step["widths"]), step["unigrams"])
            cols = vocab.lookup(keys)
            known = cols > 0
            return _counts(rows[known], cols[known], words.n, len(vocab))
        if kind == "weighting":
            return self._weigh(step, own, args[0])
        if kind == "linear":
            return self._linear(step, own, args[0])
        if kind in ("word_logits", "word_mean"):
            return self._words(step, own, args[0])
        if kind == "add":
            out = args[0]
            for a in args[1:]:
                out = out + a
            return out
        if kind == "activation":
            return _activation(step["activation"], args[0])
        if kind == "reshape":
            return args[0].reshape((args[0].shape[0], *step["shape"]))
        if kind == "mean_axis1":
            return args[0].mean(axis=1, dtype=np.float32)
        if kind == "identity":
            return args[0]
        raise Unsupported(f"step {kind!r}")

    def _weigh(self, step: dict[str, Any], own: dict[str, Any], bag: Bag) -> Any:
        weights = own["weights"]
        if isinstance(bag, Bag):
            vals = bag.vals
            if step["mode"] == "multi_hot":
                vals = np.ones_like(vals)
            elif step["sublinear_tf"]:
                vals = np.float32(1.0) + np.log(vals)
            vals = (vals * weights[bag.cols]).astype(np.float32)
            if step["normalize"]:
                sq = np.bincount(bag.rows, weights=np.square(vals, dtype=np.float32), minlength=bag.n)
                scale = (1.0 / np.sqrt(np.maximum(sq.astype(np.float32), np.float32(1e-12)))).astype(np.float32)
                vals = vals * scale[bag.rows]
            return Bag(bag.rows, bag.cols, vals, bag.n, bag.width)
        raise Unsupported("weighting of a dense input")

    def _linear(self, step: dict[str, Any], own: dict[str, Any], x: Any) -> np.ndarray:
        kernel = own["kernel"]
        if isinstance(x, Bag):
            out = _product(x.rows, x.cols, x.vals, x.n, x.width, kernel)
        else:
            out = np.asarray(x, dtype=np.float32) @ kernel
        if "bias" in own:
            out = out + own["bias"]
        return _activation(step.get("activation", "linear"), out)

    # Python's str.split() also splits on these; tf.strings.split only on
    # _BLANKS (tests/test_lean.py checks the list against Python's)
    _ODD_SPACES = re.compile("[\x1c-\x1f\x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]")
    CACHE_WORDS = 16384  # a word view's cache, both generations
    _FEW_NEW = 64  # new words looked up as Python scalars (_string_ids); more: in NumPy
    _FEW_CACHED = 256  # a batch of more words goes the NumPy way (cheaper a word)
    _FEW_NEW_CHARS = 1024  # ... and their characters (a key costs a Python step a character)
    LONGEST_CACHED = 64  # characters of the longest word the cache keeps

    @classmethod
    def _odd_space(cls, text: str) -> bool:
        """Whether `text` holds one of _ODD_SPACES (an ASCII text can hold
        only the four separators: found by str's own search, where the
        pattern steps a character at a time)."""
        if text.isascii():
            return "\x1c" in text or "\x1d" in text or "\x1e" in text or "\x1f" in text
        return cls._ODD_SPACES.search(text) is not None

    def _cached_ids(self, step: dict[str, Any], own: dict[str, Any],
                    texts: Any) -> tuple[np.ndarray, np.ndarray, list[str]] | None:
        """A word view's ids and text rows through its cache of words: the
        texts split as Python strings (split "cased": blanks only, which is
        str.split() where no text holds another whitespace), each word's id
        (after every fallback) from a dict of the words met before, and only
        the words not in it looked up (_cache_misses). None when the texts
        need the NumPy split. A single text's words are mostly met before,
        and a few dict lookups cost less than the NumPy path's dozens of
        calls (a few microseconds each, whatever the text's length)."""
        if step["standardize"] not in ("cased", None) or not isinstance(texts, list):
            return None
        if any(map(self._odd_space, texts)):
            return None
        split = [t.split() for t in texts]
        flat = split[0] if len(split) == 1 else list(chain.from_iterable(split))
        if len(flat) > self._FEW_CACHED:
            return None
        found: list[int | None] = list(map(own["cache"].get, flat))
        if None in found:
            found = self._cache_misses(step, own, flat, found)
        rows = np.zeros(len(flat), dtype=np.int64) if len(texts) == 1 else \
            np.repeat(np.arange(len(texts), dtype=np.int64), [len(w) for w in split])
        return np.fromiter(found, dtype=np.int64, count=len(found)), rows, flat

    def _cache_misses(self, step: dict[str, Any], own: dict[str, Any], flat: list[str],
                      found: list[int | None]) -> list[int | None]:
        """`found` (None: not in the cache's young generation) completed.
        The cache has two generations: new words go into the young one;
        when it would hold more than half of CACHE_WORDS (about 1 MB), it
        becomes the old one and the old one is dropped; a word found in the
        old one comes back into the young one. So the words in use stay,
        and the cache holds at most CACHE_WORDS words of at most
        LONGEST_CACHED characters (about 2 MB of ordinary words, 8 MB at
        the very most). A word's id is what the NumPy path gives it
        (tests/test_lean.py)."""
        old = own["cache_old"].get
        # the words missed, each once, in the order met
        ids: dict[str, int | None] = dict.fromkeys(w for w, i in zip(flat, found) if i is None)
        unknown = []
        for w in ids:
            i = ids[w] = old(w)
            if i is None:
                unknown.append(w)
        if unknown:
            fallback, strip = step["fallback"], step["strip"]
            if len(unknown) <= self._FEW_NEW and sum(map(len, unknown)) <= self._FEW_NEW_CHARS:
                got = self._string_ids(own, unknown, fallback, strip)
            else:
                words = self.ops.words(unknown, "cased")  # one word a text: no blank in any
                got = self._lookup(own["vocab"], words, fallback, strip).tolist()
            if "pieced" in own:  # the rows of words unknown in every form (_pieced)
                lost = [w for w, i in zip(unknown, got) if not i]
                if lost:
                    rows = iter(self._pieced(own, lost))
                    got = [i or next(rows) for i in got]
            ids.update(zip(unknown, got))
        found = [ids[w] if i is None else i for w, i in zip(flat, found)]
        # a long word is not kept (a text of 20,000 characters may be one
        # word: kept, such words would fill the cache with megabytes)
        keep = [(w, i) for w, i in ids.items() if len(w) <= self.LONGEST_CACHED]
        half = self.CACHE_WORDS // 2
        if len(own["cache"]) + len(keep) > half:
            own["cache_old"], own["cache"] = own["cache"], {}
        own["cache"].update(keep[:half])
        return found

    def _string_ids(self, own: dict[str, Any], words: list[str], fallback: bool, strip: bool) -> list[int]:
        """_lookup of a few words given as strings, in Python scalars: each
        word's key, found with Vocab.find; a word unknown as written, its
        other forms (TextOps.fallback_forms), the first found winning. A
        NumPy pass costs tens of microseconds however few its words; this
        costs about one a word through the table keyed by Python's hash
        (hashed_words), a few through python_key where the plan has none."""
        hashed = own.get("hashed")
        find, key = (hashed.find, hash_key) if hashed is not None else (own["vocab"].find, python_key)
        ops = self.ops
        ids = [find(key(w)) for w in words]
        if fallback:
            for j, i in enumerate(ids):
                if i:
                    continue
                w = words[j]
                tried = {w}  # a form the same as one not found is not looked up again
                for form in ops.fallback_forms(w, strip):
                    if form in tried:
                        continue
                    tried.add(form)
                    i = find(key(form))
                    if i:
                        ids[j] = i
                        break
        return ids

    PIECED_BYTES = 1 << 20  # the rows of the words split into pieces (at most CACHE_WORDS / 2 rows)
    PIECED_LEAST = 256  # ... and at least this many rows

    def _forget_pieced(self, own: dict[str, Any], need: int = 0) -> None:
        """Start the rows of the words split into pieces again (_pieced):
        the table keeps its words' rows, then room for the rows of
        PIECED_BYTES (CACHE_WORDS / 2 rows at most), or of `need` words
        where that is more (one call's, until the next call); the caches
        of words, which hold such rows, are emptied too. The room is
        allocated, not written: its pages cost memory as rows fill them."""
        table = own["table"]
        first = own.setdefault("pieced_from", len(table))
        width = table.shape[1]
        usual = max(self.PIECED_LEAST, min(self.CACHE_WORDS // 2, self.PIECED_BYTES // (4 * width)))
        rows = max(usual, need)
        if len(table) != first + rows:
            grown = np.empty((first + rows, width), dtype=np.float32)
            grown[:first] = table[:first]
            own["table"] = table = grown
        own["pieced"], own["pieced_end"], own["pieced_usual"] = {}, first, usual
        own["cache"], own["cache_old"] = {}, {}

    def _pieced(self, own: dict[str, Any], words: list[str]) -> list[int]:
        """The table's rows of `words`, words that it lacks in every form
        (0: a word without pieces). A word split before keeps its row; a
        new one is split (greedy_pieces) and its pieces' rows (float16 in
        piece_table) summed into a row of its own after the table's words:
        units, then the pieces' count, as a word's row is. So a word met
        again costs one lookup, and a text's rows are summed in one call,
        pieces or none. When a call's new words do not fit in the room
        left, every row is forgotten (_forget_pieced) and _Restart raised:
        the call starts again from nothing, with room for all its words
        (those it met split before, and the new ones)."""
        pieced = own["pieced"]
        new = [w for w in dict.fromkeys(words) if w not in pieced]
        if new:
            table, end = own["table"], own["pieced_end"]
            if len(pieced) + len(new) > len(table) - own["pieced_from"]:
                # the call's words split before are among `pieced`: room for
                # all of those and the new ones holds every word of the call
                self._forget_pieced(own, len(pieced) + len(new))
                raise _Restart
            names = own["piece_names"]
            split = [greedy_pieces(w, names) for w in new]
            got = [p for p in split if p]
            if got:
                # each word's pieces' rows summed, in float32, in one call
                starts = list(accumulate(map(len, got[:-1]), initial=0))
                rows = own["piece_table"][list(chain.from_iterable(got))]
                table[end:end + len(got)] = np.add.reduceat(rows, starts, axis=0, dtype=np.float32)
            for w, p in zip(new, split):
                if p:
                    pieced[w] = end
                    end += 1
                else:
                    pieced[w] = 0
            own["pieced_end"] = end
        return [pieced[w] for w in words]

    def _words(self, step: dict[str, Any], own: dict[str, Any], texts: list[str]) -> np.ndarray:
        """PretrainedLogits ("word_logits") and PretrainedEmbedding ("word_mean")."""
        if "pieced" in own:
            if len(own["table"]) > own["pieced_from"] + own["pieced_usual"]:
                self._forget_pieced(own)  # a call's room for more words, given back
            try:
                return self._word_rows(step, own, texts)
            except _Restart:  # the rows ran out: every word is new again
                return self._word_rows(step, own, texts)
        return self._word_rows(step, own, texts)

    def _word_rows(self, step: dict[str, Any], own: dict[str, Any], texts: list[str]) -> np.ndarray:
        cached = self._cached_ids(step, own, texts)
        if cached is not None:
            n, (ids, rows, flat) = len(texts), cached
        else:
            words = self._words_of(step["standardize"], texts)
            n, rows = words.n, words.text
            ids = self._lookup(own["vocab"], words, step["fallback"], step["strip"])
            if "pieced" in own:
                miss = np.flatnonzero(ids == 0)
                if len(miss):
                    ids[miss] = self._pieced(own, words.strings(miss))
        if step["op"] == "word_logits":
            # (words + 1) x (units + 1): s_w @ K and the subword count (and
            # after them the rows of the words split into pieces, _pieced)
            table = own["table"]
            summed = _segment_sum(table[ids], rows, n)
            units = table.shape[1] - 1
            out = summed[:, :units] * (np.float32(step["scale"]) / np.maximum(summed[:, units:], np.float32(1.0)))
            if "bias" in own:
                out = out + own["bias"]
            return out.astype(np.float32)
        dim = int(step["dim"])
        if "piece_vectors" in own:
            splits, refs, vectors = own["word_splits"], own["word_pieces"], own["piece_vectors"]
            starts, ends = splits[ids], splits[ids + 1]
            lengths = ends - starts
            # each known word's places in word_pieces, in order
            offsets = np.repeat(starts - np.cumsum(lengths) + lengths, lengths)
            places = np.arange(int(lengths.sum()), dtype=np.int64) + offsets
            sums = _segment_sum(vectors[refs[places]], np.repeat(rows, lengths), n)
            counts = _segment_sum(lengths.astype(np.float32)[:, None], rows, n)
        else:
            sums = _segment_sum(own["sums"][ids], rows, n)
            counts = _segment_sum(own["counts"][ids][:, None], rows, n)
        mean = sums / np.maximum(counts, np.float32(1.0))
        scale = np.float32(step["scale"])
        if scale and not step["l2"]:
            mean = mean * scale
        elif scale:
            sq = np.maximum(np.square(mean).sum(axis=-1, keepdims=True), np.float32(1e-12))
            mean = mean * (scale / np.sqrt(sq))
        return mean.astype(np.float32)

    def predict(self, texts: list[str]) -> np.ndarray:
        if not texts:
            return np.zeros((0, self.units), dtype=np.float32)
        values: dict[str, Any] = {}
        for step in self.steps:
            if step["op"] == "input":
                values[step["name"]] = list(texts)
                continue
            values[step["name"]] = self._run(step, [values[i] for i in step["in"]])
        return np.asarray(values[self.output], dtype=np.float32)


def load(folder: str) -> Plan | None:
    """The folder's plan, or None when it has none (it serves through Keras)."""
    if not os.path.isfile(os.path.join(folder, PLAN_FILE)):
        return None
    return Plan.load(folder)


# --------------------------------------------------------------------------
# Export (trainer side: imports Keras)
# --------------------------------------------------------------------------

# Texts every export is checked on, besides the training texts: case, marks,
# scripts, whitespace other than spaces, and the NUL that TensorFlow's
# lowercase stops at.
PROBES = [
    "Hello, World! The QUICK brown fox -- jumps (over) the lazy dog's back...",
    "iPhone很好用，但是电池不太行。Apple's M2 chip: 10% faster?",
    "ΟΔΟΣ ΑΣ σοφός. İstanbul'da ǅemal ẞ straße",
    "tabs\tand\nnew lines\x0bvertical\x0cfeed\rreturn  double  spaces",
    "emoji 😀👍 and symbols © ® ™ → ∑ ∞ and accents café naïve Ærø",
    "NUL inside\x00 the rest after it",
    "ひらがな カタカナ 漢字 한국어 ไทย العربية עברית हिन्दी",
    "x", "!!!", "a-b_c d.e/f g:h 3.14 1,000 #tag @user",
    "\u00a0non-breaking\u2003em space\u3000ideographic\u0085next line",
    "combining e\u0301 and a\u030a, zero width\u200bjoiner",
    "Zorbulent qwxvplugh libfrobnicate-dev 3.14.159-2ubuntu7 Überfluß "
    "supercalifragilisticexpialidociousandthensomemoreletters",
]


def _inputs(layer_config: dict[str, Any]) -> list[str]:
    nodes = layer_config.get("inbound_nodes") or []
    if len(nodes) > 1:
        raise Unsupported(f"layer {layer_config['name']!r} is called more than once")
    names: list[str] = []

    def walk(x: Any) -> None:
        if isinstance(x, dict):
            if x.get("class_name") == "__keras_tensor__":
                names.append(x["config"]["keras_history"][0])
                return
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    if nodes:
        walk(nodes[0].get("args", []))
    return names


def _standardize_name(fn: Any, standardizers: dict[str, Any]) -> str | None:
    if fn is None:
        return None
    for name, f in standardizers.items():
        if fn is f:
            return name
    raise Unsupported(f"standardize {fn!r}")


def _describe(layer: Any, config: dict[str, Any], arrays: dict[str, np.ndarray]) -> dict[str, Any]:
    """One layer as a step (its arrays into `arrays`, keyed "name/key")."""
    import keras

    from model_worker import layers

    name = layer.name
    step: dict[str, Any] = {"name": name}

    def put(key: str, value: np.ndarray) -> None:
        arrays[f"{name}/{key}"] = np.asarray(value)
        step.setdefault("arrays", []).append(key)

    def put_vocab(tokens: list[str], kind: str) -> None:
        # the vocabulary's lookup table, built here: the tokens themselves
        # are not needed to serve (explanations read the Keras model)
        vocab = Vocab.build(tokens, kind)
        put("vocab_keys", vocab.keys)
        put("vocab_ids", vocab.ids)
        step["vocab_size"] = vocab.size

    def put_words(words: list[str], standardize: str | None) -> None:
        # a word view's table, and, where its word cache serves single texts
        # (Plan._cached_ids: the split "cased"), its words themselves: a
        # worker keys them with Python's own hash for the cache's lookups
        # (hashed_words)
        put_vocab(words, "strings")
        if standardize == "cased" and not any("\n" in w for w in words):
            put("words", np.frombuffer("\n".join(words).encode("utf-8"), dtype=np.uint8))

    def put_piece_names(lookup: Any) -> None:
        # the pieces a word the table lacks is split into (greedy_pieces)
        names = [str(t) for t in lookup.get_vocabulary()[1:]]  # [UNK] first
        if any("\n" in p for p in names):
            raise Unsupported("a piece holds a line break")
        step["piece_names"] = len(names)
        put("piece_names", np.frombuffer("\n".join(names).encode("utf-8"), dtype=np.uint8))

    if isinstance(layer, keras.layers.InputLayer):
        if config["config"].get("dtype") != "string":
            raise Unsupported("the input is not a string")
        step["op"] = "input"
    elif isinstance(layer, layers.Standardize):
        step.update(op="standardize", standardize=layer.standardize)
    elif isinstance(layer, keras.layers.TextVectorization):
        c = layer.get_config()
        if c["output_mode"] != "count" or not c["sparse"] or c["pad_to_max_tokens"] or c.get("idf_weights"):
            raise Unsupported("a TextVectorization other than sparse counts")
        step.update(op="ngrams", standardize=_standardize_name(c["standardize"], layers._STANDARDIZERS))
        split = c["split"]
        if split == "whitespace":
            ngrams = c["ngrams"]
            if isinstance(ngrams, int):
                ngrams = list(range(1, ngrams + 1))
            step.update(split="whitespace", ngrams=list(ngrams) if ngrams else None)
        elif split in layers.CHAR_SPLIT_WIDTHS and not c["ngrams"]:
            widths, uni = layers.CHAR_SPLIT_WIDTHS[split]
            step.update(split="char", char_widths=list(widths), char_unigrams=bool(uni))
        else:
            raise Unsupported(f"split {split!r}")
        put_vocab([str(t) for t in layer.get_vocabulary()], "ngrams" if split == "whitespace" else "strings")
    elif isinstance(layer, layers.CharNgramCounts):
        step.update(op="char_ngrams", widths=list(layer.widths), unigrams=layer.unigrams,
                    standardize=layer.standardize)
        put_vocab(["[UNK]", *layer.get_vocabulary()], "strings")
    elif isinstance(layer, layers.TermWeighting):
        step.update(op="weighting", mode=layer.mode, normalize=layer.normalize, sublinear_tf=layer.sublinear_tf)
        put("weights", np.asarray(layer.weights_per_term.numpy(), dtype=np.float32))
    elif isinstance(layer, layers.SparseLinear):
        step.update(op="linear", activation="linear")
        put("kernel", np.concatenate([k.numpy() for k in layer.kernels], axis=1).astype(np.float32))
        if layer.bias is not None:
            put("bias", np.asarray(layer.bias.numpy(), dtype=np.float32))
    elif isinstance(layer, keras.layers.Dense):
        activation = keras.activations.serialize(layer.activation)
        activation = activation if isinstance(activation, str) else activation.get("config", activation)
        if activation not in ("softmax", "sigmoid", "linear"):
            raise Unsupported(f"Dense activation {activation!r}")
        step.update(op="linear", activation=activation)
        put("kernel", np.asarray(layer.kernel.numpy(), dtype=np.float32))
        if layer.use_bias:
            put("bias", np.asarray(layer.bias.numpy(), dtype=np.float32))
    elif isinstance(layer, layers.PretrainedLogits):
        step.update(op="word_logits", standardize=layer.standardize, scale=layer.scale, fallback=layer.fallback,
                    strip=layer.strip)
        put_words([str(t) for t in layer.lookup.get_vocabulary()], layer.standardize)
        table = np.asarray(layer.projected.embeddings.numpy(), dtype=np.float32)
        put("table", table[:layer.vocabulary_size + 1])
        if layer.pieces:
            put_piece_names(layer.piece_lookup)
            # float16 where that is exact (the trainer rounds the pieces' rows so)
            rows = table[layer.vocabulary_size + 1:]
            half = rows.astype(np.float16)
            put("piece_table", half if np.array_equal(half.astype(np.float32), rows) else rows)
        if layer.bias is not None:
            put("bias", np.asarray(layer.bias.numpy(), dtype=np.float32))
    elif isinstance(layer, layers.PretrainedEmbedding):
        step.update(op="word_mean", standardize=layer.standardize, scale=layer.scale, l2=layer.l2,
                    fallback=layer.fallback, strip=layer.strip, dim=layer.dim)
        put_words([str(t) for t in layer.lookup.get_vocabulary()], layer.standardize)
        if layer.pieces:
            put("piece_vectors", np.asarray(layer.piece_vectors.embeddings.numpy(), dtype=np.float16))
            put("word_splits", np.asarray(layer.word_splits.numpy(), dtype=np.int64))
            put("word_pieces", np.asarray(layer.word_pieces.numpy(), dtype=np.int32))
        else:
            sums, counts = layer.table_rows(np.arange(layer.vocabulary_size + 1))
            put("sums", sums.astype(np.float16))
            put("counts", counts.astype(np.float16))
    elif isinstance(layer, keras.layers.Add):
        step["op"] = "add"
    elif isinstance(layer, keras.layers.Activation):
        activation = keras.activations.serialize(layer.activation)
        activation = activation if isinstance(activation, str) else activation.get("config", activation)
        step.update(op="activation", activation=activation)
        _activation(activation, np.zeros((1, 2), dtype=np.float32))  # Unsupported if unknown
    elif isinstance(layer, keras.layers.Reshape):
        step.update(op="reshape", shape=[int(d) for d in layer.target_shape])
    elif isinstance(layer, keras.layers.GlobalAveragePooling1D):
        if layer.data_format != "channels_last" or layer.keepdims:
            raise Unsupported("GlobalAveragePooling1D other than channels_last")
        step["op"] = "mean_axis1"
    elif isinstance(layer, keras.layers.Dropout):
        step["op"] = "identity"
    else:
        raise Unsupported(f"layer {type(layer).__name__} ({name})")
    return step


def build(model: Any) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """(the plan's description, its arrays) for a Keras functional model;
    Unsupported when a layer has no lean step."""
    config = model.get_config()
    if len(model.inputs) != 1 or len(model.outputs) != 1:
        raise Unsupported("not one input and one output")
    arrays: dict[str, np.ndarray] = {}
    steps = []
    for layer_config in config["layers"]:
        layer = model.get_layer(layer_config["name"])
        step = _describe(layer, layer_config, arrays)
        step["in"] = _inputs(layer_config)
        steps.append(step)
    done: set[str] = set()
    for step in steps:  # the config lists layers in an order that computes
        if any(i not in done for i in step["in"]):
            raise Unsupported(f"step {step['name']!r} comes before its inputs")
        done.add(step["name"])
    output = config["output_layers"]
    output = output[0] if isinstance(output[0], list) else output
    spec = {"format": FORMAT, "steps": steps, "output": output[0], "units": int(model.outputs[0].shape[-1])}
    return spec, arrays


def _save(folder: str, spec: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
    buf = io.BytesIO()
    plan = np.frombuffer(json.dumps(spec).encode("utf-8"), dtype=np.uint8)
    members: dict[str, Any] = {"plan": plan, **arrays}
    np.savez(buf, **members)
    path = os.path.join(folder, PLAN_FILE)
    with open(path + ".tmp", "wb") as fh:
        fh.write(buf.getvalue())
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(path + ".tmp", path)


def export(model: Any, folder: str, texts: list[str], predict: Callable[[list[str]], np.ndarray]) -> dict[str, Any]:
    """Write `folder`/lean.npz for `model` when every step has a lean
    equivalent and the plan's scores on `texts` (a sample) and PROBES agree
    with `predict` (the Keras model's) within TOLERANCE, as a batch and (the
    first 32 texts and PROBES) one text at a time. Returns what
    happened: {"engine": "lean", "bytes": ...} or {"engine": "keras", "reason": ...}."""
    try:
        spec, arrays = build(model)
        plan = Plan(spec, arrays)
        probe = [*texts[:256], *PROBES]
        want = predict(probe)
        got = plan.predict(probe)
        if got.shape == want.shape:  # and one text at a time (a word view's cache: Plan._cached_ids)
            ones = [*range(min(len(texts), 32)), *range(len(probe) - len(PROBES), len(probe))]
            got = got.copy()
            got[ones] = np.concatenate([plan.predict([probe[i]]) for i in ones])
        if got.shape != want.shape or not np.allclose(got, want, atol=TOLERANCE, rtol=0):
            worst = float(np.max(np.abs(got - want))) if got.shape == want.shape else float("inf")
            return {"engine": "keras", "reason": f"the plan's scores differ from the model's by {worst:.2e}"}
    except Unsupported as exc:
        return {"engine": "keras", "reason": str(exc)}
    except Exception as exc:  # a fault of this engine: the version still trains, served through Keras
        return {"engine": "keras", "reason": f"the plan failed its check ({type(exc).__name__}: {exc})"}
    _save(folder, spec, arrays)
    return {"engine": "lean", "bytes": os.path.getsize(os.path.join(folder, PLAN_FILE))}


# --------------------------------------------------------------------------
# The tables (python -m model_worker.lean --write-tables; needs TensorFlow)
# --------------------------------------------------------------------------

def read_tables() -> dict[str, Any]:
    """TensorFlow's classes and lowercase, one code point at a time."""
    import tensorflow as tf

    from model_worker import layers

    points = [cp for cp in range(1, 0x110000) if not 0xD800 <= cp <= 0xDFFF]
    chars = tf.constant([chr(cp) for cp in points])

    def members(pattern: str) -> list[list[int]]:
        mask = np.zeros(_UNICODE, dtype=bool)
        mask[np.asarray(points)] = tf.strings.regex_full_match(chars, pattern).numpy()
        return _as_ranges(mask)

    lowered = [b.decode("utf-8") for b in tf.strings.lower(chars, encoding="utf-8").numpy()]
    lower = {cp: low for cp, low in zip(points, lowered) if low != chr(cp)}
    differ = [cp for cp in [0, *points] if chr(cp).lower() != lower.get(cp, chr(cp))]
    return {
        "tensorflow": tf.__version__,
        "word": members(r"[\p{L}\p{M}\p{N}]"),
        "cjk": members(layers._CJK_CHAR),
        "space": members(r"[\s\x0b\p{Z}]"),
        "lower": {str(cp): low for cp, low in lower.items()},
        "python_unicode": unicodedata.unidata_version,
        "python_differs": [cp for cp in differ if cp],
    }


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="TensorFlow's character tables for the lean engine")
    ap.add_argument("--write-tables", action="store_true", help=f"write {TABLES_FILE}")
    args = ap.parse_args(argv)
    tables = read_tables()
    text = json.dumps(tables, ensure_ascii=True, separators=(",", ":"), sort_keys=True) + "\n"
    if args.write_tables:
        with open(TABLES_FILE, "w", encoding="ascii") as fh:
            fh.write(text)
    else:
        print(text, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
