"""auto's pretrained view (model_worker/pretrained.py, layers.PretrainedEmbedding).

- the word table and the graph's mean against the package's own embedding
  (its tokenizer and codebook, WordLlamaInference.embed);
- the layer inside a model saved as .keras and reloaded in safe mode in a
  fresh interpreter that imports only what a serving worker imports (and
  not tokenizers, safetensors, wordfreq nor wordllama), and in the
  portable SavedModel;
- auto tries the view on English, never with `pretrained: false`, never on
  CJK text;
- nothing touches the network: every test here runs with sockets blocked.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent

pretrained = pytest.importorskip("model_worker.pretrained")
if not pretrained.available():
    pytest.skip("the wordllama package is not installed", allow_module_level=True)


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    """Any attempt to open an internet socket fails the test."""
    real = socket.socket

    class Guarded(real):
        def connect(self, address):
            if self.family in (socket.AF_INET, socket.AF_INET6):
                raise AssertionError(f"network access attempted: {address}")
            return super().connect(address)

        def connect_ex(self, address):
            if self.family in (socket.AF_INET, socket.AF_INET6):
                raise AssertionError(f"network access attempted: {address}")
            return super().connect_ex(address)

    def no_dns(*args, **kwargs):
        raise AssertionError(f"DNS lookup attempted: {args[:1]}")

    monkeypatch.setattr(socket, "socket", Guarded)
    monkeypatch.setattr(socket, "create_connection", no_dns)
    monkeypatch.setattr(socket, "getaddrinfo", no_dns)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    yield


ENGLISH = [
    "the striker scored twice in the second half",
    "a new smartphone chip promises longer battery life",
    "grilled salmon with lemon and fresh herbs",
    "stock markets fell sharply after the announcement",
    "the compiler crashed while building the kernel",
    "she planted tomatoes and beans in the garden",
    "unhappiness is often a matter of perspective",
    "open source databases need careful backups",
]

RAW = [
    "The striker scored twice, in the second half!",
    "A new smartphone chip promises longer battery life.",
    "Grilled salmon: lemon and fresh herbs.",
]


def _package_means(texts: list[str]) -> np.ndarray:
    """What WordLlama computes (WordLlamaInference.embed, no normalisation),
    with the package's own class on the wheel's files, loaded by path."""
    from wordllama.inference import WordLlamaInference

    from tokenizers import Tokenizer

    # its own tokenizer: WordLlamaInference turns padding on in the one it is given
    tok = Tokenizer.from_file(os.path.join(pretrained.package_dir(), pretrained.TOKENIZER_FILE))
    model = WordLlamaInference(pretrained.codebook(), tok)
    return model.embed(texts, norm=False)


def _cos(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def test_table_matches_the_package():
    table = pretrained.build_table(ENGLISH, n_frequent=2000)
    assert set(pretrained.words_of(ENGLISH)) <= set(table.words)
    assert table.sums.dtype == np.float16 and table.sums.shape == (len(table.words), pretrained.DIM)
    # one word: the sum of its subwords' vectors and how many there are
    i = table.words.index("unhappiness")
    ids = pretrained.tokenizer().encode("unhappiness", add_special_tokens=False).ids
    assert table.counts[i] == len(ids) > 1
    ref = pretrained.codebook()[ids].astype(np.float32).sum(0)
    assert np.allclose(table.sums[i].astype(np.float32), ref, atol=0.02 * np.abs(ref).max())
    # the graph's mean over a text's words = the package's mean over its subwords
    view = pretrained.PretrainedView(table, scale=0.0)
    got = view.features(ENGLISH)
    want = _package_means(ENGLISH)
    assert np.allclose(got, want, atol=2e-2), np.abs(got - want).max()
    assert _cos(got, want).min() > 0.9999


MIXED = [
    "Oil Prices Rise as OPEC Cuts Output, Analysts Say",
    "Apple's new iPhone (the 15 Pro) sells OUT in Tokyo!",
    "The U.S. Senate passed the Bill; NASA's budget grows.",
    "why? -- because: Mixed-Case words, punctuation & symbols ... stay",
    "McDonald's CEO met eBay's CFO in São Paulo",
]


def test_served_vector_is_the_packages_embed_of_raw_text():
    """The view keeps case and punctuation: a word as written (split at
    whitespace, marks attached) has the pieces the tokenizer gives it inside
    the whole text, so the served vector is the package's embed() of the raw
    text, to float16 precision (the table's sums are float16)."""
    table = pretrained.build_table(MIXED, n_frequent=2000)
    assert table.cased and "OPEC" in table.words and "Output," in table.words and "Apple's" in table.words
    got = pretrained.PretrainedView(table, scale=0.0, l2=False).features(MIXED)
    want = _package_means(MIXED)
    assert np.allclose(got, want, rtol=2e-3, atol=2e-3), np.abs(got - want).max()
    assert _cos(got, want).min() > 0.99999
    # the folded (lowercase, punctuation dropped) split of the versions before is further off
    old = pretrained.build_table(MIXED, n_frequent=2000, standardize="word")
    folded = pretrained.PretrainedView(old, standardize="word", scale=0.0, l2=False).features(MIXED)
    assert np.abs(folded - want).max() > 10 * np.abs(got - want).max()


def test_unknown_case_falls_back_to_lowercase_then_capitalized():
    """A word the table lacks as written takes its lowercase form's vector,
    else its capitalized form's, before it counts as unknown."""
    table = pretrained.build_table(["Oil prices in Texas"], n_frequent=0)
    assert "oil" in table.words and table.alias_of[table.words.index("oil")] == table.words.index("Oil")
    view = pretrained.PretrainedView(table, scale=0.0, l2=False)
    want = dict(zip(["Oil", "prices", "Texas"], view.features(["Oil", "prices", "Texas"])))
    got = view.features(["OIL", "oil", "PRICES", "Prices", "TEXAS", "texas", "Gas"])
    for g, w in zip(got, ["Oil", "Oil", "prices", "prices", "Texas", "Texas"]):
        assert np.allclose(g, want[w], atol=1e-6), w
    assert not got[-1].any()                      # no form of it: unknown
    assert view.unknown_share(["OIL gas Texas"]) == 1 / 3
    # still unknown: the form without the marks at its ends, as written, lowercased, capitalized
    got = view.features(["(Oil,", "prices.", "\"TEXAS\"", "texas!", "--", "gas."])
    for g, w in zip(got, ["Oil", "prices", "Texas", "Texas"]):
        assert np.allclose(g, want[w], atol=1e-6), w
    assert not got[4:].any()
    # the frequent words come as written and capitalized
    freq = pretrained.build_table([], n_frequent=500)
    assert {"the", "The", "people", "People"} <= set(freq.words)
    assert freq.in_frequent.all()


def test_zero_shot_split_keeps_case_and_splits_marks():
    """The zero-shot view (no training texts: marks are split off so that
    "kernel." finds "kernel") keeps case: on texts without marks whose words
    the frequent list holds, the package's embed() of the text as written;
    each mark is a token of its own, with the pieces it has alone."""
    from model_worker import zeroshot

    assert zeroshot.STANDARDIZE == "cased_punct"
    texts = ["The Linux kernel", "Games puzzles and music", "Paris is in France"]
    table = pretrained.build_table([], n_frequent=30_000, standardize="cased_punct", capitalized=30_000)
    assert {"Linux", "linux", "Paris", ".", ","} <= set(table.words)
    view = pretrained.PretrainedView(table, standardize="cased_punct", scale=0.0, l2=False)
    got, want = view.features(texts), _package_means(texts)
    assert np.allclose(got, want, rtol=2e-3, atol=2e-3), np.abs(got - want).max()
    assert not np.allclose(got, view.features([t.lower() for t in texts]), atol=1e-2)  # case matters
    # "Paris, France!" = the mean over the pieces of Paris, ",", France, "!"
    ids = [pretrained.tokenizer().encode(t, add_special_tokens=False).ids for t in ("Paris", ",", "France", "!")]
    mean = np.concatenate([pretrained.codebook()[i].astype(np.float32) for i in ids]).mean(0)
    assert np.allclose(view.features(["Paris, France!"])[0], mean, atol=2e-3)
    # an upper-case word the list lacks falls back to its lowercase form
    assert np.allclose(view.features(["GAMES"]), view.features(["games"]), atol=1e-6)


def test_versions_before_keep_the_folded_lookup():
    """A layer saved before case was kept has no `fallback` in its config: it
    loads with one lookup and its lowercase split, computing what it did."""
    import tensorflow as tf

    table = pretrained.build_table(ENGLISH, n_frequent=500, standardize="word")
    assert not table.cased
    lay = pretrained.PretrainedView(table, standardize="word", scale=0.5, l2=False).layer()
    config = lay.get_config()
    assert config["fallback"] is False and config["standardize"] == "word"
    del config["fallback"]
    again = pretrained.PretrainedEmbedding.from_config(config)
    again.set_table(table)
    texts = ["The STRIKER scored twice!", "Grilled salmon, LEMON."]
    a, b = lay(tf.constant(texts)).numpy(), again(tf.constant(texts)).numpy()
    assert not again.fallback and np.allclose(a, b)
    # lowercased and punctuation dropped, as before
    assert np.allclose(a, lay(tf.constant(["the striker scored twice", "grilled salmon lemon"])).numpy(), atol=1e-6)


def test_punctuation_split_gives_each_mark_its_vector():
    """The zero-shot view's split (word_punct) keeps each punctuation mark as a
    token of its own, with the package's vector of that mark; the words' part
    of the mean is the word split's; a text of marks alone has a vector (the
    word split gives it none)."""
    texts = [t.lower() for t in RAW] + ["why? -- because!"]
    words = pretrained.build_table(texts, n_frequent=2000, standardize="word")
    marks = pretrained.build_table(texts, n_frequent=2000, standardize="word_punct")
    assert {"?", "!", ",", ":", "-"} <= set(marks.words) and "?" not in words.words
    assert set(pretrained.PUNCTUATION) <= set(marks.words)   # the table holds every mark
    assert set(words.words) <= set(marks.words)
    split = pretrained.PretrainedView(marks, standardize="word_punct", scale=0.0)
    plain = pretrained.PretrainedView(words, standardize="word", scale=0.0)
    # "why? -- because!" = the mean over the pieces of why, ?, -, -, because, !
    ids = [pretrained.tokenizer().encode(t, add_special_tokens=False).ids
           for t in ("why", "?", "-", "-", "because", "!")]
    want = np.concatenate([pretrained.codebook()[i].astype(np.float32) for i in ids]).mean(0)
    got = split.features(["why? -- because!"])[0]
    assert np.allclose(got, want, atol=2e-2), np.abs(got - want).max()
    # a text without marks: the same vector either way
    assert np.allclose(split.features(["the cat sat"]), plain.features(["the cat sat"]), atol=1e-6)
    assert split.features(["?!"]).any() and not plain.features(["?!"]).any()


def test_unknown_words_are_left_out():
    table = pretrained.build_table(["the cat sat on the mat"], n_frequent=0)
    view = pretrained.PretrainedView(table, scale=0.0)
    known, mixed, unknown = view.features(["the cat", "the cat zqxjv blorfle", "zqxjv blorfle"])
    assert np.allclose(known, mixed)           # unknown words add nothing
    assert not unknown.any()                   # no known word: zeros
    scaled = pretrained.PretrainedView(table).features(["the cat", "zqxjv"])
    assert np.isclose(np.linalg.norm(scaled[0]), pretrained.SCALE, atol=1e-4)
    assert not scaled[1].any()


def test_unknown_words_add_their_pieces():
    """A word the folded table (PretrainedLogits, what auto serves) lacks in
    every form adds the vectors of its pieces: from the word-start mark on,
    the longest piece of the tokenizer's vocabulary at each place
    (model_worker.pieces.greedy_pieces, which the graph runs too). Where that is the
    tokenizer's own BPE split, the served mean of a mixed-case sentence with
    invented words is the package's embed() of the raw text (to float16
    precision) as for known words; without the pieces it is further off.
    A word whose split differs adds exactly its greedy pieces; a word longer
    than MOST_PIECED characters adds nothing; the graph's split is the
    Python one, word for word."""
    import tensorflow as tf

    from model_worker.pieces import MOST_PIECED, greedy_pieces

    invented = ["Quintaphrax", "qwxvplugh", "Kubectl", "snorfix,", "Xyzzy"]  # BPE splits them greedily
    texts = [f"The striker {invented[0]} scored twice, {invented[1]} in the second half!",
             f"{invented[2]} and {invented[3]} Grilled salmon {invented[4]}"]
    # every other word is in the table as written
    view, _ = pretrained.fit_view([" ".join(w for w in t.split() if w not in invented) for t in texts],
                                  n_frequent=500)
    view.scale = 1.0
    lay = view.fused_layer(np.eye(pretrained.DIM), None)  # its output: the mean itself
    assert lay.pieces == len(pretrained.piece_list()[0]) > 30_000
    pieces, rows = pretrained.piece_list()
    tok, book = pretrained.tokenizer(), pretrained.codebook()
    for w in invented:
        assert not {w, w.lower(), w.capitalize(), w.strip(",")} & set(view.table.words)
        assert [pieces[j] for j in greedy_pieces(w, pieces)] == tok.encode(w, add_special_tokens=False).tokens
    got, want = lay(tf.constant(texts)).numpy(), _package_means(texts)
    assert np.allclose(got, want, rtol=2e-3, atol=2e-3), np.abs(got - want).max()
    without = pretrained.PretrainedView(view.table, scale=1.0, l2=False).features(texts)  # no pieces
    assert np.abs(without - want).max() > 10 * np.abs(got - want).max()
    # a split that is not BPE's: exactly the greedy pieces' mean
    odd = "x86_64-linux-gnu"
    assert odd not in view.table.words
    split = greedy_pieces(odd, pieces)
    assert len(split) > 3
    alone = lay(tf.constant([odd])).numpy()[0]
    assert np.allclose(alone, book[rows[split]].astype(np.float64).mean(0), atol=1e-3)
    long = "a" * (MOST_PIECED + 1)
    assert not greedy_pieces(long, pieces) and not lay(tf.constant([long])).numpy().any()
    # the graph's split, word for word (non-ASCII, marks, characters no piece starts, the mark itself)
    rng = np.random.default_rng(3)
    alphabet = list("abXYZ-_.09éß日▁🙂'") + ["qu", "ing", "tion"]
    words = ["".join(rng.choice(alphabet, size=rng.integers(1, 24))) for _ in range(400)] + [long, "x" * 32]
    graph = layers_split(words)
    assert graph == [[j + 1 for j in greedy_pieces(w, pieces)] for w in words]


def layers_split(words: list[str]) -> list[list[int]]:
    import keras
    import tensorflow as tf

    from model_worker import layers

    lookup = keras.layers.StringLookup(vocabulary=pretrained.piece_list()[0], num_oov_indices=1, mask_token=None)
    return layers.greedy_pieces(tf.constant(words), lookup).to_list()


def test_packed_table_computes_what_the_first_layout_did():
    """One Embedding holding sums and counts (packed, the layout new versions
    get) and the first layout's two give the same vectors, for texts with no
    known word anywhere in the batch (first, middle, last) too."""
    import tensorflow as tf

    table = pretrained.build_table(ENGLISH, n_frequent=500, standardize="word")
    packed = pretrained.PretrainedView(table, standardize="word").layer()
    first = pretrained.PretrainedEmbedding(len(table.words), pretrained.DIM, "word", 0.5, packed=False)
    first.set_table(table)
    assert packed.packed and not first.packed
    texts = ["zqxjv", *ENGLISH[:3], "", "blorfle", *RAW, "zqxjv blorfle", ""]
    a, b = packed(tf.constant(texts)).numpy(), first(tf.constant(texts)).numpy()
    assert a.shape == (len(texts), pretrained.DIM)
    assert np.allclose(a, b, atol=1e-6)
    empty = [i for i, t in enumerate(texts) if not t or "zqxjv" in t or t == "blorfle"]
    assert not a[empty].any() and all(a[i].any() for i in range(len(texts)) if i not in empty)
    assert packed(tf.constant([], tf.string)).numpy().shape == (0, pretrained.DIM)
    ids = np.array([0, 5, 2])
    for lay in (packed, first):
        sums, counts = lay.table_rows(ids)
        assert sums.shape == (3, pretrained.DIM) and counts[0] == 0 and not sums[0].any()
        assert counts[1] == table.counts[4] and np.allclose(sums[1], table.sums[4].astype(np.float64))


def test_piece_table_computes_what_the_summed_table_did(tmp_path):
    """The pieces layout (zero-shot versions: each subword vector stored once,
    each word's ids) gives the mean of the float16 layout, and exactly the
    package's own numbers on texts whose words it knows; an alias row (a
    lowercase form the table lacks) takes its capitalized form's pieces; the
    layer saves and loads; and the table costs ids, not vectors, a word."""
    import keras
    import tensorflow as tf

    texts = ["The man and the woman", "It is in the house", "Paris, France!", "GAMES and Music",
             "", "zqxjv", "zorblax pie"]
    table = pretrained.build_table(["Zorblax"], n_frequent=5_000, standardize="cased_punct",
                                   capitalized=5_000, pieces=True)
    assert table.pieces is not None and len(table.pieces) == int(table.counts.sum())
    summed = pretrained.WordTable(table.words, table.sums, table.counts, alias_of=table.alias_of,
                                  cased=True, fallback_rows=table.fallback_rows)
    a = pretrained.PretrainedView(table, standardize="cased_punct", scale=0.0, l2=False)
    b = pretrained.PretrainedView(summed, standardize="cased_punct", scale=0.0, l2=False)
    lay = a.layer()
    assert lay.pieces == len(np.unique(table.pieces)) and not b.layer().pieces
    got, old = a.features(texts), b.features(texts)
    assert np.allclose(got, old, atol=2e-3), np.abs(got - old).max()
    known = [0, 1]
    want = _package_means([texts[i] for i in known])
    assert np.abs(got[known] - want).max() < 1e-5
    assert not got[4].any() and not got[5].any()
    ids = np.array([0, table.words.index("house") + 1, table.words.index("zorblax") + 1])
    sums, counts = lay.table_rows(ids)
    assert counts[0] == 0 and not sums[0].any()
    assert np.allclose(sums[1:], table.sums[ids[1:] - 1].astype(np.float64), atol=2e-3)
    assert table.alias_of[ids[2] - 1] == table.words.index("Zorblax")  # takes "Zorblax"'s pieces
    text = keras.Input(shape=(), dtype="string")
    model = keras.Model(text, lay(text))
    model.save(tmp_path / "pieces.keras")
    again = keras.saving.load_model(tmp_path / "pieces.keras", safe_mode=True)
    assert np.array_equal(again(tf.constant(texts)).numpy(), model(tf.constant(texts)).numpy())
    # per word: its ids (4 bytes each) and a start (8), against DIM + 1
    # float16 numbers; the vectors are bounded by the distinct pieces (at most 32,000)
    per_word = sum(int(np.prod(w.shape)) * np.dtype(w.dtype).itemsize
                   for w in (lay.word_splits, lay.word_pieces)) / len(table.words)
    assert per_word < 0.05 * (pretrained.DIM + 1) * 2, per_word
    assert lay.piece_vectors.embeddings.shape == (lay.pieces, pretrained.DIM) and lay.pieces < 32_000


def test_saved_model_reloads_in_a_serving_process(tmp_path):
    import keras
    import tensorflow as tf

    from model_worker import textmodel

    table = pretrained.build_table(ENGLISH + RAW, n_frequent=500)
    view = pretrained.PretrainedView(table)
    # beside the view's (case kept) layer, one in the first layout (two
    # Embeddings, lowercase words), as versions saved before the packed table
    # hold it: both load and serve
    folded = pretrained.build_table(ENGLISH, n_frequent=500, standardize="word")
    first = pretrained.PretrainedEmbedding(len(folded.words), pretrained.DIM, "word", 0.5, packed=False,
                                           name="first_layout")
    first.set_table(folded)
    text = keras.Input(shape=(), dtype="string", name="text")
    both = keras.layers.Concatenate()([view.layer()(text), first(text)])
    out = keras.layers.Dense(3, activation="softmax", name="probs")(both)
    model = keras.Model(text, out)
    probe = ENGLISH + RAW + ["", "zqxjv", "THE STRIKER Scored"]
    expected = model(tf.constant(probe)).numpy()
    model.save(tmp_path / "model.keras")
    textmodel.export_saved_model(model, str(tmp_path / "saved_model"), probe, expected)
    np.save(tmp_path / "expected.npy", expected)
    # a fresh interpreter, as a serving worker: textmodel only, safe mode; and
    # the SavedModel in plain TensorFlow; neither imports the trainer's packages
    code = f"""
import sys, json, numpy as np
import keras, tensorflow as tf
from model_worker import textmodel
probe = {probe!r}
m = keras.saving.load_model({str(tmp_path / "model.keras")!r}, safe_mode=True)
want = np.load({str(tmp_path / "expected.npy")!r})
a = np.abs(textmodel.make_predict_fn(m)(probe) - want).max()
sm = tf.saved_model.load({str(tmp_path / "saved_model")!r})
b = np.abs(sm.serve(tf.constant(probe)).numpy() - want).max()
bad = [p for p in ("tokenizers", "safetensors", "wordfreq", "wordllama", "model_worker.pretrained") if p in sys.modules]
print(json.dumps({{"keras": float(a), "saved_model": float(b), "imported": bad}}))
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TF_CPP_MIN_LOG_LEVEL": "3"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=240)
    assert res.returncode == 0, res.stderr[-2000:]
    import json

    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["keras"] < 1e-5 and got["saved_model"] < 1e-5, got
    assert got["imported"] == [], got


def _topics() -> tuple[list[str], list[str]]:
    from tests.test_autoselect import english

    return english()


def test_auto_tries_the_view_and_the_switch_turns_it_off():
    from model_worker import textmodel

    texts, labels = _topics()
    on = textmodel.train_model(texts, labels, {"time_budget_s": 30, "folds": 2})
    names = [c["name"] for c in on.report["candidates"]] + [c["name"] for c in on.report["pruned"]]
    assert any("pretrained" in n for n in names), names
    assert on.report["pretrained"]["used"] and on.report["pretrained"]["words"] > 1000
    probs = textmodel.make_predict_fn(on.model)(["a tennis final", "spicy noodle soup"])
    assert probs.shape == (2, 3)
    off = textmodel.train_model(texts, labels, {"time_budget_s": 30, "folds": 2, "pretrained": False})
    names = [c["name"] for c in off.report["candidates"]] + [c["name"] for c in off.report["pruned"]]
    assert not any("pretrained" in n for n in names), names
    assert off.report["pretrained"] == {"used": False, "why": "pretrained is false"}
    assert not any(isinstance(lay, (pretrained.PretrainedEmbedding, pretrained.layers.PretrainedLogits))
                   for lay in off.model.layers)


def test_view_in_the_served_graph(tmp_path, monkeypatch):
    """Forced onto the view (alone, and beside words), with its linear map
    folded into the table (PretrainedLogits, what training builds) and as a
    vector table: the served graph reproduces the fitted linear model
    (final_model checks it on training rows), explains itself, and saves
    and reloads in safe mode."""
    import time

    import keras

    from model_worker import autoselect, explain, layers, textmodel
    from model_worker.params import validate_params

    texts, labels = _topics()
    names = sorted(set(labels))
    y = np.array([names.index(x) for x in labels])
    params = validate_params({"time_budget_s": 30, "folds": 2})
    search = autoselect.Search(texts, y, len(names), params, "word", time.monotonic(), None, None)
    assert "pretrained" in search.view_defs
    view = search.view_defs["pretrained"]
    assert not view.l2 and view.scale > 0  # one constant: the median training text's vector has norm SCALE
    norms = np.linalg.norm(search.counts["pretrained"].matrix.toarray(), axis=1)
    assert np.isclose(np.median(norms[norms > 0]), pretrained.SCALE, rtol=1e-3)
    probe = ["a tennis final", "spicy noodle soup", "zqxjv"]
    for views, fused, weight in ((("pretrained",), True, 1.0), (("word", "pretrained"), True, 2.0),
                                 (("word", "pretrained"), False, 1.0)):
        if not fused:
            monkeypatch.setattr(type(view), "fusable", lambda self, units: False)
        cand = autoselect.Candidate(views, "svm", 1.0, False, weight)
        model = autoselect.final_model(search, [cand], [1.0])
        kinds = {type(lay) for lay in model.layers}
        assert (layers.PretrainedLogits in kinds) == fused and (pretrained.PretrainedEmbedding in kinds) != fused
        probs, why = explain.explainer_for(model)(probe, 3)
        assert np.allclose(probs, textmodel.make_predict_fn(model)(probe), atol=1e-5)
        for row in why:  # listed + others + bias = logit, the pretrained part one term
            total = sum(f["contribution"] for f in row["features"]) + row["others"] + row["bias"]
            assert abs(total - row["logit"]) < 1e-3, row
        for row, text in zip(why, probe):  # the view's terms are the text's own words
            assert all(f["ngram"] in text for f in row["features"] if f["view"] == "pretrained")
        assert any(f["view"] == "pretrained" for row in why for f in row["features"])
        # "zqxjv", unknown: the folded table adds its pieces, one term; the vector table nothing
        assert [f["ngram"] for f in why[2]["features"] if f["view"] == "pretrained"] == (["zqxjv"] if fused else [])
        model.save(tmp_path / "m.keras")
        again = keras.saving.load_model(tmp_path / "m.keras", safe_mode=True)
        assert np.allclose(textmodel.make_predict_fn(again)(probe), textmodel.make_predict_fn(model)(probe),
                           atol=1e-5)


@pytest.mark.parametrize("few", [True, False])
def test_the_views_weight_is_chosen_by_cv(few, monkeypatch):
    """Beside the n-grams the view is screened at several weights (the larger
    first at 300 texts or fewer), then, above 300 texts, beside the words
    alone at the weight that screened best beside the union; the learners go
    on with each view set's best weight, and the served graph computes the
    weighted model (final_model checks it)."""
    import time

    from model_worker import autoselect
    from model_worker.params import validate_params

    texts, labels = _topics()
    assert len(texts) <= autoselect._FEW_LABELS
    if not few:  # as if these were more than _FEW_LABELS texts
        monkeypatch.setattr(autoselect, "_FEW_LABELS", len(texts) - 1)
    names = sorted(set(labels))
    y = np.array([names.index(x) for x in labels])
    search = autoselect.Search(texts, y, len(names), validate_params({"time_budget_s": 60, "folds": 2}),
                               "word", time.monotonic(), None, None)
    search.search(include_networks=False)
    done = [s.candidate for s in search.scored] + [autoselect.Candidate(tuple(p["views"]), p["learner"], p["C"],
                                                                        p["balanced"], p.get("pretrained_weight", 1.0))
                                                   for p in search.pruned]
    beside = [c.weight for c in done if "pretrained" in c.views and len(c.views) > 1 and c.learner == "svm"
              and c.c == autoselect._SCREEN[1]]
    assert beside[:3] == list(autoselect._PRETRAINED_WEIGHTS_FEW if few else autoselect._PRETRAINED_WEIGHTS), beside
    union = next(c.views for c in done if "pretrained" in c.views and len(c.views) > 2)
    screened: dict[tuple[str, ...], dict[float, float]] = {}
    for s in search.scored:
        if "pretrained" in s.candidate.views and len(s.candidate.views) > 1 \
                and (s.candidate.learner, s.candidate.c) == autoselect._SCREEN:
            screened.setdefault(s.candidate.views, {})[s.candidate.weight] = s.score
    # the words with the view, once, at the union's best screened weight
    words = [c for c in done if c.views == ("word", "pretrained") and (c.learner, c.c) == autoselect._SCREEN]
    assert union in screened
    if few:
        assert words == []
    else:
        assert len(words) == 1 and words[0].weight == max(screened[union], key=lambda w: screened[union][w])
    later = [s.candidate for s in search.scored if "pretrained" in s.candidate.views
             and len(s.candidate.views) > 1 and (s.candidate.learner, s.candidate.c) != autoselect._SCREEN]
    for c in later:  # the learners take their view set's best screened weight
        assert c.weight == max(screened[c.views], key=lambda w: screened[c.views][w])
    assert later
    # two weights give two different served models, each the fitted one
    probe = ["a tennis final", "spicy noodle soup"]
    from model_worker import textmodel

    got = [textmodel.make_predict_fn(autoselect.final_model(
        search, [autoselect.Candidate(("word", "pretrained"), "svm", 1.0, False, w)], [1.0]))(probe)
        for w in (0.5, 2.0)]
    assert np.abs(got[0] - got[1]).max() > 1e-3


def test_cjk_text_never_gets_the_view():
    from model_worker import textmodel
    from tests.test_autoselect import chinese

    texts, labels = chinese(60)
    res = textmodel.train_model(texts, labels, {"time_budget_s": 20, "folds": 2})
    assert res.report["pretrained"]["used"] is False
    assert "CJK" in res.report["pretrained"]["why"]


def test_multilabel_gets_the_view(tmp_path):
    """Multi-label auto searches the same views; forced onto the view, its
    sigmoid graph reproduces the fitted one-vs-rest model and reloads."""
    import time

    import keras

    from model_worker import autoselect, textmodel
    from model_worker.params import validate_params

    texts, labels = _topics()
    sets = [[x] + (["news"] if t.startswith("news") else []) for t, x in zip(texts, labels)]
    res = textmodel.train_model(texts, sets, {"time_budget_s": 30, "folds": 2})
    assert res.report["pretrained"]["used"]
    names = [c["name"] for c in res.report["candidates"]] + [c["name"] for c in res.report["pruned"]]
    assert any("pretrained" in n for n in names), names
    label_names = sorted({x for s in sets for x in s})
    y = np.zeros((len(texts), len(label_names)), dtype=np.int8)
    for i, s in enumerate(sets):
        y[i, [label_names.index(x) for x in s]] = 1
    search = autoselect.Search(texts, y, len(label_names), validate_params({"time_budget_s": 30, "folds": 2}),
                               "word", time.monotonic(), None, None)
    model = autoselect.final_multilabel_model(search, autoselect.Candidate(("word", "pretrained"), "svm", 1.0),
                                              np.ones(len(label_names)), np.zeros(len(label_names)))
    model.save(tmp_path / "m.keras")
    again = keras.saving.load_model(tmp_path / "m.keras", safe_mode=True)
    probe = ["news about the tennis final", "zqxjv"]
    assert np.allclose(textmodel.make_predict_fn(again)(probe), textmodel.make_predict_fn(model)(probe), atol=1e-5)


def test_fused_table_computes_what_the_vector_table_did(tmp_path):
    """The view's linear map folded into its table (PretrainedLogits) gives
    the probabilities of the vector table and a SparseLinear, for one member
    and for an ensemble, texts with no word, and an empty batch; it explains
    itself with the same contributions; saved, it reloads in safe mode and
    as a portable SavedModel, unknown words' pieces and all. Too many logit
    columns keep the vector table (test_unknown_words_add_their_pieces: the
    pieces, which only the folded table adds)."""
    import keras
    import tensorflow as tf

    from model_worker import autofeatures, explain, layers, textmodel

    view, feats = pretrained.fit_view(ENGLISH, n_frequent=500)
    assert np.isclose(np.median(np.linalg.norm(feats, axis=1)), pretrained.SCALE, rtol=1e-4)
    assert np.allclose(feats, view.features(ENGLISH), atol=1e-6)  # what the layer serves
    rng = np.random.default_rng(7)
    texts = ["", *ENGLISH[:3], "", *RAW, " ", ""]
    pieced = [*texts, "zqxjv", "the zqxjv blorfle"]  # unknown words: the folded table adds their pieces
    parts = [(view, view.vocabulary(), np.ones(pretrained.DIM))]
    for n_members in (1, 3):
        members = [({"pretrained": rng.normal(size=(pretrained.DIM, 4))}, rng.normal(size=4))
                   for _ in range(n_members)]
        fused = autofeatures.linear_graph(parts, members)
        vector = autofeatures.linear_graph(parts, members, fuse=False)
        assert any(isinstance(lay, layers.PretrainedLogits) for lay in fused.layers)
        assert not any(isinstance(lay, layers.PretrainedLogits) for lay in vector.layers)
        a, b = textmodel.make_predict_fn(fused)(texts), textmodel.make_predict_fn(vector)(texts)
        assert a.shape == (len(texts), 4) and np.allclose(a, b, atol=1e-6)
        # what the fitted model computes from the features (members' probabilities averaged)
        z = np.stack([feats @ k["pretrained"] + bias for k, bias in members])
        p = np.exp(z - z.max(axis=2, keepdims=True))
        assert np.allclose(textmodel.make_predict_fn(fused)(ENGLISH), (p / p.sum(axis=2, keepdims=True)).mean(axis=0),
                           atol=1e-6)
        assert fused(tf.constant([], tf.string)).numpy().shape == (0, 4)
        (pa, ea), (pb, eb) = explain.Explainer(fused)(texts, 50), explain.Explainer(vector)(texts, 50)
        assert np.allclose(pa, pb, atol=1e-6)
        for x, y in zip(ea, eb):
            assert [f["ngram"] for f in x["features"]] == [f["ngram"] for f in y["features"]]
            assert np.allclose([f["contribution"] for f in x["features"]],
                               [f["contribution"] for f in y["features"]], atol=1e-5)
            total = sum(f["contribution"] for f in x["features"]) + x["others"] + x["bias"]
            assert abs(total - x["logit"]) < 1e-4, x
    assert not [f for f in ea[0]["features"]] and ea[1]["features"]  # "": nothing; English: its words
    fused.save(tmp_path / "m.keras")
    again = keras.saving.load_model(tmp_path / "m.keras", safe_mode=True)
    expected = textmodel.make_predict_fn(fused)(pieced)
    assert not np.allclose(expected[-2], expected[0])  # "zqxjv": its pieces, not the bias alone
    assert np.allclose(textmodel.make_predict_fn(again)(pieced), expected, atol=1e-6)
    textmodel.export_saved_model(fused, str(tmp_path / "saved_model"), pieced, expected)
    portable = tf.saved_model.load(str(tmp_path / "saved_model"))  # held: its variables live with it
    served = portable.serve(tf.constant(pieced)).numpy()
    assert np.allclose(served, expected, atol=1e-5)
    # a view with the per-text norm (versions trained before) is never folded, and explains exactly
    normed = pretrained.PretrainedView(view.table)
    assert normed.l2 and not normed.fusable(4)
    old = autofeatures.linear_graph([(normed, normed.vocabulary(), np.ones(pretrained.DIM))], members)
    assert not any(isinstance(lay, layers.PretrainedLogits) for lay in old.layers)
    _, why = explain.Explainer(old)(texts, 50)
    for x in why:
        assert abs(sum(f["contribution"] for f in x["features"]) + x["others"] + x["bias"] - x["logit"]) < 1e-4, x
    many = [({"pretrained": np.zeros((pretrained.DIM, pretrained.FUSED_MAX_UNITS + 1))},
             np.zeros(pretrained.FUSED_MAX_UNITS + 1))]
    wide = autofeatures.linear_graph(parts, many)
    assert not any(isinstance(lay, layers.PretrainedLogits) for lay in wide.layers)
    assert any(isinstance(lay, pretrained.PretrainedEmbedding) for lay in wide.layers)


def _forms(w: str) -> list[str]:
    cap = lambda x: x[:1].upper() + x[1:].lower()  # noqa: E731
    bare = w.strip("()[]{}.,;:!?\"'-")
    return [w, w.lower(), cap(w), bare, bare.lower(), cap(bare)]


def test_folds_see_held_out_only_words_as_unknown():
    """The table holds every training text's words, but in the search's folds
    a word that only held-out texts use counts as unknown (as a word first
    met in serving does) unless it is a frequent English word, and adds its
    pieces, as serving's folded table does; training-side rows keep their
    vectors. Without this, CV saw the view with no unknown
    words and chose it alone on a set where a fifth of the test words are
    function names (manpages_en at 300 labels: 12 points lost)."""
    import time

    import tensorflow as tf

    from model_worker import autoselect
    from model_worker.params import validate_params
    from model_worker.pieces import greedy_pieces

    texts, labels = _topics()
    texts = texts + ["zorbulex quintaphrax tennis zorbulex", "glimmerwab snorfix soup", "Snorfix SOUP tonight",
                     "(Glimmerwab) soup, again.", "zorbulex: tennis!"]
    labels = labels + [labels[0], labels[-1], labels[-1], labels[-1], labels[0]]
    names = sorted(set(labels))
    y = np.array([names.index(x) for x in labels])
    search = autoselect.Search(texts, y, len(names), validate_params({"time_budget_s": 30, "folds": 2}),
                               "word", time.monotonic(), None, None)
    view = search.view_defs["pretrained"]
    frequent = set(pretrained.frequent_words())
    table, (pieces, piece_rows), book = view.table, pretrained.piece_list(), pretrained.codebook()
    index = {w: i for i, w in enumerate(table.words)}
    full = search.counts["pretrained"].matrix.toarray()
    changed = 0
    for fold, (train, test) in enumerate(search.folds):
        x = search._fold_matrix(("pretrained",), fold).toarray()
        assert np.allclose(x[train], full[train], atol=1e-6)
        have = set(pretrained.words_of([texts[i] for i in train])) | frequent
        for i in test:
            tokens = texts[i].split()   # as written: case and punctuation kept
            # as written, else lowercase, else capitalized, else the same
            # without edge marks (serving's fallback)
            kept = [next(f for f in _forms(w) if f in have) for w in tokens if set(_forms(w)) & have]
            # a word lost in every form adds its pieces, as serving's folded table does
            lost = [w for w in tokens if not set(_forms(w)) & have]
            split = [j for w in lost for j in greedy_pieces(w, pieces)]
            rows = [index[f] for f in kept]
            total = table.sums[rows].astype(np.float64).sum(0) + book[piece_rows[split]].astype(np.float64).sum(0)
            want = total * view.scale / max(1.0, float(table.counts[rows].sum()) + len(split))
            assert np.allclose(x[i], want, atol=1e-5), texts[i]
            changed += len(kept) < len(tokens)
    assert changed >= 2  # the invented words' texts, held out, lost those words
