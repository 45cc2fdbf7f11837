"""The pretrained view of `auto`: the mean WordLlama subword vector of a text, in the graph.

WordLlama (PyPI `wordllama`, the wheel's default model `l2_supercat_256`)
embeds a text as the mean of its LLaMA-2 subword vectors (32,000 tokens x 256
dimensions). Its tokenizer is a Hugging Face BPE file that no TensorFlow op
runs, so the served graph does not tokenize into subwords. Instead, at
training time, every word the model may meet is tokenized once, with the
real tokenizer, into a word table:

    word -> (sum of its subword vectors, its subword count)

Words are kept as written (the split "cased": whitespace only, case and
punctuation kept). LLaMA's pieces are case-sensitive ("Oil", "oil" and
"OIL" are different pieces with different vectors) and the tokenizer has no
pre-tokenizer: it prepends "▁", turns each space into "▁" and runs BPE over
the whole text, and no piece spans a "▁" inside it, so a word as written,
punctuation attached ("Output," "(the"), gets the same pieces alone as inside
the text. The graph's mean over a text's words is then the package's
`embed()` of the raw text, to float16 precision (tests/test_pretrained.py
checks it on mixed-case sentences), except where whitespace other than
single spaces separates words (tabs, newlines, runs of spaces: the package
sees pieces for them; the split does not).

The table covers every word of the training texts plus the most frequent
English words (wordfreq's list, FREQUENT_WORDS of them, each as listed,
lowercase, and capitalized). A served word the table lacks as written is
looked up lowercased, then capitalized (one more lookup in the graph: the
table holds, for each lowercase form it lacks whose capitalized form it
has, an alias row with that form's vector) before it counts as unknown.
Tables built before case was kept (the split "word": lowercase, punctuation
dropped) have no fallback; their versions load and serve as they did.

A word the table lacks in every form is split into the tokenizer's pieces
where the view's linear map is folded into the table (auto's served graph,
layers.PretrainedLogits `pieces`): from the word-start mark on, the longest
piece of the tokenizer's vocabulary at each place (model_worker.pieces.greedy_pieces; the
graph runs the same split), each adding its vector and a count of one, as
the package's tokenizer gives every word pieces. That greedy split is the
tokenizer's BPE split for about two unknown words in three (on the
development sets' test words); the others get other pieces of the same
characters. A word of more than MOST_PIECED characters, and any word
in the vector-table layouts (more logit columns than FUSED_MAX_UNITS, the
versions before, zero-shot), gets nothing: sum 0, count 0, so the mean is
over the other words, and a text with none gets the zero vector (the linear
part and the bias decide alone). bench/accuracy.py --curve reports how many
test words the table lacks.

The mean is scaled to L2 norm SCALE (the n-gram views' bags are unit-norm
TF-IDF rows), so that one regularisation strength suits both when the search
combines them.

Imported by trainer processes (the table needs the package's files) and, for
the registered layer, by anything that loads a saved model; loading and
serving need only TensorFlow and Keras: the table lives in the model.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import scipy.sparse as sp
import tensorflow as tf

from model_worker import layers
from model_worker.pieces import MOST_PIECED, greedy_pieces

# The package's default model: files inside the wheel, loaded by path (its
# WordLlama.load() looks for the tokenizer in the wrong folder and then tries
# to download it; nothing here touches the network).
WEIGHTS_FILE = "weights/l2_supercat_256.safetensors"
TOKENIZER_FILE = "tokenizers/l2_supercat_tokenizer_config.json"
DIM = 256
# Frequent English words added to the training texts' own words: words a
# served text may use that no training text did, each as listed and
# capitalized. 10,000 since unknown words get pieces (30,000 before): with
# the pieces, the learning curve's six cells moved by -0.8 to +0.3 points
# from 30,000 (debsum_en, debian_en, manpages_en at 300 and all labels), and
# the 40,000 rows fewer pay for the pieces in a worker (docs/models.md).
FREQUENT_WORDS = 10_000
# Typical L2 norm of the served vector: the n-gram bags have norm 1 each.
# fit_view scales every mean by SCALE / (the training texts' median norm).
SCALE = 0.5
# At most this many logit columns (labels x ensemble members) are folded into
# the table (layers.PretrainedLogits: units + 1 float32 a word, against the
# vector table's dim + 1 float16); more keep the vector table.
FUSED_MAX_UNITS = 128
ORIGIN = ("WordLlama l2_supercat_256 (PyPI wordllama, MIT); derived from the token embeddings of "
          "Llama-2-70b: Llama 2 is licensed under the LLAMA 2 Community License, Copyright (c) "
          "Meta Platforms, Inc. All Rights Reserved.")


def package_dir() -> str | None:
    """Where the `wordllama` package is installed (found, not imported), or None."""
    spec = importlib.util.find_spec("wordllama")
    if spec is None or not spec.origin:
        return None
    return os.path.dirname(spec.origin)


def available() -> bool:
    d = package_dir()
    return d is not None and os.path.exists(os.path.join(d, WEIGHTS_FILE)) \
        and os.path.exists(os.path.join(d, TOKENIZER_FILE))


@functools.lru_cache(maxsize=1)
def codebook() -> np.ndarray:
    """(32000, 256) float16 subword vectors."""
    from safetensors.numpy import load_file

    where = package_dir()
    if where is None:
        raise RuntimeError("the wordllama package is not installed")
    return load_file(os.path.join(where, WEIGHTS_FILE))["embedding.weight"]


@functools.lru_cache(maxsize=1)
def tokenizer() -> Any:
    from tokenizers import Tokenizer

    where = package_dir()
    if where is None:
        raise RuntimeError("the wordllama package is not installed")
    return Tokenizer.from_file(os.path.join(where, TOKENIZER_FILE))


@functools.lru_cache(maxsize=1)
def piece_list() -> tuple[list[str], np.ndarray]:
    """(the tokenizer's pieces, sorted: every token but the special ones and
    the byte tokens "<0x..>", and the 25 that hold a line break (a carriage
    return at the end of a line of code; a saved lookup's vocabulary is one
    term a line); their rows in the codebook): what a word the table lacks
    is split into (model_worker.pieces.greedy_pieces)."""
    vocab = tokenizer().get_vocab()
    special = {"<unk>", "<s>", "</s>"}
    pieces = sorted(p for p in vocab if p not in special and p.splitlines() == [p]
                    and not (len(p) == 6 and p.startswith("<0x") and p.endswith(">")))
    return pieces, np.array([min(vocab[p], len(codebook()) - 1) for p in pieces], dtype=np.int64)


def word_pieces(words: list[str]) -> sp.csr_matrix:
    """(len(words), pieces) how often each piece of piece_list() is in each
    word's greedy split (model_worker.pieces.greedy_pieces)."""
    pieces, _ = piece_list()
    indptr, cols = [0], []
    for w in words:
        cols += greedy_pieces(w, pieces)
        indptr.append(len(cols))
    m = sp.csr_matrix((np.ones(len(cols)), np.array(cols, dtype=np.int64), np.array(indptr, dtype=np.int64)),
                      shape=(len(words), len(pieces)))
    m.sum_duplicates()
    return m


