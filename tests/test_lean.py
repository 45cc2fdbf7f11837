"""The lean engine (model_worker/lean.py) answers what the Keras graph answers.

Real TensorFlow on one side, the lean steps on the other, on texts that
hypothesis draws from an alphabet of the awkward cases (case, marks, CJK,
Greek sigma, whitespace that only some splitters know, NUL, characters
whose Unicode properties changed between TensorFlow's tables and Python's):
- every standardizer and split gives the same words, lowercasing and mark
  stripping the same strings;
- the character tables shipped in tf_unicode.json are the installed
  TensorFlow's;
- every graph `auto` builds (word, char, punct and pretrained views, the
  folded and the vector table, ensembles, sigmoid), `bow` on words and on
  characters, and the zero-shot layout give the same scores within 1e-5;
- export writes nothing for a graph it cannot compute, or one whose plan
  disagrees.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from model_worker import lean
from model_worker.pieces import greedy_pieces

tf = pytest.importorskip("tensorflow")

ALPHABET = (
    "abcdefghijklmnopqrstuvwxyz" "ABCDEFGHIJKLMNOPQRSTUVWXYZ" "0123456789"
    " \t\n\x0b\x0c\r" "\x1c\x85\xa0\u2003\u3000\u200b"
    ".,;:!?'\"()[]{}-_/\\@#%&*+=<>|~^`$" "©®™→∑∞€£" "TTT[[[]]]"
    "éèêëàâäïîôöùûüçñßÆæØøÅåœŒ" "ΣσςΟΔΑΒΓ" "İıǅǄǆ" "\u0301\u0308\u030a"
    "我你他的是不了在人有这中大为上个国好用电池太行很" "ひらがなカタカナー・" "한국"
    "😀👍🎉" "\U00010570\U00010597\u2c2f\ua7c0" "\x00"
)
WORDS = ["T[", "t[", "/f", "是", "the", "The", "THE", "match", "Match", "football", "café", "Café", "很好", "电池", "iPhone",
         "don't", "(the", "kernel,", "Linux.", "ΟΔΟΣ", "straße"]


def _text(draw_chars: str, words: list[str]) -> str:
    return draw_chars + " " + " ".join(words) if words else draw_chars


ASCII = "".join(c for c in ALPHABET if c.isascii())
BMP = "".join(c for c in ALPHABET if c <= "\uffff")
# each text is matched by the narrowest of three pattern sets (ASCII, BMP,
# all of Unicode): every alphabet draws texts that fit each
texts_st = st.lists(
    st.builds(_text, st.sampled_from([ALPHABET, BMP, ASCII]).flatmap(lambda a: st.text(alphabet=a, max_size=40)),
              st.lists(st.sampled_from(WORDS), max_size=6)),
    min_size=1, max_size=24)


def _tf_words(name: str, texts: list[str]) -> list[list[str]]:
    from model_worker import layers

    out = tf.strings.split(layers._STANDARDIZERS[name](tf.constant(texts))).to_list()
    return [[w.decode("utf-8") for w in row] for row in out]


def test_tables_are_the_installed_tensorflows():
    """tf_unicode.json is what `python -m model_worker.lean --write-tables`
    reads from this TensorFlow (its classes, its lowercase, where Python's
    own Unicode tables differ)."""
    with open(lean.TABLES_FILE, encoding="ascii") as fh:
        shipped = json.load(fh)
    fresh = lean.read_tables()
    for key in ("word", "cjk", "space", "lower", "python_differs"):
        assert shipped[key] == json.loads(json.dumps(fresh[key])), key
    # the tables matter: Python's and TensorFlow's Unicode differ (newer
    # letters, Vithkuqi's case), and TensorFlow's lowercase stops at NUL
    assert shipped["python_differs"]
    assert tf.strings.lower("a\x00B", encoding="utf-8").numpy() == b"a"
    assert lean.text_ops().lower("a\x00B") == "a"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(texts_st)
def test_words_and_keys_are_tensorflows(texts):
    """Each standardizer and split gives TensorFlow's words; lowercasing and
    mark stripping TensorFlow's strings; the keys of the batch's word and
    character n-grams (computed from code points) are the keys of the
    n-gram strings TensorFlow builds (what a vocabulary's tokens get)."""
    from collections import Counter

    from model_worker import layers

    ops = lean.text_ops()
    for name in ("char", "word", "lower", "word_punct", "cased", "cased_punct"):
        assert ops.tokenize(texts, name) == _tf_words(name, texts), name
    split = [[w.decode("utf-8") for w in row] for row in tf.strings.split(tf.constant(texts)).to_list()]
    assert ops.tokenize(texts, None) == split
    lowered = [b.decode("utf-8") for b in tf.strings.lower(tf.constant(texts), encoding="utf-8").numpy()]
    assert [ops.lower(t) for t in texts] == lowered
    words = ops.words(texts, "cased")
    flat = words.strings()
    if flat:
        bare = [b.decode("utf-8") for b in layers.strip_marks(tf.constant(flat)).numpy()]
        assert [ops.strip_marks(w) for w in flat] == bare
        assert np.array_equal(words.keys(), lean.string_keys(flat))
        assert [lean.python_key(w) for w in flat] == words.keys().tolist()  # the same keys in Python integers
        # a word unknown as written: its other forms' keys (layers._lookup's
        # order), from code points in NumPy (many words) and through strings
        # (a few), both TensorFlow's strings' keys
        def tf_lower(ws):
            return [b.decode("utf-8") for b in tf.strings.lower(tf.constant(ws), encoding="utf-8").numpy()]

        every = np.arange(len(flat))
        for strip, forms in ((False, [tf_lower(flat)]), (True, [tf_lower(flat), bare, tf_lower(bare)])):
            want_keys = np.stack([lean.string_keys(f) for f in forms])
            for few in (0, len(flat)):
                ops._FEW_WORDS = few  # the shared TextOps: back to the class's below
                try:
                    assert np.array_equal(ops.fallback_keys(words, every, strip), want_keys), (strip, few)
                finally:
                    del ops._FEW_WORDS

    def per_text(keys, rows):
        return [Counter(keys[rows == i].tolist()) for i in range(len(texts))]

    for widths, uni in (((2, 3, 4, 5), False), ((2, 3), True)):
        want = layers._char_ngrams(tf.constant([" ".join(ws) for ws in ops.tokenize(texts, "cased")]),
                                   widths, uni).to_list()
        got = per_text(*lean.char_ngram_keys(words, widths, uni))
        assert got == [Counter(lean.string_keys([g.decode("utf-8") for g in row]).tolist()) for row in want]
    grams = tf.strings.ngrams(tf.strings.split(tf.constant(texts)), ngram_width=(1, 2, 3), separator=" ").to_list()
    got = per_text(*lean.word_ngram_keys(words, (1, 2, 3)))
    assert got == [Counter(lean.ngram_string_keys([g.decode("utf-8") for g in row]).tolist()) for row in grams]


# --------------------------------------------------------------------------
# Whole graphs
# --------------------------------------------------------------------------

CORPUS = [
    "The striker scored twice in the second half!", "a new smartphone chip promises longer battery life",
    "Grilled salmon with lemon and fresh herbs.", "Stock markets fell sharply after the announcement",
    "the compiler crashed while building the kernel", "She planted tomatoes and beans in the garden",
    "iPhone很好用，但是电池不太行。", "这个电池很好", "don't (the) kernel, Linux. café Café",
    "ΟΔΟΣ straße -- 100% of C++ & $HOME", "football match today", "news about football match",
]


def _graphs() -> list[tuple[str, object]]:
    """(what, a Keras model) for each kind of graph the lean engine serves."""
    import keras

    from model_worker import autofeatures, layers, pretrained, textmodel

    rng = np.random.default_rng(3)
    out: list[tuple[str, object]] = []
    for tokenize in ("word", "char"):
        views = autofeatures.views_for(tokenize)
        parts = []
        for name in ("word", "char", "punct"):
            counts = autofeatures.count_matrix(views[name], CORPUS, 5000)
            parts.append((views[name], counts.vocabulary, autofeatures.idf_weights(counts.matrix)))
        for n_members in (1, 2):
            members = [({v.name: rng.normal(size=(len(vocab), 3)) for v, vocab, _ in parts}, rng.normal(size=3))
                       for _ in range(n_members)]
            out.append((f"{tokenize} views, {n_members} member(s)", autofeatures.linear_graph(parts, members)))
        one = [({v.name: rng.normal(size=(len(vocab), 4)) for v, vocab, _ in parts}, rng.normal(size=4))]
        out.append((f"{tokenize} views, sigmoid", autofeatures.linear_graph(parts, one, activation="sigmoid")))
    # characters through TextVectorization (a vocabulary too wide to pack)
    fits = layers.CharNgramCounts.fits
    layers.CharNgramCounts.fits = classmethod(lambda cls, vocabulary, widths: False)  # type: ignore[method-assign]
    try:
        out.append(("char view through TextVectorization", autofeatures.linear_graph(parts, members)))
    finally:
        layers.CharNgramCounts.fits = fits  # type: ignore[method-assign]
    # the pretrained view: folded table, vector table, beside n-grams
    view, _ = pretrained.fit_view(CORPUS, n_frequent=2000)
    word = autofeatures.views_for("word")["word"]
    counts = autofeatures.count_matrix(word, CORPUS, 5000)
    pv = [(view, view.vocabulary(), np.ones(pretrained.DIM)),
          (word, counts.vocabulary, autofeatures.idf_weights(counts.matrix))]
    members = [({"pretrained": rng.normal(size=(pretrained.DIM, 3)),
                 "word": rng.normal(size=(len(counts.vocabulary), 3))}, rng.normal(size=3)) for _ in range(2)]
    out.append(("pretrained, folded", autofeatures.linear_graph(pv, members)))
    out.append(("pretrained, vector table", autofeatures.linear_graph(pv, members, fuse=False)))
    normed = pretrained.PretrainedView(view.table)  # per-text norm (versions before)
    out.append(("pretrained, per-text norm", autofeatures.linear_graph(
        [(normed, normed.vocabulary(), np.ones(pretrained.DIM))], [({"pretrained": members[0][0]["pretrained"]},
                                                                    members[0][1])])))
    # zero-shot's layout: subword pieces, case kept, marks split, cosine to descriptions
    table = pretrained.build_table(["Zorblax"], n_frequent=3000, standardize="cased_punct", capitalized=3000,
                                   pieces=True)
    zs = pretrained.PretrainedView(table, standardize="cased_punct", scale=1.0, l2=True)
    text = keras.Input(shape=(), dtype="string")
    dense = keras.layers.Dense(3, use_bias=False, activation="softmax")
    model = keras.Model(text, dense(zs.layer()(text)))
    dense.kernel.assign(rng.normal(size=(pretrained.DIM, 3)).astype("float32") * 5)
    out.append(("zero-shot pieces", model))
    # bow, on words and on characters (tokenize "char": Chinese)
    labels = ["a", "b", "c"] * 4
    for tokenize in ("word", "char"):
        res = textmodel.train_tiny(CORPUS, labels, tokenize=tokenize, epochs=3)
        out.append((f"bow {tokenize}", res.model))
    return out


@pytest.fixture(scope="module")
def graphs():
    from model_worker import textmodel

    built = []
    for what, model in _graphs():
        spec, arrays = lean.build(model)
        built.append((what, textmodel.make_predict_fn(model), lean.Plan(spec, arrays)))
    return built


def test_every_graph_kind_has_a_plan(graphs):
    assert len(graphs) == 13
    for what, keras_fn, plan in graphs:
        probe = [*CORPUS, *lean.PROBES, ""]
        got, want = plan.predict(probe), keras_fn(probe)
        assert got.shape == want.shape and np.abs(got - want).max() < lean.TOLERANCE, what
        assert plan.predict([]).shape == (0, want.shape[1])
        for step in plan.steps:  # the words keyed by Python's hash: only where the cache serves
            if step["op"] in ("word_logits", "word_mean"):
                assert ("hashed" in plan.data[step["name"]]) == (step["standardize"] == "cased"), what


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(texts_st)
def test_plans_answer_as_the_graphs(graphs, texts):
    for what, keras_fn, plan in graphs:
        got, want = plan.predict(texts), keras_fn(texts)
        assert np.abs(got - want).max() < lean.TOLERANCE, (what, texts)


def test_export_writes_the_plan_only_when_it_agrees(tmp_path, monkeypatch):
    """A graph with a step the engine lacks (cnn) and a plan whose scores
    differ get no lean.npz: the version serves through Keras. A plan that
    agrees is written, and loads back to the same scores."""
    from model_worker import textmodel

    labels = ["a", "b", "c"] * 4
    cnn = textmodel.train_tiny(CORPUS, labels, architecture="cnn", epochs=1, sequence_length=16,
                               embedding_dim=8).model
    got = lean.export(cnn, str(tmp_path), CORPUS, textmodel.make_predict_fn(cnn))
    assert got["engine"] == "keras" and "TextVectorization" in got["reason"]  # its token ids
    assert lean.load(str(tmp_path)) is None
    bow = textmodel.train_tiny(CORPUS, labels, epochs=3).model
    fn = textmodel.make_predict_fn(bow)
    real = lean.Plan.predict
    monkeypatch.setattr(lean.Plan, "predict", lambda self, texts: real(self, texts) + 1e-3)
    got = lean.export(bow, str(tmp_path), CORPUS, fn)
    assert got["engine"] == "keras" and "differ" in got["reason"] and lean.load(str(tmp_path)) is None
    monkeypatch.setattr(lean.Plan, "predict", real)
    got = lean.export(bow, str(tmp_path), CORPUS, fn)
    assert got["engine"] == "lean" and got["bytes"] > 0
    plan = lean.load(str(tmp_path))
    assert plan is not None and np.abs(plan.predict(CORPUS) - fn(CORPUS)).max() < lean.TOLERANCE


def test_export_checks_single_texts_through_the_word_cache(tmp_path, monkeypatch):
    """export also runs texts one at a time, so a word view whose cached
    ids (single texts) differed from the graph's would get no plan; nor
    would a plan that fails on a text (the version serves through Keras)."""
    from model_worker import autofeatures, pretrained, textmodel

    view, _ = pretrained.fit_view(CORPUS, n_frequent=2000)
    rng = np.random.default_rng(5)
    model = autofeatures.linear_graph([(view, view.vocabulary(), np.ones(pretrained.DIM))],
                                      [({"pretrained": rng.normal(size=(pretrained.DIM, 3))}, rng.normal(size=3))])
    fn = textmodel.make_predict_fn(model)
    real = lean.Plan._string_ids
    monkeypatch.setattr(lean.Plan, "_string_ids", lambda self, *a: [1 if i else 0 for i in real(self, *a)])
    got = lean.export(model, str(tmp_path), CORPUS, fn)
    assert got["engine"] == "keras" and "differ" in got["reason"]
    # a plan that fails on a text: no plan either, and the version still trains

    def fails(self, *a):
        raise IndexError("index 4026 is out of bounds")

    monkeypatch.setattr(lean.Plan, "_string_ids", fails)
    got = lean.export(model, str(tmp_path), CORPUS, fn)
    assert got["engine"] == "keras" and "IndexError" in got["reason"] and lean.load(str(tmp_path)) is None
    monkeypatch.setattr(lean.Plan, "_string_ids", real)
    assert lean.export(model, str(tmp_path), CORPUS, fn)["engine"] == "lean"


def test_vocabulary_lookups_find_every_token_and_nothing_else():
    """The hash table against a dict, for batches of every size the lookup
    treats differently: one key, a few (up to Vocab._FEW: windowed probes
    from the first slot), and more than Vocab._FEW (a slot a pass first). A
    table built full enough that probes run past one window."""
    rng = np.random.default_rng(7)
    tokens = sorted({"".join(rng.choice(list("abcdeé是ΣZ_-"), rng.integers(1, 9))) for _ in range(30000)})
    vocab = lean.Vocab.build(tokens, "strings")
    assert vocab._reach() > lean.Vocab._WINDOW  # some probes are longer than a window
    want = {t: i for i, t in enumerate(tokens)}
    absent = [t + "\u2603" for t in tokens[:5000]] + ["", "zz\u00a0"]
    queries = [tokens[i] for i in rng.permutation(len(tokens))] + absent
    keys = lean.string_keys(queries)
    expected = np.array([want.get(q, 0) for q in queries])
    for size in (1, 3, 40, 700, len(queries)):
        got = np.concatenate([vocab.lookup(keys[i:i + size]) for i in range(0, len(queries), size)])
        assert np.array_equal(got, expected), size
    # one key at a time in Python integers (the word cache's misses)
    assert [vocab.find(k) for k in keys.tolist()] == expected.tolist()
    assert lean.python_key("") == lean.string_keys([""])[0] == 1


def test_the_table_keyed_by_pythons_hash_finds_every_word_and_nothing_else():
    """hashed_words: every word's id (word 0 is the table's unknown), none
    for a word it lacks; read in parts (more than one 64 KB part here);
    no table when the count is wrong or two words are the same."""
    words = ["[UNK]", "the", "The", "café", "naïve", "", "x" * 300, "\x00nul", *[f"w{i}é" for i in range(30_000)]]
    blob = np.frombuffer("\n".join(words).encode("utf-8"), dtype=np.uint8)
    assert len(blob) > 3 * 65536
    table = lean.hashed_words(blob, len(words))
    assert table is not None and [table.find(lean.hash_key(w)) for w in words] == list(range(len(words)))
    assert [table.find(lean.hash_key(w)) for w in ("absent", "THE", "w30000é", "w1")] == [0, 0, 0, 0]
    assert lean.hashed_words(blob, len(words) + 1) is None and lean.hashed_words(blob, len(words) - 1) is None
    assert lean.hashed_words(np.frombuffer(b"a\nb\na", dtype=np.uint8), 3) is None


def test_python_splits_on_tensorflows_blanks_where_no_other_space_is():
    """The word cache splits with str.split() unless a text holds one of
    Plan._ODD_SPACES: exactly the characters Python splits on and
    tf.strings.split does not."""
    blanks = {9, 10, 11, 12, 13, 32}
    odd = [cp for cp in range(0x110000) if chr(cp).isspace() and cp not in blanks]
    assert [cp for cp in range(0x110000) if lean.Plan._ODD_SPACES.match(chr(cp))] == odd


def _view_step(graphs, what):
    plan = next(p for w, _, p in graphs if w == what)
    step = next(s for s in plan.steps if s["op"] in ("word_logits", "word_mean"))
    assert step["standardize"] == "cased"  # the cached way's split
    return plan, step, plan.data[step["name"]]


_CACHES: dict = {}


def test_the_rows_of_pieced_words_run_out_and_start_again(graphs, monkeypatch):
    """Words the table lacks in every form get rows of their own
    (Plan._pieced), here with room for 8: a call with more new words than
    the room left forgets every row (and the caches of words) and starts
    again; a call with more new words than the whole room gets room for
    them all, given back at the next call. The scores are the graph's
    throughout, one text at a time (the cache) and in a batch (NumPy)."""
    import random

    plan, step, own = _view_step(graphs, "pretrained, folded")
    keras_fn = next(f for w, f, _ in graphs if w == "pretrained, folded")
    assert "pieced" in own and len(own["piece_names"]) > 1000
    first = own["pieced_from"]
    monkeypatch.setattr(lean.Plan, "PIECED_LEAST", 8)
    monkeypatch.setattr(lean.Plan, "PIECED_BYTES", 8)
    plan._forget_pieced(own)
    assert len(own["table"]) == first + 8 and not own["pieced"] and not own["cache"]
    rng = random.Random(7)

    def invented() -> str:
        return "".join(rng.choice("qxzjvkwb") for _ in range(rng.randint(5, 9))).capitalize()

    def check(texts: list[str]) -> None:
        got, want = plan.predict(texts), keras_fn(texts)
        assert np.abs(got - want).max() < lean.TOLERANCE, texts

    two = [f"the {invented()} striker {invented()} {invented()}" for _ in range(2)]
    for t in two:
        check([t])
    assert len(own["pieced"]) == 6 and own["pieced_end"] == first + 6
    check([two[0]])  # met again: the same rows, nothing new
    assert own["pieced_end"] == first + 6
    third = f"{invented()} {invented()} {invented()} scored"
    check([third])  # 9 rows wanted, 8 there: every row forgotten, then this text's
    assert set(own["pieced"]) == set(third.split()[:3]) and own["pieced_end"] == first + 3
    check(two)  # the first two again, together: more than the room left
    assert len(own["pieced"]) == 6
    batch = [" ".join(invented() for _ in range(7)) for _ in range(3)]
    check(batch)  # 21 new words: room for them and the 6 split before, for this call
    assert len(own["pieced"]) == 21 and len(own["table"]) == first + 6 + 21
    check([two[1]])  # the room given back
    assert len(own["table"]) == first + 8 and len(own["pieced"]) == 3
    # a text whose words were split before (in the cache) and new ones,
    # more than the room: it starts again with room for all of them
    five = " ".join(invented() for _ in range(5))
    check([five])
    assert len(own["pieced"]) == 8 and len(own["table"]) == first + 8
    check([f"{five} {' '.join(invented() for _ in range(5))}"])
    assert len(own["pieced"]) == 10
    check([two[0]])
    assert len(own["table"]) == first + 8
    words = plan.ops.words(batch * 40, "cased")
    assert len(words) > plan._FEW_CACHED  # the NumPy way, its rows the same
    check(batch * 40)
    monkeypatch.undo()
    plan._forget_pieced(own)
    width = own["table"].shape[1]
    assert len(own["table"]) - first == max(plan.PIECED_LEAST, min(plan.CACHE_WORDS // 2, plan.PIECED_BYTES // (4 * width)))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(texts_st, st.sampled_from([(lean.Plan.CACHE_WORDS, lean.Plan._FEW_NEW, True), (16, 1 << 30, True),
                                   (16, 0, True), (16, 1 << 30, False)]))
