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
from itertools import chain
from typing import Any, Callable

import numpy as np

# The plan's file inside a version folder.
PLAN_FILE = "lean.npz"
FORMAT = 1
# Scores may differ from the Keras graph's by float rounding only.
TOLERANCE = 1e-5
TABLES_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tf_unicode.json")


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


class TextOps:
    """The standardizers of layers.py followed by tf.strings.split, as one
    tokenizer each (text -> its words), with TensorFlow's character classes
    and lowercasing (tf_unicode.json). Every lean step reads a text as the
    words of its split, so a standardizer's spacing never needs building."""

    def __init__(self, tables: dict[str, Any]) -> None:
        word, cjk, space = (_mask(tables[k]) for k in ("word", "cjk", "space"))
        blank, surrogate = _mask(_BLANKS), _mask([[0xD800, 0xDFFF]])
        cls = {"word": word, "cjk_word": word & cjk, "word_not_cjk": word & ~cjk,
               # a mark or symbol: standardize_*_punct spaces it out
               "punct": ~(word | space | surrogate),
               "not_punct_blank": (word | space) & ~blank, "not_space_blank": ~(space | blank | surrogate)}
        # Python's re tests a class with characters past U+FFFF range by
        # range (hundreds of them); restricted to the BMP it is a bitmap. So
        # each pattern comes three times: for ASCII texts, for texts within
        # the BMP, and for any text, and a text takes the narrowest it fits.
        self._patterns = []
        for top in (0x80, 0x10000, _UNICODE):
            c = {k: _char_class(_as_ranges(v[:top])) for k, v in cls.items()}
            non_word = _char_class(_as_ranges(cls["word"][:top]), negate=True)
            self._patterns.append((
                re.compile(f"{c['word']}+").findall,
                re.compile(f"{c['cjk_word']}|{c['word_not_cjk']}+").findall,
                re.compile(f"{c['punct']}|{c['not_punct_blank']}+").findall,
                re.compile(f"{c['not_space_blank']}+").findall,
                re.compile(f"^{non_word}+|{non_word}+\\Z").sub))
        # TensorFlow's lowercase of each code point it changes; where Python's
        # str.lower (its own Unicode version) says otherwise, TensorFlow's wins
        tf_lower = {int(k): v for k, v in tables["lower"].items()}
        if tables.get("python_unicode") == unicodedata.unidata_version:
            differ = [int(k) for k in tables["python_differs"]]
        else:
            differ = [cp for cp in range(1, 0x110000) if not 0xD800 <= cp <= 0xDFFF
                      and chr(cp).lower() != tf_lower.get(cp, chr(cp))]
        self._differ = {cp: tf_lower.get(cp, chr(cp)) for cp in differ}
        self._differ_re = re.compile(_char_class([[cp, cp] for cp in differ])) if differ else None
        lower, pick = self.lower, self._pick
        self.tokenizers: dict[str, Callable[[str], list[str]]] = {
            "char": lambda text: pick(text := lower(text))[1](text),
            "word": lambda text: pick(text := lower(text))[0](text),
            "lower": lambda text: pick(text := lower(text))[3](text),
            "word_punct": lambda text: pick(text := lower(text))[2](text),
            "cased": split_words,
            "cased_punct": lambda text: pick(text)[2](text)}

    def _pick(self, text: str) -> tuple[Callable[..., Any], ...]:
        if text.isascii():
            return self._patterns[0]
        return self._patterns[1] if max(text) <= "\uffff" else self._patterns[2]

    def lower(self, text: str) -> str:
        """tf.strings.lower(text, encoding="utf-8"): ICU's full lowercase
        (final sigma included), the text cut at its first NUL (TensorFlow
        reads it as a C string there)."""
        text = text.partition("\x00")[0]
        if text.isascii() or self._differ_re is None or not self._differ_re.search(text):
            return text.lower()
        out, pos = [], 0
        for m in self._differ_re.finditer(text):
            out.append(text[pos:m.start()].lower())
            out.append(self._differ[ord(m.group())])
            pos = m.end()
        out.append(text[pos:].lower())
        return "".join(out)

    def strip_marks(self, word: str) -> str:
        return self._pick(word)[4]("", word)


# tf.strings.split with no separator: runs of anything but " \t\n\v\f\r"
split_words = re.compile(r"[^ \t\n\x0b\x0c\r]+").findall


