"""The training process: one per /train job, forked from the zygote (or
spawned when it is off) by the supervisor's job manager.

It reads the job's checked data (written by the supervisor as JSONL), trains
with model_worker.textmodel, reports each epoch over its connection, then
publishes the model: save into a staging folder, load it back in safe mode
and compare outputs (an artifact that does not reload is never published),
then ModelStore.publish renames it into <name>/<version>/ atomically.

Frames sent: progress {epoch, epochs, loss, val_loss, val_accuracy, ...}
(bow, cnn) or {phase: "search", candidate, of, name, score, best, best_score}
(auto), done {version, metrics, labels}, failed {message}. Each version also
gets `saved_model/`, a TensorFlow SavedModel export that loads without this
project (textmodel.export_saved_model). It runs at a lower CPU
priority with capped threads so that serving keeps its share of the CPU.
Exit codes: 0 done, 1 failed (reason sent first), 3 TensorFlow import failed.
"""
from __future__ import annotations

import json
import logging
import os
import platform
import shutil
import socket
import sys
import time
import traceback
from typing import Any

from model_worker import protocol

log = logging.getLogger("textswap.trainer")

# what a version holding a pretrained word table carries (from the project's
# root): the Llama 2 attribution notice, the licence agreement and the
# acceptable use policy it incorporates
LLAMA_FILES = ("NOTICE", "LICENSES/LLAMA2-COMMUNITY-LICENSE.txt",
               "LICENSES/LLAMA2-ACCEPTABLE-USE-POLICY.md")


def _limit_resources(spec: dict[str, Any]) -> None:
    nice = int(spec.get("nice", 10))
    if nice:
        os.nice(nice)
    if spec.get("idle_priority") and hasattr(os, "SCHED_IDLE"):
        # every thread there is now; threads started later inherit the policy
        for tid in os.listdir("/proc/self/task"):
            try:
                os.sched_setscheduler(int(tid), os.SCHED_IDLE, os.sched_param(0))
            except OSError as exc:
                logging.warning("SCHED_IDLE not set for thread %s: %s", tid, exc)
    threads = int(spec.get("threads", 1))
    # auto's cross-validation fits this many folds at once, one process each
    # (model_worker/foldpool.py; 0: one per CPU)
    from model_worker import foldpool

    foldpool.set_processes(threads)
    if threads:
        for var in ("OMP_NUM_THREADS", "TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS"):
            os.environ[var] = str(threads)
        if "numpy" in sys.modules:
            # forked from the zygote: BLAS and OpenMP are loaded and read their
            # variables already, so cap their pools directly
            try:
                from threadpoolctl import threadpool_limits

                threadpool_limits(threads)
            except Exception as exc:
                logging.warning("BLAS/OpenMP threads not capped: %s", exc)