def words_of(texts: list[str], standardize: str = "cased") -> list[str]:
    """The words of `texts` as the graph splits them (the standardizer, whitespace)."""
    out: set[str] = set()
    std = layers._STANDARDIZERS[standardize]
    for i in range(0, len(texts), 2048):
        split = tf.strings.split(std(tf.constant(texts[i:i + 2048], tf.string)))
        out.update(w.decode("utf-8") for w in np.unique(split.flat_values.numpy()))
    return sorted(out)


# Punctuation and symbols that the "word_punct" split makes tokens of, in the
# table whether or not the descriptions use them (wordfreq lists words only).
PUNCTUATION = tuple(sorted({chr(c) for c in range(33, 127) if not chr(c).isalnum()}
                           | set("\u2018\u2019\u201c\u201d\u2013\u2014\u2026\u00ab\u00bb")))


@functools.lru_cache(maxsize=4)
def frequent_words(n: int = FREQUENT_WORDS, standardize: str = "cased", capitalized: int | None = None
                   ) -> tuple[str, ...]:
    """The n most frequent English words (wordfreq), split as the graph splits
    (with "word_punct", the punctuation marks too). With the case-kept split
    ("cased") each word comes as written (wordfreq lists them lowercase) and
    capitalized, as it starts a sentence or a title: the first `capitalized`
    of them (None: all n)."""
    from wordfreq import top_n_list

    top = top_n_list("en", n)
    extra = list(PUNCTUATION) if standardize in ("word_punct", "cased_punct") else []
    if standardize in ("cased", "cased_punct"):
        extra += [w.capitalize() for w in top[:n if capitalized is None else capitalized]]
    return tuple(words_of(top + extra, standardize))