def test_the_word_cache_gives_the_numpy_ways_ids(graphs, texts, sizes):
    """A pretrained view's words through its cache (Plan._cached_ids) get
    the ids and text rows of the NumPy way (split, keys, lookup, every
    fallback, then the rows of words split into pieces), whether the new
    words are looked up in Python (keyed by Python's hash, or, in a plan
    without the table's words, python_key) or NumPy, with the cache's
    generations turning over (a cache of 16 words) or not; and the cache
    never holds more than CACHE_WORDS words. A word the table lacks in
    every form has a row of its own: its greedy pieces' rows summed."""
    cache_words, few_new, hashed = sizes
    for what in ("pretrained, folded", "pretrained, vector table"):
        plan, step, own = _view_step(graphs, what)
        assert own["hashed"] is not None  # the plan has the table's words
        plan.CACHE_WORDS, plan._FEW_NEW = cache_words, few_new
        # a cache (and rows of pieced words) for each size, kept from example to example
        key = (what, sizes)
        if key not in _CACHES:
            _CACHES[key] = mine = {**own}
            if "pieced" in own:
                mine["table"] = own["table"][:own["pieced_from"]].copy()
                plan._forget_pieced(mine)
            mine["cache"], mine["cache_old"] = {}, {}
        own = _CACHES[key]
        if not hashed:
            own.pop("hashed", None)
        try:
            for batch in (texts, texts[:1], texts):  # the second time: from the cache
                try:
                    got = plan._cached_ids(step, own, batch)
                except lean._Restart:  # the rows of pieced words ran out: as Plan._words does
                    got = plan._cached_ids(step, own, batch)
                words = plan.ops.words(batch, "cased")
                if got is None:  # another whitespace, or a long batch: the NumPy way
                    assert (any(plan._ODD_SPACES.search(t) for t in batch)
                            or len(words) > plan._FEW_CACHED), batch
                    continue
                want = plan._lookup(own["vocab"], words, step["fallback"], step["strip"])
                ids = got[0]
                if "pieced" in own:  # what the NumPy way's unknown words became
                    lost = want == 0
                    pieced = ids[lost]
                    for w, i in zip(words.strings(np.flatnonzero(lost)), pieced):
                        split = greedy_pieces(w, own["piece_names"])
                        assert (i == 0) == (not split), (w, i)
                        if split:
                            assert own["pieced_from"] <= i < own["pieced_end"]
                            np.testing.assert_allclose(
                                own["table"][i], own["piece_table"][split].astype(np.float32).sum(axis=0),
                                rtol=1e-6, atol=1e-6)
                    ids = np.where(lost, 0, ids)
                assert np.array_equal(ids, want), (what, batch)
                assert np.array_equal(got[1], words.text)
                assert len(own["cache"]) + len(own["cache_old"]) <= cache_words
        finally:
            del plan.CACHE_WORDS, plan._FEW_NEW


