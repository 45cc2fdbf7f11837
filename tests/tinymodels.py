"""Builds tiny real Keras models into a model store, for tests.

Run as a script in its own process (it imports TensorFlow, which the test
process itself must not):  python tests/tinymodels.py MODELS_DIR

Each model is a genuine end-to-end classifier in the store's format: raw
strings in (character multi-hot vectorization inside the model), softmax out,
with meta.json listing the labels. It is trained for a few steps on a handful
of examples: good enough to give stable, distinguishable answers.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

EXAMPLES = {
    "pos": ["很好", "非常好用", "喜欢", "great product", "love it", "excellent", "好评"],
    "neg": ["很差", "太差了", "讨厌", "terrible", "hate it", "awful", "差评"],
    "other": ["今天下雨", "the train leaves at noon", "桌子", "numbers 123"],
}


def build(models_dir: str, name: str, labels: list[str], epochs: int = 30) -> int:
    import keras
    import numpy as np

    from store import ModelStore

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


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    root = sys.argv[1]
    build(root, "sent", ["neg", "pos"])            # sent v1
    build(root, "sent", ["neg", "pos"], epochs=10)  # sent v2
    build(root, "topic", ["neg", "other", "pos"])  # topic v1
    print("ok")