def subword_ids(words: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """(the subword ids of every word, one after the other (int64), subword
    count of each word (n,)), tokenized as the package tokenizes a text
    holding it (no special tokens)."""
    tok = tokenizer()
    tok.no_padding()  # a word's own pieces only, whoever configured the shared tokenizer
    tok.no_truncation()
    enc = tok.encode_batch(words, add_special_tokens=False)
    counts = np.array([len(e.ids) for e in enc], dtype=np.int64)
    ids = np.concatenate([np.asarray(e.ids, dtype=np.int64) for e in enc]) if len(enc) else np.zeros(0, np.int64)
    return np.clip(ids, 0, len(codebook()) - 1), counts  # clipped as the package does


def subword_sums(words: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """(sum of subword vectors (n, DIM) float32, subword count (n,)) of each word,
    tokenized as the package tokenizes a text holding it (no special tokens)."""
    ids, counts = subword_ids(words)
    table = codebook()
    vectors = table[ids].astype(np.float32)
    sums = np.zeros((len(words), table.shape[1]), dtype=np.float32)
    rows = np.repeat(np.arange(len(words)), counts)
    np.add.at(sums, rows, vectors)
    return sums, counts


@dataclass(eq=False)
class WordTable:
    words: list[str]
    sums: np.ndarray     # (n, DIM) float16
    counts: np.ndarray   # (n,) subwords per word
    from_training: int = 0
    frequent: int = 0
    in_frequent: np.ndarray | None = None  # (n,) bool: among the frequent English words
    # (n,) int: the row whose vector an alias row copies (-1: a word of its
    # own). Case-kept tables only: a lowercase form the table lacks whose
    # capitalized form it has ("apple" -> "Apple"), so that one lowercase
    # lookup in serving is the lowercase-then-capitalized fallback.
    alias_of: np.ndarray | None = None
    cased: bool = False
    # (n, 2) int: the rows of a word's lowercase and capitalized forms (-1:
    # none, or the word itself): where serving's fallback goes when a table
    # lacks the word as written (case-kept tables only)
    fallback_rows: np.ndarray | None = None
    # the subword ids of every row, one row after the other (`counts` of
    # each): tables built with pieces=True, whose layer stores the pieces'
    # vectors once and each word's ids (PretrainedEmbedding `pieces`), not a
    # summed vector a word
    pieces: np.ndarray | None = None

    def describe(self) -> dict[str, Any]:
        aliases = 0 if self.alias_of is None else int((self.alias_of >= 0).sum())
        return {"words": len(self.words), "from_training": self.from_training,
                "frequent_words": self.frequent, "dim": int(self.sums.shape[1]),
                "case": "kept (lookup as written, then lowercase, then capitalized)" if self.cased
                        else "folded (lowercase)",
                "lowercase_aliases": aliases,
                "bytes": int(self.sums.nbytes + self.counts.astype(np.float16).nbytes),
                "origin": ORIGIN}

    def known_rows(self, seen: np.ndarray) -> np.ndarray:
        """Rows known to a table built from the texts whose words are `seen`
        (bool, by row) and the frequent words: an alias is known with its target."""
        known = seen if self.in_frequent is None else seen | self.in_frequent
        if self.alias_of is not None:
            alias = np.flatnonzero(self.alias_of >= 0)
            known = known.copy()
            known[alias] = known[self.alias_of[alias]]
        return known


def _capitalized(word: str) -> str:
    return word[:1].upper() + word[1:].lower()


def build_table(texts: list[str], n_frequent: int = FREQUENT_WORDS,
                standardize: str = "cased", capitalized: int | None = None,
                pieces: bool = False) -> WordTable:
    """Every word of `texts` plus the n_frequent most frequent English words,
    split by the `standardize` the view's layer will use.

    "cased" (the view since case is kept): words as written, punctuation
    attached, each with the pieces the package's tokenizer gives it inside
    a text; the frequent words as written and capitalized (the first
    `capitalized` of them; None: all); and one alias row for each lowercase
    form the table lacks whose capitalized form it has (WordTable.alias_of)."""
    own = words_of(texts, standardize)
    frequent = frequent_words(n_frequent, standardize, capitalized) if n_frequent else ()
    words = sorted(set(own) | set(frequent))
    alias_of = None
    if standardize in ("cased", "cased_punct"):
        have = set(words)
        index = {w: i for i, w in enumerate(words)}
        targets: dict[str, int] = {}
        for w in words:
            k = w.lower()
            if k not in have and k not in targets and _capitalized(k) in index:
                targets[k] = index[_capitalized(k)]
        if targets:
            words = sorted(have | set(targets))
            index = {w: i for i, w in enumerate(words)}
            alias_of = np.full(len(words), -1, dtype=np.int64)
            for k in targets:
                alias_of[index[k]] = index[_capitalized(k)]
        else:
            alias_of = np.full(len(words), -1, dtype=np.int64)
    sums, counts = subword_sums(words)
    piece_ids = None
    if pieces:
        ids, _ = subword_ids(words)
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]]) if len(words) else np.zeros(0, np.int64)
        src = np.arange(len(words)) if alias_of is None else np.where(alias_of >= 0, alias_of,
                                                                      np.arange(len(words)))
        # each row's ids: an alias row takes its target's
        piece_ids = np.concatenate([ids[starts[j]:starts[j] + counts[j]] for j in src]) \
            if len(words) else np.zeros(0, np.int64)
    if alias_of is not None:
        alias = np.flatnonzero(alias_of >= 0)
        sums[alias], counts[alias] = sums[alias_of[alias]], counts[alias_of[alias]]
    common = set(frequent)
    in_frequent = np.array([w in common for w in words], dtype=bool)
    if alias_of is not None:
        alias = np.flatnonzero(alias_of >= 0)
        in_frequent[alias] = in_frequent[alias_of[alias]]
    fallback_rows = None
    if alias_of is not None:
        index = {w: i for i, w in enumerate(words)}
        # serving's order: lowercase, capitalized (an alias row), and for
        # "cased" the word without its edge marks as written, lowercase, capitalized
        bare = [b.decode("utf-8") for b in layers.strip_marks(tf.constant(words, tf.string)).numpy()] \
            if standardize == "cased" and words else list(words)
        fallback_rows = np.full((len(words), 5), -1, dtype=np.int64)
        for i, (w, b) in enumerate(zip(words, bare)):
            forms = [w.lower(), _capitalized(w)]
            if b != w:
                forms += [b, b.lower(), _capitalized(b)]
            for j, f in enumerate(forms):
                if f != w:
                    fallback_rows[i, j] = index.get(f, -1)
    return WordTable(words, sums.astype(np.float16), counts, from_training=len(own), frequent=len(frequent),
                     in_frequent=in_frequent, alias_of=alias_of, cased=standardize in ("cased", "cased_punct"),
                     fallback_rows=fallback_rows, pieces=piece_ids)


