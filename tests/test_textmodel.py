"""Training parameters, tokenizer detection, and one real train/save/load.

The model test trains a tiny classifier, saves it, and loads it in a fresh
interpreter with safe_mode=True: that is exactly what a serving worker does,
so it proves the artifact needs nothing but `import model_worker.textmodel`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from model_worker.params import (
    DEFAULT_PARAMS,
    ParamError,
    detect_tokenize,
    validate_params,
)

ROOT = Path(__file__).resolve().parent.parent

# --------------------------------------------------------------------------
# Parameters (no TensorFlow needed)
# --------------------------------------------------------------------------

EXPECTED_FIELDS = {
    "architecture", "tokenize", "ngrams", "max_tokens", "sequence_length", "embedding_dim",
    "epochs", "batch_size", "learning_rate", "validation_split", "early_stopping_patience", "seed",
}


def test_defaults_complete_and_valid():
    assert EXPECTED_FIELDS <= DEFAULT_PARAMS.keys()
    assert validate_params(None) == DEFAULT_PARAMS
    assert validate_params({}) == DEFAULT_PARAMS
    merged = validate_params({"epochs": 3, "learning_rate": 1})
    assert merged["epochs"] == 3 and merged["learning_rate"] == 1.0
    assert merged["batch_size"] == DEFAULT_PARAMS["batch_size"]


def test_params_module_does_not_import_tensorflow():
    # The supervisor imports params.py; it must stay TF-free.
    code = "import sys, model_worker.params; print('tensorflow' in sys.modules or 'keras' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("field, value", [
    ("epochs", True),          # bool is not an int
    ("epochs", 2.0),
    ("epochs", "5"),
    ("epochs", 0),
    ("epochs", 10_000),
    ("batch_size", -1),
    ("ngrams", 0),
    ("ngrams", 9),
    ("max_tokens", 10),
    ("sequence_length", None),
    ("embedding_dim", 1),
    ("early_stopping_patience", -1),
    ("seed", -5),
    ("learning_rate", 0),
    ("learning_rate", 2.0),
    ("learning_rate", "0.01"),
    ("learning_rate", False),
    ("validation_split", -0.1),
    ("validation_split", 0.9),
    ("dropout", 1.5),
    ("l2", -0.1),
    ("l2", float("nan")),
    ("architecture", "transformer"),
    ("architecture", 1),
    ("tokenize", "jieba"),
    ("output_mode", "int"),
    ("normalize", 1),
])
def test_bad_values_name_the_field(field, value):
    with pytest.raises(ParamError) as err:
        validate_params({field: value})
    assert err.value.field == field
    assert field in str(err.value)
    assert isinstance(err.value, ValueError)


def test_unknown_field_rejected():
    with pytest.raises(ParamError) as err:
        validate_params({"epoch": 3})
    assert err.value.field == "epoch"
    assert "unknown" in err.value.message and "epochs" in err.value.message


def test_params_must_be_a_dict():
    with pytest.raises(ParamError):
        validate_params([("epochs", 3)])  # type: ignore[arg-type]


def test_detect_tokenize():
    assert detect_tokenize(["这本书写得很好，推荐购买", "质量太差了"]) == "char"
    assert detect_tokenize(["A great book, highly recommended", "Terrible quality"]) == "word"
    # Chinese reviews mentioning Latin product names are still Chinese.
    assert detect_tokenize(["这个iPhone手机很好用，电池也耐用", "Kindle屏幕不错"]) == "char"
    # English text quoting a word of Chinese is still English.
    assert detect_tokenize(["The sign said 你好 and nothing else in the whole room"]) == "word"
    assert detect_tokenize([]) == "word"
    assert detect_tokenize(["12345 !!!"]) == "word"


# --------------------------------------------------------------------------
# One real model: train, save, reload in a fresh process
# --------------------------------------------------------------------------

POS = [
    "这本书写得很好，非常推荐", "质量很好，物流也快", "很喜欢，值得购买", "非常满意，好评",
    "服务很好，下次还来", "好用，性价比高", "包装精美，很好", "内容精彩，喜欢",
    "great product, works perfectly", "i love this book", "excellent quality and fast delivery",
    "highly recommended, very good", "wonderful service, very happy", "good value, love it",
    "amazing, would buy again", "the best purchase this year", "very good 很好", "nice phone 很喜欢",
    "perfect gift, love it", "好评，非常好",
]
NEG = [
    "质量太差了，不推荐", "很失望，浪费钱", "服务差，再也不来", "太差了，差评",
    "物流很慢，包装破损", "不好用，退货", "内容无聊，失望", "很差，后悔购买",
    "terrible product, broke in a day", "i hate this book", "awful quality and slow delivery",
    "not recommended, very bad", "horrible service, very angry", "waste of money, bad",
    "disappointing, would not buy again", "the worst purchase this year", "very bad 太差", "bad phone 差评",
    "broken gift, hate it", "差评，非常差",
]

LOAD_AND_PREDICT = """
import json, sys
import numpy as np
import keras
import model_worker.textmodel as tm
model = keras.saving.load_model(sys.argv[1], safe_mode=True)
texts = json.loads(sys.argv[2])
print(json.dumps(tm.make_predict_fn(model)(texts).tolist()))
"""


def test_train_save_load_in_fresh_process(tmp_path):
    from model_worker import textmodel

    texts = POS + NEG
    labels = ["pos"] * len(POS) + ["neg"] * len(NEG)
    result = textmodel.train_tiny(texts, labels)
    assert result.labels == ["neg", "pos"]
    assert result.history and set(result.history[0]) == {"epoch", "epochs", "loss", "val_loss", "val_accuracy"}
    assert result.metrics["n_train"] + result.metrics["n_val"] == len(texts)
    assert set(result.metrics["per_label"]) == {"neg", "pos"}

    predict = textmodel.make_predict_fn(result.model)
    probs = predict(texts)
    assert probs.shape == (len(texts), 2)
    np.testing.assert_allclose(probs.sum(axis=1), 1.0, atol=1e-5)
    accuracy = np.mean(probs.argmax(axis=1) == np.array([result.labels.index(l) for l in labels]))
    assert accuracy >= 0.9
    # Batch size must not change the answer (one trace serves every size).
    np.testing.assert_allclose(predict(texts[:1]), probs[:1], atol=1e-6)
    assert predict([]).shape == (0, 2)

    path = tmp_path / "model.keras"
    result.model.save(path)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TF_CPP_MIN_LOG_LEVEL": "3"}
    out = subprocess.run([sys.executable, "-c", LOAD_AND_PREDICT, str(path), json.dumps(texts)],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    reloaded = np.array(json.loads(out.stdout.strip().splitlines()[-1]))
    np.testing.assert_allclose(reloaded, probs, atol=1e-6)


def test_cancel_raises(tmp_path):
    from model_worker import textmodel

    with pytest.raises(textmodel.TrainingCancelled):
        textmodel.train_tiny(POS + NEG, ["pos"] * 20 + ["neg"] * 20, epochs=5, should_stop=lambda: True)


# --------------------------------------------------------------------------
# CharNgramCounts: the char views of `auto`, counted by number
# --------------------------------------------------------------------------

CHAR_TEXTS = [
    "Hello, World! 123", "hello world", "iPhone很好用!!", "日本語のテキスト カタカナ", "ééé ñ ü Ǆungla İstanbul ß",
    "tabs\tand\nnewlines\r\nand  double  spaces", "😀 emoji 😀 a-b_c", "x" * 40, "混合 text 与 中文 abc123",
    "a", "I", " ", "", "!!!", " lead and trail ", "\u0301a\u0301 combining", "ab cd ef", "a\x0bb\x0cc",
    "这个 手机 很好 用", "质量 太差 了", "the quick brown fox", "printf(\"%s\\n\", x);", "foo.bar() --help",
]
UNSEEN = ["Unseen words, ÉTÉ été!", "完全 unseen 文本\t新", "  ", "\n", "zzz qqq", "手机\n很好", "%d%%"]


@pytest.mark.parametrize("tokenize", ["word", "char"])
def test_char_ngram_counts_match_training_and_textvectorization(tokenize):
    """Same counts as the training tokens (autofeatures) and as TextVectorization."""
    import keras
    import tensorflow as tf

    from model_worker import autofeatures, textmodel

    views = [v for v in autofeatures.views_for(tokenize).values() if v.split in textmodel.CHAR_SPLIT_WIDTHS]
    assert len(views) >= 1
    for view in views:
        counts = autofeatures.count_matrix(view, CHAR_TEXTS, 100000)
        widths, unigrams = textmodel.CHAR_SPLIT_WIDTHS[view.split]
        layer = textmodel.CharNgramCounts(widths, unigrams, view.standardize, counts.vocabulary)
        assert layer.get_vocabulary() == counts.vocabulary
        got = tf.sparse.to_dense(tf.sparse.reorder(layer(tf.constant(CHAR_TEXTS)))).numpy()
        assert got.shape == (len(CHAR_TEXTS), len(counts.vocabulary) + 1)
        assert not got[:, 0].any()  # out-of-vocabulary n-grams are left out
        np.testing.assert_array_equal(got[:, 1:], counts.matrix.toarray(), err_msg=view.name)
        vec = keras.layers.TextVectorization(
            max_tokens=len(counts.vocabulary) + 1, standardize=textmodel._STANDARDIZERS[view.standardize],
            split=view.split, output_mode="count", sparse=True)
        vec.set_vocabulary(counts.vocabulary)
        probe = tf.constant(UNSEEN + CHAR_TEXTS)
        want = tf.sparse.to_dense(vec(probe)).numpy()
        sparse = layer(probe)
        rows = sparse.indices.numpy()[:, 0]
        assert (np.diff(rows) >= 0).all(), "rows ascend, as documented"
        np.testing.assert_array_equal(tf.sparse.to_dense(tf.sparse.reorder(sparse)).numpy()[:, 1:], want[:, 1:],
                                      err_msg=view.name)
        # what the served graph does with it, with texts that have no known
        # n-gram among the rows (and 50 columns: more than one matmul block)
        linear = textmodel.SparseLinear(50)
        linear.build((None, want.shape[1]))
        rng = np.random.default_rng(0)
        kernel = rng.standard_normal((want.shape[1], 50)).astype("float32")
        kernel[0] = 0.0  # TextVectorization counts OOV n-grams in column 0; the layer leaves them out
        bias = rng.standard_normal(50).astype("float32")
        linear.set_kernel(kernel, bias)
        np.testing.assert_allclose(linear(sparse).numpy(), want @ kernel + bias, rtol=1e-5, atol=1e-4)


def test_sparse_linear_matches_dense_matmul():
    """Any entry order, empty rows (also the last ones), widths on both sides of a block."""
    import tensorflow as tf

    from model_worker import textmodel

    rng = np.random.default_rng(1)
    dense = rng.integers(0, 3, (9, 40)).astype("float32") * (rng.random((9, 40)) < 0.2)
    dense[[0, 4, 7, 8]] = 0.0
    idx = np.argwhere(dense)
    shuffled = idx[rng.permutation(len(idx))]
    sparse = tf.SparseTensor(shuffled, dense[shuffled[:, 0], shuffled[:, 1]], dense.shape)
    for units, use_bias in ((3, True), (24, False), (25, True), (86, True)):
        layer = textmodel.SparseLinear(units, use_bias=use_bias)
        layer.build((None, 40))
        weights = [rng.standard_normal((40, units)).astype("float32")]
        if use_bias:
            weights.append(rng.standard_normal(units).astype("float32"))
        layer.set_kernel(*weights)
        want = dense @ weights[0] + (weights[1] if use_bias else 0.0)
        np.testing.assert_allclose(layer(sparse).numpy(), want, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(layer(tf.constant(dense)).numpy(), want, rtol=1e-5, atol=1e-5)


def test_char_ngram_counts_fall_back_when_characters_do_not_pack():
    from model_worker import textmodel

    many = [chr(0x4E00 + i) + chr(0x4E00 + i + 1) for i in range(0, 5000, 2)]  # 5,000 characters
    assert not textmodel.CharNgramCounts.fits(many, (2, 3, 4, 5))  # 13 bits * 5 > 63
    assert textmodel.CharNgramCounts.fits(many, (2, 3))
    with pytest.raises(ValueError):
        textmodel.CharNgramCounts((2, 3, 4, 5), False, "word", many)
    # the layer relies on no token having a space inside (such windows find no key)
    with pytest.raises(ValueError, match="space inside"):
        textmodel.CharNgramCounts((2, 3), False, "word", [" ab", "a b"])
    # only what tf.strings.split splits on counts as a space (not, say, \x1c)
    assert textmodel.CharNgramCounts((2, 3), False, "lower", [" ab", "a\x1cb"]).vocabulary_size() == 3


# --------------------------------------------------------------------------
# Module layering: no import circle among the training modules
# --------------------------------------------------------------------------

def test_training_modules_import_without_a_circle():
    """autoselect and autofeatures sit on layers/serving, not on textmodel;
    textmodel still re-exports the registered layers (saved models name them)."""
    code = (
        "import sys\n"
        "import model_worker.autoselect\n"
        "assert 'model_worker.textmodel' not in sys.modules, 'autoselect pulled in textmodel'\n"
        "import model_worker.textmodel as tm, model_worker.layers as ly\n"
        "assert tm.SparseLinear is ly.SparseLinear and tm.CharNgramCounts is ly.CharNgramCounts\n"
        "print('ok')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TF_CPP_MIN_LOG_LEVEL": "3"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")


def test_count_matrix_counts_as_one_pass_over_all_texts(monkeypatch):
    """autofeatures.count_matrix counts batch by batch, each batch against
    its own fingerprints then mapped to all batches': the matrix and the
    vocabulary are those of one pass over every token at once (np.unique
    over all fingerprints, document frequencies, ties broken by the
    fingerprint), whatever the batch size, with max_tokens cutting ties."""
    import scipy.sparse as sp
    import tensorflow as tf

    from model_worker import autofeatures

    texts = [*CHAR_TEXTS, *(f"ticket {i} about printer {i % 7} and driver {i % 3}" for i in range(40))]
    for view in autofeatures.views_for("word").values():
        ragged = view.tokens(tf.constant(texts))
        flat = ragged.flat_values.numpy()
        h = tf.strings.to_hash_bucket_fast(ragged.flat_values, autofeatures._HASH_BUCKETS).numpy()
        uniq, first, col = np.unique(h, return_index=True, return_inverse=True)
        full = sp.csr_matrix((np.ones(len(h)), (ragged.value_rowids().numpy(), col)), shape=(len(texts), len(uniq)))
        df = np.asarray((full > 0).sum(axis=0)).ravel()
        for max_tokens in (len(uniq), 25):
            keep = np.sort(np.lexsort((uniq, -df))[:max_tokens])
            want_vocab = [s.decode("utf-8") for s in flat[first][keep]]
            for batch in (1000, 7, 1):
                monkeypatch.setattr(autofeatures, "_BATCH", batch)
                got = autofeatures.count_matrix(view, texts, max_tokens)
                assert got.vocabulary == want_vocab, (view.name, batch)
                np.testing.assert_array_equal(got.matrix.toarray(), full[:, keep].toarray())
                assert got.matrix.has_sorted_indices