def _redirect_output(path: str) -> None:
    """Send this process's stdout/stderr (TensorFlow's too) to the job log."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _read_jsonl(path: str) -> tuple[list[str], list[Any]]:
    """Texts and their labels (multi-label data: a list of labels per text)."""
    texts, labels = [], []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            row = json.loads(line)
            texts.append(row["text"])
            labels.append(row["labels"] if "labels" in row else row["label"])
    return texts, labels


def run(sock: socket.socket, spec: dict[str, Any]) -> None:
    import keras
    import numpy as np
    import tensorflow as tf

    from model_worker import lean, profile, textmodel
    from model_worker.worker import quiet_absl
    from state.store import ModelStore

    quiet_absl(spec.get("log_level", "INFO"))

    threads = int(spec.get("threads", 1))
    if threads:
        tf.config.threading.set_intra_op_parallelism_threads(threads)
        tf.config.threading.set_inter_op_parallelism_threads(threads)

    def on_epoch(info: dict[str, Any]) -> None:
        protocol.write_frame(sock, {"t": "progress", **{
            k: (float(v) if isinstance(v, (np.floating, float)) else v)
            for k, v in info.items()}})

    texts, labels = _read_jsonl(spec["data_file"])
    log.info("job %s: training %s on %d examples", spec["job_id"], spec["name"], len(texts))
    if spec["params"].get("architecture") == "auto":
        # then one frame per candidate: {candidate, of, name, score, best, best_score}
        protocol.write_frame(sock, {"t": "progress", "phase": "search"})
    elif spec["params"].get("architecture") == "zero_shot":  # embeds the descriptions
        protocol.write_frame(sock, {"t": "progress", "phase": "zero_shot"})
    else:
        protocol.write_frame(sock, {"t": "progress", "phase": "training", "epoch": 0,
                                    "epochs": spec["params"]["epochs"]})
    t0 = time.monotonic()
    if spec["params"].get("architecture") == "zero_shot":  # texts: one description per label
        from model_worker import zeroshot

        result = zeroshot.train(texts, labels, spec["params"])
    else:
        result = textmodel.train_model(texts, labels, spec["params"], on_epoch=on_epoch)
    train_s = time.monotonic() - t0
    protocol.write_frame(sock, {"t": "progress", "phase": "publishing"})

    store = ModelStore(spec["models_dir"])
    staged = store.staging_dir()
    try:
        path = os.path.join(staged, "model.keras")
        result.model.save(path)
        # the artifact must load in safe mode and give the same answers
        probe = texts[:16]
        again = keras.saving.load_model(path, safe_mode=True)
        a = textmodel.make_predict_fn(result.model)(probe)
        served = textmodel.make_predict_fn(again)
        b = served(probe)
        if not np.allclose(a, b, atol=1e-5):
            raise RuntimeError("saved model does not reproduce the trained model's outputs")
        # the lean plan (lean.npz): what workers answer from, without
        # TensorFlow; written only when it gives the saved model's scores
        t_lean = time.monotonic()
        lean_report = lean.export(again, staged, texts, served)
        lean_report["seconds"] = round(time.monotonic() - t_lean, 3)
        if lean_report["engine"] != "lean":
            log.warning("job %s: no lean plan (%s); workers serve it through Keras",
                        spec["job_id"], lean_report["reason"])
        # a model holding a pretrained word table carries the Llama 2 notice
        # (NOTICE) and a copy of the licence agreement and its acceptable use
        # policy (LICENSES/): whoever passes the version on passes them on
        from model_worker.layers import PretrainedEmbedding, PretrainedLogits

        if any(isinstance(lay, (PretrainedEmbedding, PretrainedLogits)) for lay in result.model.layers):
            root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
            for name in LLAMA_FILES:
                shutil.copyfile(os.path.join(root, name),
                                os.path.join(staged, os.path.basename(name)))
        # the portable copy: a SavedModel that needs no project code to load
        t_export = time.monotonic()
        textmodel.export_saved_model(result.model, os.path.join(staged, textmodel.SAVED_MODEL_DIR),
                                     probe, a)
        export_s = time.monotonic() - t_export
        meta = {
            "labels": result.labels,
            "params": spec["params"],
            "data": spec["data_summary"],
            "metrics": result.metrics,
            "history": result.history,
            "train_seconds": round(train_s, 3),
            "export_seconds": round(export_s, 3),
            "serving": lean_report,
            "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "job_id": spec["job_id"],
            "versions": {"python": platform.python_version(), "keras": keras.__version__,
                         "tensorflow": tf.__version__, "numpy": np.__version__},
        }
        if result.report is not None:
            meta["report"] = result.report
        if result.warnings:
            meta["warnings"] = result.warnings
        profile_labels = labels
        if result.metrics.get("multi_label"):  # answered by frontend/predictions.py
            meta.update(multi_label=True, thresholds=result.report["thresholds"],  # type: ignore[index]  # set by auto
                        min_labels=result.report["min_labels"])  # type: ignore[index]  # set by auto
            rows = [int(i) for i in (result.held_out_rows if result.held_out_rows is not None
                                     else range(len(labels)))]
            assert result.held_out_probs is not None  # set by auto
            top = dict(zip(rows, textmodel.top_true_labels([labels[i] for i in rows], result.labels,
                                                           result.held_out_probs)))
            # a text no fold tested (it holds a single-example label): its first label
            profile_labels = [top.get(i, labs[0]) for i, labs in enumerate(labels)]
        # what drift detection compares live traffic with (control/quality.py)
        profile.write(staged, texts, profile_labels, result.labels, result.held_out_probs,
                      result.held_out_on)
        version = store.publish(spec["name"], staged, meta)
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    protocol.write_frame(sock, {"t": "done", "version": version, "metrics": result.metrics,
                                "labels": result.labels, "train_seconds": train_s,
                                "warnings": result.warnings})


def main(sock: socket.socket, spec: dict[str, Any],
         stderr: socket.socket | None = None) -> None:
    """Process entry point (forked from the zygote, or spawned). Its output
    goes to the job's log, not to `stderr` (the supervisor's relay)."""
    from model_worker.worker import die_with_parent, quiet_tensorflow

    if stderr is not None:
        stderr.close()

    # a trainer must not publish for a supervisor that is gone
    die_with_parent(spec.get("parent_pid"))
    _redirect_output(spec["log_file"])
    logging.basicConfig(level="INFO",
                        format="%(asctime)s %(levelname)s [trainer %(process)d] %(message)s")
    quiet_tensorflow(spec.get("log_level", "INFO"))  # forked: the zygote did
    _limit_resources(spec)
    code = 0
    try:
        run(sock, spec)
    except Exception as exc:
        traceback.print_exc()
        try:
            protocol.write_frame(sock, {"t": "failed",
                                        "message": f"{type(exc).__name__}: {exc}"})
        except OSError:
            pass
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip TensorFlow's slow interpreter shutdown
