"""Where a forked serving worker's private pages are: the zygote's pages it
wrote to (copied on write) against pages it mapped itself.

    .venv/bin/python -m bench.worker_pages [--engine lean|keras] MODEL_DIR [MODEL_DIR ...]

MODEL_DIR is a version folder of the store (it holds model.keras), e.g.
models/demo/v1; "none": a child that only starts TensorFlow's context and
runs one op (the floor under any model). This process imports what the zygote imports
(model_worker/zygote.py: TensorFlow, Keras, the worker's and the trainer's
code, with the thread pools held at one), collects and freezes the
collector as the zygote does, then forks one child per model. The child
loads the model as a worker does (its lean plan when the folder has one and
--engine is lean, the default; else through Keras in safe mode, the worker's
predict function, one intra-op and one inter-op thread), answers 20 batches of 256
and 200 single texts, gives its freed heap back, and reads its own
/proc/self/smaps: private pages (clean + dirty) by mapping, each marked
"zygote's" when the parent had the same address range before the fork (a
page there is the parent's page copied on write, or a new allocation that
reused free space in it) or "new". [heap] is "new" once the heap grew, as
its range then differs. Prints one JSON object a model.
"""
from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import sys

_POOL_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def _ranges(pid: int) -> set[str]:
    with open(f"/proc/{pid}/maps", encoding="ascii") as fh:
        return {line.split()[0] for line in fh}


def _private_by_mapping(pid: int, parent: set[str]) -> dict[str, float]:
    agg: collections.Counter[str] = collections.Counter()
    cur = "[anon]"
    with open(f"/proc/{pid}/smaps", encoding="utf-8", errors="replace") as fh:
        for line in fh:
            parts = line.split()
            if parts and "-" in parts[0] and not parts[0].endswith(":"):
                name = parts[5] if len(parts) > 5 else "[anon]"
                name = os.path.basename(name) if name.startswith("/") else name
                cur = f"{name} ({'zygote' if parts[0] in parent else 'new'})"
            elif parts and parts[0] in ("Private_Clean:", "Private_Dirty:"):
                agg[cur] += int(parts[1]) / 1024
    return dict(agg)


ENGINE = "lean"  # --engine: what a worker with worker.engine set so does


def _child(model_dir: str, parent: set[str], out: int) -> None:
    import keras

    from model_worker import textmodel, worker

    worker._set_threads({"intra_op_threads": 1, "inter_op_threads": 1})
    if model_dir == "none":  # TensorFlow's context and one op: no model
        import tensorflow as tf

        float(tf.reduce_sum(tf.constant([1.0, 2.0])))
        worker.release_free_memory()
        _report(model_dir, parent, out)
        return
    predict = worker.Worker.lean_predict(model_dir) if ENGINE == "lean" else None
    if predict is None:
        model = keras.saving.load_model(os.path.join(model_dir, "model.keras"), safe_mode=True)
        predict = textmodel.make_predict_fn(model)
    predict(["warm-up 预热"])
    for _ in range(20):
        predict(["a short text to classify 一段短文本"] * 256)
    for _ in range(200):
        predict(["a short text 短文本"])
    worker.release_free_memory()
    _report(model_dir, parent, out)


def _report(model_dir: str, parent: set[str], out: int) -> None:
    pages = _private_by_mapping(os.getpid(), parent)
    by_origin = {"zygote": 0.0, "new": 0.0}
    for name, mb in pages.items():
        by_origin["zygote" if name.endswith("(zygote)") else "new"] += mb
    top = sorted(pages.items(), key=lambda kv: -kv[1])[:10]
    os.write(out, json.dumps({"model": model_dir, "engine": ENGINE, "private_mb": round(sum(pages.values()), 1),
                              "by_origin_mb": {k: round(v, 1) for k, v in by_origin.items()},
                              "top_mb": [(k, round(v, 1)) for k, v in top]}).encode())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("models", nargs="+", help="version folders holding model.keras")
    ap.add_argument("--engine", choices=("lean", "keras"), default="lean",
                    help="lean (the default): a folder with lean.npz is served from it, as workers do")
    args = ap.parse_args(argv)
    global ENGINE
    ENGINE = args.engine
    for v in _POOL_VARS:
        os.environ[v] = "1"
    import keras  # noqa: F401
    import tensorflow  # noqa: F401

    from model_worker import autoselect, lean, textmodel, trainer, worker  # noqa: F401
    from state import store  # noqa: F401

    lean.text_ops()  # as the zygote does

    gc.collect()
    gc.freeze()
    for model_dir in args.models:
        parent = _ranges(os.getpid())
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            try:
                _child(model_dir, parent, w)
            finally:
                os._exit(0)
        os.close(w)
        chunks = []
        while chunk := os.read(r, 65536):
            chunks.append(chunk)
        os.close(r)
        os.waitpid(pid, 0)
        print(b"".join(chunks).decode() or json.dumps({"model": model_dir, "error": "child failed"}))
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