# --------------------------------------------------------------------------
# The layer
# --------------------------------------------------------------------------

PretrainedEmbedding = layers.PretrainedEmbedding  # lives in layers: serving workers load it


# --------------------------------------------------------------------------
# The view, for autoselect / autofeatures
# --------------------------------------------------------------------------

@dataclass(eq=False)
class PretrainedView:
    """The view as the search sees it: a dense (n, DIM) block, no IDF."""

    table: WordTable
    name: str = "pretrained"
    standardize: str = "cased"
    dense: bool = field(default=True)
    scale: float = SCALE
    l2: bool = True  # false: the mean times `scale`, no per-text norm (fit_view)
    _word_pieces: sp.csr_matrix | None = field(default=None, repr=False)

    @property
    def strip(self) -> bool:
        """Whether serving looks a word still unknown up without its edge marks
        (auto's split "cased", which keeps marks attached to words)."""
        return self.standardize == "cased"

    @property
    def pieces(self) -> bool:
        """Whether serving splits a word the table lacks in every form into
        the tokenizer's pieces (auto's split "cased", folded table:
        layers.PretrainedLogits `pieces`)."""
        return self.standardize == "cased" and not self.l2

    @property
    def fallback(self) -> bool:
        """Whether serving looks an unknown word up again lowercased (the case-kept split)."""
        return self.standardize in ("cased", "cased_punct")

    def vocabulary(self) -> list[str]:
        return [f"pretrained[{i}]" for i in range(self.table.sums.shape[1])]

    def layer(self, standardized: bool = False) -> PretrainedEmbedding:
        t = self.table
        pieces = 0 if t.pieces is None else len(np.unique(t.pieces))
        lay = PretrainedEmbedding(len(t.words), t.sums.shape[1],
                                  None if standardized else self.standardize, self.scale,
                                  packed=True, l2=self.l2, fallback=self.fallback, strip=self.strip,
                                  pieces=pieces, piece_refs=0 if t.pieces is None else len(t.pieces),
                                  name=f"vectorizer_{self.name}")
        lay.set_table(t, codebook() if t.pieces is not None else None)
        return lay

    def fusable(self, units: int) -> bool:
        """Whether linear_graph may fold a linear map of `units` outputs into the table."""
        return not self.l2 and units <= FUSED_MAX_UNITS

    def fused_layer(self, kernel: np.ndarray, bias: np.ndarray | None, standardized: bool = False,
                    name: str | None = None) -> layers.PretrainedLogits:
        """The view and its linear map (kernel (DIM, units)) as one PretrainedLogits."""
        kernel = np.asarray(kernel, dtype=np.float64)
        projected = self.table.sums.astype(np.float64) @ kernel
        pieces, piece_projected = None, None
        if self.pieces:
            pieces, rows = piece_list()
            # rounded to float16, which the lean plan stores (half their memory)
            piece_projected = (codebook()[rows].astype(np.float64) @ kernel).astype(np.float16).astype(np.float32)
        lay = layers.PretrainedLogits(len(self.table.words), kernel.shape[1],
                                      None if standardized else self.standardize, self.scale,
                                      use_bias=bias is not None, fallback=self.fallback, strip=self.strip,
                                      pieces=len(pieces or ()), name=name or f"logits_{self.name}")
        lay.set_table(self.table.words, projected.astype(np.float32), self.table.counts, bias, pieces,
                      piece_projected)
        return lay

    def features(self, texts: list[str], batch: int = 1024) -> np.ndarray:
        """What the served layer outputs for `texts` (the same ops)."""
        lay = self.layer()
        fn = tf.function(lambda t: lay(t), input_signature=[tf.TensorSpec([None], tf.string)])
        out = [fn(tf.constant(texts[i:i + batch], tf.string)).numpy() for i in range(0, len(texts), batch)]
        return np.concatenate(out) if out else np.zeros((0, self.table.sums.shape[1]), np.float32)

    def word_counts(self, texts: list[str], batch: int = 2048) -> sp.csr_matrix:
        """(len(texts), table words) occurrences of each table word in each
        text, split and looked up as the served layer does."""
        lay = self.layer()
        rows, cols = [], []
        for i in range(0, len(texts), batch):
            words = tf.strings.split(layers._STANDARDIZERS[self.standardize](
                tf.constant(texts[i:i + batch], tf.string)))
            rows.append(words.value_rowids().numpy() + i)
            cols.append(lay.word_ids(words.flat_values).numpy())
        r = np.concatenate(rows) if rows else np.zeros(0, np.int64)
        c = np.concatenate(cols) if cols else np.zeros(0, np.int64)
        known = c > 0  # id 0: not in the table
        m = sp.csr_matrix((np.ones(int(known.sum())), (r[known], c[known] - 1)),
                          shape=(len(texts), len(self.table.words)))
        m.sum_duplicates()
        return m

    def features_of(self, counts: sp.csr_matrix, known: np.ndarray | None = None) -> np.ndarray:
        """The view's vectors from word_counts, as if the table held only the
        words where `known` is true (float64; `l2` false views).

        The search's folds use it: a word met only in a fold's held-out texts
        is unknown there, as a word first met in serving is, instead of
        having a vector because the table was built from every training text.
        Where serving splits such a word into pieces (`pieces`), so do these
        vectors: the word's pieces' vectors and their count."""
        total_pieces = None
        if known is not None:
            remap = self._remap(known)
            if self.pieces:
                lost = np.asarray(remap.sum(axis=1)).ravel() == 0
                if lost.any():
                    by_piece = sp.csr_matrix(counts @ (sp.diags(lost.astype(np.float64)) @ self.word_pieces()))
                    used = np.unique(by_piece.indices)
                    total_pieces = (np.asarray(by_piece[:, used] @ codebook()[piece_list()[1][used]]
                                               .astype(np.float64)),
                                    np.asarray(by_piece.sum(axis=1)).ravel())
            counts = sp.csr_matrix(counts @ remap)
        total = np.asarray(counts @ self.table.sums.astype(np.float64))
        subwords = np.asarray(counts @ self.table.counts.astype(np.float64)).ravel()
        if total_pieces is not None:
            total, subwords = total + total_pieces[0], subwords + total_pieces[1]
        return total * (self.scale / np.maximum(subwords, 1.0))[:, None]

    def word_pieces(self) -> sp.csr_matrix:
        """(table words, pieces): each table word's pieces (computed once)."""
        if self._word_pieces is None:
            self._word_pieces = word_pieces(self.table.words)
        return self._word_pieces

    def _remap(self, known: np.ndarray) -> sp.csr_matrix:
        """(n, n) 0/1: each row's occurrences go to the row a table with only
        the `known` rows would serve: itself when known, else (case-kept
        tables) its lowercase form's row, else its capitalized form's, when
        known; else nowhere (unknown)."""
        n = len(known)
        target = np.where(known, np.arange(n), -1)
        fb = self.table.fallback_rows
        if fb is not None:
            for j in range(fb.shape[1]):
                take = (target < 0) & (fb[:, j] >= 0)
                take[take] &= known[fb[take, j]]
                target[take] = fb[take, j]
        keep = np.flatnonzero(target >= 0)
        return sp.csr_matrix((np.ones(len(keep)), (keep, target[keep])), shape=(n, n))

    def unknown_share(self, texts: list[str]) -> float:
        """Share of the words of `texts` (running words) that the table lacks
        (after the lowercase fallback, where the view has it)."""
        lay = self.layer()
        total = unknown = 0
        for i in range(0, len(texts), 2048):
            split = tf.strings.split(layers._STANDARDIZERS[self.standardize](
                tf.constant(texts[i:i + 2048], tf.string)))
            ids = lay.word_ids(split.flat_values).numpy()
            total += len(ids)
            unknown += int((ids == 0).sum())
        return unknown / max(1, total)


def fit_view(texts: list[str], n_frequent: int = FREQUENT_WORDS, standardize: str = "cased"
             ) -> tuple[PretrainedView, np.ndarray]:
    """`auto`'s view for these training texts, and its features for them.

    The view's vector is the mean times one constant, SCALE / the median norm
    of the training texts' means (texts with a known word), not a per-text
    L2 norm: the logits are then linear in the words, which lets the served
    graph fold the linear map into the table (layers.PretrainedLogits). On
    the development sets (LinearSVC on word + character TF-IDF plus the
    vector, 300 and all labels) the constant measured within +-0.7 points of
    the per-text norm, on average level (docs/models.md).

    `standardize` "word" builds the folded view of the versions before case
    was kept (lowercase, punctuation dropped), for the benches' comparisons."""
    view = PretrainedView(build_table(texts, n_frequent, standardize), standardize=standardize, scale=0.0, l2=False)
    raw = view.features(texts)
    norms = np.linalg.norm(raw, axis=1)
    known = norms[norms > 0]
    view.scale = float(SCALE / np.median(known)) if len(known) else 1.0
    return view, (raw * view.scale).astype(np.float32)