def test_the_word_cache_answers_as_the_graph(graphs):
    """Known words, words known only lowercased or without their marks, and
    unknown ones, through the cache twice (new, then cached), one text at
    a time: the Keras graph's scores."""
    texts = ["The striker scored twice!", "THE (striker) Scored, twice.", "Zorblax grilled (salmon).",
             "café Café CAFÉ", "  tabs\tand\nnewlines  ", ""]
    for what in ("pretrained, folded", "pretrained, vector table"):
        plan, step, own = _view_step(graphs, what)
        keras_fn = next(f for w, f, _ in graphs if w == what)
        own["cache"].clear()
        own["cache_old"].clear()
        for _ in range(2):
            for t in texts:
                assert plan._cached_ids(step, own, [t]) is not None
                assert np.abs(plan.predict([t]) - keras_fn([t])).max() < lean.TOLERANCE, (what, t)
        assert "Scored," in own["cache"] and own["cache"]["striker"] > 0

    # a long word: the same id, through NumPy when the new words are long,
    # and not kept (a 20,000-character text may be one word)
    plan, step, own = _view_step(graphs, "pretrained, folded")
    long_word = "Striker" * 15
    for text in (f"the {long_word} scored", "x" * 20000, "é" * 20000 + " The"):
        got = plan._cached_ids(step, own, [text])
        words = plan.ops.words([text], "cased")
        assert np.array_equal(got[0], plan._lookup(own["vocab"], words, step["fallback"], step["strip"]))
    assert all(len(w) <= plan.LONGEST_CACHED for w in [*own["cache"], *own["cache_old"]])
    assert "the" in own["cache"] and long_word not in own["cache"]