def word_ngrams(words: list[str], widths: tuple[int, ...]) -> list[str]:
    """tf.strings.ngrams(words, widths, separator=" ") (no short sequences kept)."""
    out: list[str] = []
    for w in widths:
        if w == 1:
            out.extend(words)
        elif w == 2:
            out.extend([a + " " + b for a, b in zip(words, words[1:])])
        else:
            out += [" ".join(words[i:i + w]) for i in range(len(words) - w + 1)]
    return out


def char_ngrams(words: list[str], widths: tuple[int, ...], unigrams: bool) -> list[str]:
    """layers._char_ngrams: each word padded with a space, its n-grams of
    `widths` characters; with `unigrams`, the word's characters too."""
    out: list[str] = []
    for word in words:
        if unigrams:
            out += word
        padded = f" {word} "
        n = len(padded)
        for w in widths:
            out += [padded[i:i + w] for i in range(n - w + 1)]
    return out


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

class Tokens(list):  # type: ignore[type-arg]
    """Each text's words, as a Standardize step hands them on."""


class Bag:
    """A batch's sparse rows: (row, column) cells in row order, float32 values."""
    __slots__ = ("rows", "cols", "vals", "n", "width")

    def __init__(self, rows: np.ndarray, cols: np.ndarray, vals: np.ndarray, n: int, width: int) -> None:
        self.rows, self.cols, self.vals, self.n, self.width = rows, cols, vals, n, width


def _vocab_blob(tokens: list[str]) -> np.ndarray:
    for t in tokens:
        if "\n" in t:
            raise Unsupported(f"vocabulary token {t!r} holds a newline")
    return np.frombuffer("\n".join(tokens).encode("utf-8"), dtype=np.uint8)


# odd, so that distinct lengths mix into distinct 64-bit patterns
_LENGTH_MIX = np.uint64(0x9E3779B97F4A7C15)


def _keys(tokens: list[str]) -> np.ndarray:
    """Each token's key: its hash, mixed with its length (Vocab)."""
    n = len(tokens)
    hashes = np.fromiter(map(hash, tokens), dtype=np.int64, count=n).view(np.uint64)
    lengths = np.fromiter(map(len, tokens), dtype=np.uint64, count=n)
    return (hashes ^ (lengths * _LENGTH_MIX)).view(np.int64)


class Vocab:
    """token -> id (0: unknown) for a vocabulary, in 12 bytes a token.

    A dict of the tokens would hold each as a Python string and an int
    object, about 150 bytes a token: 15 MB for a bag of 100,000 n-grams,
    most of a lean worker's memory. This holds the tokens' 64-bit keys,
    sorted, and each one's id; a lookup keys the batch's tokens and finds
    them all with one binary search. A key is Python's own string hash
    (computed in this process, and kept with the string) mixed with the
    length: Python hashes a string's stored bytes, so "/f" (two one-byte
    characters) and "是" (U+662F, stored as the same two bytes) hash alike,
    and only their lengths tell them apart (a string stored with 1, 2 or 4
    bytes a character has the same bytes as another only at another
    length). Otherwise a token matches only a vocabulary token with the same
    64-bit key: a false match needs a collision, about once in 10^14
    lookups for 100,000 tokens. A vocabulary whose own keys collide keeps a dict.
    """

    def __init__(self, blob: np.ndarray) -> None:
        tokens = blob.tobytes().decode("utf-8").split("\n")
        self.size = len(tokens)
        hashes = _keys(tokens)
        order = np.argsort(hashes, kind="stable")
        self.keys = hashes[order]
        self.dict: dict[str, int] | None = None
        if self.size > 1 and bool((self.keys[1:] == self.keys[:-1]).any()):
            self.dict = {t: i for i, t in enumerate(tokens)}
        self.ids = order.astype(np.int32 if self.size < 2**31 else np.int64)
        del tokens, hashes

    def __len__(self) -> int:
        return self.size

    def lookup(self, tokens: list[str]) -> np.ndarray:
        """The tokens' ids (int64), 0 where unknown."""
        if self.dict is not None:
            get = self.dict.get
            return np.fromiter((get(t, 0) for t in tokens), dtype=np.int64, count=len(tokens))
        h = _keys(tokens)
        pos = np.searchsorted(self.keys, h)
        pos[pos == self.size] = 0
        return np.where(self.keys[pos] == h, self.ids[pos], 0).astype(np.int64)


