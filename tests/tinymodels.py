"""Builds tiny real Keras models into a model store, for tests.

Run as a script in its own process (it imports TensorFlow, which the test
process itself must not):  python -m tests.tinymodels MODELS_DIR

Each model is a genuine end-to-end classifier in the store's format: raw
strings in (character multi-hot vectorization inside the model), softmax out,
with meta.json listing the labels. It is trained for a few steps on a handful
of examples: good enough to give stable, distinguishable answers.
"""
from __future__ import annotations

import os
import sys


EXAMPLES = {
    "pos": ["很好", "非常好用", "喜欢", "great product", "love it", "excellent", "好评"],
    "neg": ["很差", "太差了", "讨厌", "terrible", "hate it", "awful", "差评"],
    "other": ["今天下雨", "the train leaves at noon", "桌子", "numbers 123"],
}


def build(models_dir: str, name: str, labels: list[str], epochs: int = 30) -> int:
    import keras
    import numpy as np

    from state.store import ModelStore

    keras.utils.set_random_seed(len(labels))
    texts = [t for lab in labels for t in EXAMPLES[lab]]
    y = np.array([i for i, lab in enumerate(labels) for _ in EXAMPLES[lab]])
    vec = keras.layers.TextVectorization(max_tokens=400, split="character",
                                         output_mode="multi_hot")
    vec.adapt(texts)
    inp = keras.Input(shape=(), dtype="string")
    out = keras.layers.Dense(len(labels), activation="softmax")(vec(inp))
    model = keras.Model(inp, out)
    model.compile(optimizer=keras.optimizers.Adam(0.05), loss="sparse_categorical_crossentropy")
    model.fit(np.array(texts, dtype=object), y, epochs=epochs, verbose=0)
    store = ModelStore(models_dir)
    store.ensure()
    staged = store.staging_dir()
    model.save(os.path.join(staged, "model.keras"))
    return store.publish(name, staged, {"labels": labels, "params": {"tiny": True}})


def build_lambda(models_dir: str) -> int:
    """A model whose file holds Python code (a Lambda layer): safe mode must refuse it."""
    import keras

    from state.store import ModelStore

    inp = keras.Input(shape=(), dtype="string")
    vec = keras.layers.TextVectorization(max_tokens=50, split="character", output_mode="multi_hot")
    vec.adapt(["ab", "cd"])
    x = keras.layers.Dense(2, activation="softmax")(vec(inp))
    out = keras.layers.Lambda(lambda t: t * 1.0)(x)
    store = ModelStore(models_dir)
    staged = store.staging_dir()
    keras.Model(inp, out).save(os.path.join(staged, "model.keras"))
    return store.publish("lambda", staged, {"labels": ["a", "b"]})


def copy_model(models_dir: str, src: str, name: str, meta_update: dict | None = None,
               drop_meta: bool = False, garbage_model: bool = False) -> None:
    """Copy a version under a new name, optionally breaking it on purpose."""
    import json
    import shutil

    src_dir = os.path.join(models_dir, src)
    dst = os.path.join(models_dir, name, "1")
    shutil.copytree(src_dir, dst)
    meta_path = os.path.join(dst, "meta.json")
    meta = json.load(open(meta_path))
    meta.update(meta_update or {}, name=name, version=1)
    json.dump(meta, open(meta_path, "w"))
    if drop_meta:
        os.unlink(meta_path)
    if garbage_model:
        with open(os.path.join(dst, "model.keras"), "wb") as fh:
            fh.write(os.urandom(2048))


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    root = sys.argv[1]
    build(root, "sent", ["neg", "pos"])            # sent v1
    build(root, "sent", ["neg", "pos"], epochs=10)  # sent v2
    build(root, "topic", ["neg", "other", "pos"])  # topic v1
    build_lambda(root)
    # copies of sent v1 under other names, for fault tests
    for name in ("hangs", "crashy"):
        copy_model(root, "sent/1", name)
    copy_model(root, "sent/1", "corrupt", garbage_model=True)
    copy_model(root, "sent/1", "nolabels", meta_update={"labels": None})
    copy_model(root, "sent/1", "mismatch", meta_update={"labels": ["a", "b", "c"]})
    copy_model(root, "sent/1", "nometa", drop_meta=True)
    print("ok")