def _counts(rows: np.ndarray, cols: np.ndarray, n: int, width: int) -> Bag:
    """Each (row, column) pair once with how often it came, cells sorted."""
    cells, counts = np.unique(rows * width + cols, return_counts=True)
    return Bag(cells // width, cells % width, counts.astype(np.float32), n, width)


def _flat(per_text: list[list[str]]) -> tuple[list[str], np.ndarray]:
    """Every text's tokens in one list, and each token's text (ascending)."""
    lengths = np.fromiter(map(len, per_text), dtype=np.int64, count=len(per_text))
    return list(chain.from_iterable(per_text)), np.repeat(np.arange(len(per_text), dtype=np.int64), lengths)


def _csr(rows: np.ndarray, cols: np.ndarray, vals: np.ndarray, n: int, width: int) -> Any:
    """The cells (rows ascending) as a SciPy CSR matrix."""
    import scipy.sparse as sp

    indptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.bincount(rows, minlength=n), out=indptr[1:])
    return sp.csr_matrix((vals, cols, indptr), shape=(n, width))


# Below this many gathered numbers a product is a gather and a sorted sum
# (a CSR matrix costs ~0.1 ms to build, most of a single text's call).
_GATHER_MAX = 1 << 20


def _segment_sum(values: np.ndarray, rows: np.ndarray, n: int) -> np.ndarray:
    """Sum of `values`' rows per text (rows ascending), float32; zeros for a text with none."""
    out = np.zeros((n, values.shape[1]), dtype=np.float32)
    if len(rows):
        starts = np.flatnonzero(np.diff(rows, prepend=-1))
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
            if "vocab" in own:
                own["vocab"] = Vocab(own["vocab"])
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
    def _tokens(self, name: str | None, values: Any) -> list[list[str]]:
        """Each text's words: `values` are raw texts standardized the `name`
        way and split, or a Standardize step's words already (name None)."""
        if isinstance(values, Tokens):
            if name:
                raise Unsupported("a standardizer after a Standardize step")
            return values
        tokenize = self.ops.tokenizers[name] if name else split_words
        return Tokens(tokenize(t) for t in values)

    def _lookup(self, vocab: Vocab, words: list[str], fallback: bool, strip: bool) -> np.ndarray:
        """layers._lookup: as written; with `fallback`, a word unknown so
        lowercased; with `strip`, one still unknown without the marks at its
        ends, as written, then lowercased."""
        ids = vocab.lookup(words)
        if not fallback:
            return ids
        lower, strip_marks = self.ops.lower, self.ops.strip_marks
        miss = np.flatnonzero(ids == 0)
        if not len(miss):
            return ids
        unknown = [words[i] for i in miss.tolist()]
        found = vocab.lookup([lower(w) for w in unknown])
        if strip:
            bare = [strip_marks(w) for w in unknown]
            found = np.where(found > 0, found, vocab.lookup(bare))
            found = np.where(found > 0, found, vocab.lookup([lower(w) for w in bare]))
        ids[miss] = found
        return ids

    def _run(self, step: dict[str, Any], args: list[Any]) -> Any:
        kind, own = step["op"], self.data[step["name"]]
        if kind == "standardize":
            if isinstance(args[0], Tokens):
                raise Unsupported("a Standardize step after another")
            return self._tokens(step["standardize"], args[0])
        if kind == "ngrams":  # TextVectorization, output_mode "count", sparse
            words = self._tokens(step["standardize"], args[0])
            vocab = own["vocab"]
            if step["split"] == "whitespace":
                widths = tuple(step["ngrams"]) if step["ngrams"] else None
                grams = [word_ngrams(w, widths) for w in words] if widths else words
            else:
                w, uni = tuple(step["char_widths"]), step["char_unigrams"]
                grams = [char_ngrams(ws, w, uni) for ws in words]
            flat, rows = _flat(grams)
            return _counts(rows, vocab.lookup(flat), len(words), len(vocab))
        if kind == "char_ngrams":  # CharNgramCounts: no OOV column emitted
            words = self._tokens(step["standardize"], args[0])
            vocab = own["vocab"]
            widths, uni = tuple(step["widths"]), step["unigrams"]
            flat, rows = _flat([char_ngrams(ws, widths, uni) for ws in words])
            cols = vocab.lookup(flat)
            known = cols > 0
            return _counts(rows[known], cols[known], len(words), len(vocab))
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

    def _words(self, step: dict[str, Any], own: dict[str, Any], texts: list[str]) -> np.ndarray:
        """PretrainedLogits ("word_logits") and PretrainedEmbedding ("word_mean")."""
        words = self._tokens(step["standardize"], texts)
        n = len(words)
        flat, rows = _flat(words)
        ids = self._lookup(own["vocab"], flat, step["fallback"], step["strip"])
        if step["op"] == "word_logits":
            table = own["table"]  # (words + 1) x (units + 1): s_w @ K and the subword count
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
        vocab = [str(t) for t in layer.get_vocabulary()]
        put("vocab", _vocab_blob(vocab))
    elif isinstance(layer, layers.CharNgramCounts):
        step.update(op="char_ngrams", widths=list(layer.widths), unigrams=layer.unigrams,
                    standardize=layer.standardize)
        put("vocab", _vocab_blob(["[UNK]", *layer.get_vocabulary()]))
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
        put("vocab", _vocab_blob([str(t) for t in layer.lookup.get_vocabulary()]))
        put("table", np.asarray(layer.projected.embeddings.numpy(), dtype=np.float32))
        if layer.bias is not None:
            put("bias", np.asarray(layer.bias.numpy(), dtype=np.float32))
    elif isinstance(layer, layers.PretrainedEmbedding):
        step.update(op="word_mean", standardize=layer.standardize, scale=layer.scale, l2=layer.l2,
                    fallback=layer.fallback, strip=layer.strip, dim=layer.dim)
        put("vocab", _vocab_blob([str(t) for t in layer.lookup.get_vocabulary()]))
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
    with `predict` (the Keras model's) within TOLERANCE. Returns what
    happened: {"engine": "lean", "bytes": ...} or {"engine": "keras", "reason": ...}."""
    try:
        spec, arrays = build(model)
        plan = Plan(spec, arrays)
        probe = [*texts[:256], *PROBES]
        want = predict(probe)
        got = plan.predict(probe)
        if got.shape != want.shape or not np.allclose(got, want, atol=TOLERANCE, rtol=0):
            worst = float(np.max(np.abs(got - want))) if got.shape == want.shape else float("inf")
            return {"engine": "keras", "reason": f"the plan's scores differ from the model's by {worst:.2e}"}
    except Unsupported as exc:
        return {"engine": "keras", "reason": str(exc)}
    _save(folder, spec, arrays)
    return {"engine": "lean", "bytes": os.path.getsize(os.path.join(folder, PLAN_FILE))}


# --------------------------------------------------------------------------
# The tables (python -m model_worker.lean --write-tables; needs TensorFlow)
# --------------------------------------------------------------------------

def _ranges(points: list[int]) -> list[list[int]]:
    out: list[list[int]] = []
    for cp in points:
        if out and out[-1][1] == cp - 1:
            out[-1][1] = cp
        else:
            out.append([cp, cp])
    return out


def read_tables() -> dict[str, Any]:
    """TensorFlow's classes and lowercase, one code point at a time."""
    import tensorflow as tf

    from model_worker import layers

    points = [cp for cp in range(1, 0x110000) if not 0xD800 <= cp <= 0xDFFF]
    chars = tf.constant([chr(cp) for cp in points])

    def members(pattern: str) -> list[int]:
        hit = tf.strings.regex_full_match(chars, pattern).numpy()
        return [cp for cp, h in zip(points, hit) if h]

    lowered = [b.decode("utf-8") for b in tf.strings.lower(chars, encoding="utf-8").numpy()]
    lower = {cp: low for cp, low in zip(points, lowered) if low != chr(cp)}
    differ = [cp for cp in [0, *points] if chr(cp).lower() != lower.get(cp, chr(cp))]
    return {
        "tensorflow": tf.__version__,
        "word": _ranges(members(r"[\p{L}\p{M}\p{N}]")),
        "cjk": _ranges(members(layers._CJK_CHAR)),
        "space": _ranges(members(r"[\s\x0b\p{Z}]")),
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
