"""The serving worker: one OS process per applied model.

Forked from the zygote (model_worker/zygote.py), which has TensorFlow
imported already, or spawned as a fresh interpreter when the zygote is off;
either way it sets itself up (priority, TensorFlow threads), says ``booted``
and waits. A process in that state is a standby: applying a model only has
to load it. On ``load`` it loads the model (Keras safe mode), runs one warm-up
prediction and says ``ready``; from then on it answers ``predict`` frames.

Threads: a reader thread turns frames into a queue; the main thread owns the
model and the socket's write side. Micro-batching: whenever the model is free
the main thread takes everything waiting (up to max_batch texts) and runs one
model call, then answers each request id. No fixed batching window by default:
running as soon as the model is free is faster for single requests and no
slower under load (measured, see README).

Exit codes are a contract with the supervisor (see EXIT_*).
"""
from __future__ import annotations

import json
import logging
import os
import queue
import socket
import sys
import threading
import time
from typing import Any, Callable

from model_worker import protocol

EXIT_OK = 0
EXIT_BOOT = 3      # TensorFlow could not be imported / set up
EXIT_LOAD = 4      # the model could not be loaded or warmed up
EXIT_PROTOCOL = 5  # garbage on the pipe from the supervisor

log = logging.getLogger("textswap.worker")

_EOF = object()


def _reader(sock: socket.socket, q: "queue.Queue[Any]") -> None:
    """Frames from the supervisor into the queue; big reads, incremental decode."""
    decoder = protocol.FrameDecoder()
    try:
        while True:
            data = sock.recv(1 << 18)
            if not data:
                if decoder.pending:
                    raise protocol.TruncatedFrame(
                        f"connection closed inside a frame ({decoder.pending} bytes)")
                q.put(_EOF)
                return
            for msg in decoder.feed(data):
                q.put(msg)
    except (protocol.ProtocolError, OSError) as exc:
        q.put(exc)


def restore_priority(nice: int) -> bool:
    """Set every thread of this process back to `nice` (Linux nice is per thread)."""
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    try:
        for tid in tids:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
    except OSError:
        return False
    return True


def die_with_parent(parent_pid: int | None) -> None:
    """Ask Linux to SIGKILL this process when the supervisor dies.

    A supervisor killed with -9 cannot stop its children; without this a
    trainer would go on and publish, and a worker would hold its memory.
    """
    try:
        import ctypes
        import signal

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return  # not Linux: the pipe EOF still ends a worker
    if parent_pid and os.getppid() != parent_pid:  # it died before prctl took effect
        os._exit(EXIT_OK)


def tf_log_level(log_level: str) -> str:
    """TF_CPP_MIN_LOG_LEVEL for the service's log level: TensorFlow's C++ logs
    (and absl's) only with --log-level debug, else none of them (3)."""
    return "0" if str(log_level).upper() == "DEBUG" else "3"


def quiet_tensorflow(log_level: str) -> None:
    """Before TensorFlow is imported: its C++ logging reads this once.
    A value set in the service's environment wins."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", tf_log_level(log_level))


def adopt_stderr(stderr: socket.socket | None) -> None:
    """Make `stderr`, the supervisor's relay (control/childlog.py), this
    process's fd 2, before TensorFlow is imported: TensorFlow's C++ lines that
    no log level silences go to the supervisor's debug log from there. Children
    forked later inherit it."""
    if stderr is None:
        return
    sys.stderr.flush()
    os.dup2(stderr.fileno(), 2)
    stderr.close()


def quiet_absl(log_level: str) -> None:
    """After the import: TensorFlow's Python-side logs (absl, `tensorflow`)."""
    debug = str(log_level).upper() == "DEBUG"
    logging.getLogger("tensorflow").setLevel(logging.DEBUG if debug else logging.ERROR)
    try:
        from absl import logging as absl_logging

        absl_logging.set_verbosity(absl_logging.DEBUG if debug else absl_logging.ERROR)
    except ImportError:
        pass


def fault(point: str, model: str = "", sock: socket.socket | None = None) -> bool:
    """Test-only fault injection; does nothing unless TEXTSWAP_TEST_FAULT is set.

    The crash-loop, hang and garbage-frame tests need a model that kills or
    hangs its process; a real Keras model loaded in safe mode cannot, so the
    tests set ``TEXTSWAP_TEST_FAULT=point:action:model[:once_file]`` (point:
    load|predict; action: crash|hang|garbage|error|slow (1 s more per
    call: the latency rollback test); model: a name, or
    name@version for one version; with once_file, it fires once; several
    specs are separated by commas). True when an "error" fault fires: the
    caller then fails the request as a model error would.
    """
    for spec in os.environ.get("TEXTSWAP_TEST_FAULT", "").split(","):
        want, action, target, once = (spec.split(":") + ["", "", "", ""])[:4]
        if want != point or (target and target not in (model, model.split("@")[0])):
            continue
        if once:
            try:
                os.close(os.open(once, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                continue
        if action == "error":
            return True
        _do_fault(action, sock)
    return False


def _do_fault(action: str, sock: socket.socket | None) -> None:
    if action == "crash":
        os._exit(70)
    if action == "slow":
        time.sleep(1.0)
    if action == "hang":
        while True:
            time.sleep(3600)
    if action == "garbage" and sock is not None:
        sock.sendall(b"\x00\x00\x00\x05\xc1\xc1\xc1\xc1\xc1")


class Worker:
    def __init__(self, sock: socket.socket, options: dict[str, Any]) -> None:
        self.sock = sock
        self.options = options
        self.max_batch = int(options.get("max_batch", 256))
        self.batch_wait = float(options.get("batch_wait_ms", 0.0)) / 1000.0
        self.queue: "queue.Queue[Any]" = queue.Queue()
        self.predict_fn: Callable[[list[str]], Any] | None = None
        self.labels: list[str] = []
        self.model_name = ""
        self.model_version: Any = None
        self.restore_nice: int | None = None  # priority to return to when serving
        self.grown, self.trimmed = False, 0.0  # a large call since the last trim; when that was
        self._explainer: tuple[Any, Any] | None = None  # (the predict function, its Explainer)

    def send(self, msg: dict[str, Any]) -> None:
        protocol.write_frame(self.sock, msg)

    def restore_priority(self) -> None:
        """Leave the standby's low priority (booted and preloaded at nice +10)."""
        if self.restore_nice is not None:
            if not restore_priority(self.restore_nice):
                log.warning("cannot restore CPU priority; serving niced")
            self.restore_nice = None

    # -- load ----------------------------------------------------------------
    def load(self, msg: dict[str, Any]) -> None:
        import keras

        # also registers the project's text layers before a model names them
        from model_worker import textmodel

        if not msg.get("preload"):
            self.restore_priority()  # an apply waits for this load: full speed
        if self.predict_fn is not None:
            # a standby that preloaded a guess gets another model: drop the
            # guess first (one extra load per process, bounded by the supervisor)
            import gc

            # Keras holds a model: the guess's own, or one an explanation loaded
            was_keras = not getattr(self.predict_fn, "lean", False) or self._explainer is not None
            self.predict_fn = None
            self._explainer = None
            if was_keras:
                keras.backend.clear_session()
            gc.collect()
        t0 = time.monotonic()
        path = msg["path"]
        with open(os.path.join(path, "meta.json"), encoding="utf-8") as fh:
            meta = json.load(fh)
        labels = meta.get("labels")
        if not isinstance(labels, list) or len(labels) < 2 or not all(
                isinstance(x, str) for x in labels):
            raise ValueError("meta.json has no valid 'labels' list (two or more strings)")
        fault("load", f"{msg.get('name')}@{msg.get('version')}")
        predict_fn = self.lean_predict(path) if self.options.get("engine", "lean") == "lean" else None
        if predict_fn is None:
            model = keras.saving.load_model(os.path.join(path, "model.keras"), safe_mode=True)
            predict_fn = textmodel.make_predict_fn(model)
        t1 = time.monotonic()
        scores = predict_fn(["warm-up 预热"])
        if scores.shape != (1, len(labels)):
            raise ValueError(f"model outputs shape {tuple(scores.shape)} for one text, "
                             f"but meta.json lists {len(labels)} labels")
        t2 = time.monotonic()
        release_free_memory()  # the load's freed buffers: the model's memory is what it keeps
        self.predict_fn, self.labels = predict_fn, labels
        self.model_name = str(msg.get("name"))
        self.model_version = msg.get("version")
        self.send({"t": "ready", "labels": labels, "load_s": t1 - t0, "warm_s": t2 - t1,
                   "pid": os.getpid(), "engine": "lean" if getattr(predict_fn, "lean", False) else "keras"})

    @staticmethod
    def lean_predict(path: str) -> Callable[[list[str]], Any] | None:
        """The version's lean plan as a predict function (model_worker/lean.py),
        or None when it has none. Explanations load the Keras model from
        `path` when first asked (Worker.explain)."""
        from model_worker import lean

        try:
            plan = lean.load(path)
        except Exception as exc:  # a damaged plan: model.keras still serves
            log.warning("lean plan of %s unreadable (%s: %s); serving through Keras",
                        path, type(exc).__name__, exc)
            return None
        if plan is None:
            return None

        def predict(texts: list[str]) -> Any:
            return plan.predict(texts)

        predict.lean = True  # type: ignore[attr-defined]
        predict.path = path  # type: ignore[attr-defined]
        return predict

    # -- serving ---------------------------------------------------------------
    def _gather(self, first: dict[str, Any]) -> tuple[list[dict[str, Any]], list[Any]]:
        """The first request plus whatever else waits, up to max_batch texts."""
        batch = [first]
        others: list[Any] = []
        n = len(first["texts"])
        deadline = time.monotonic() + self.batch_wait
        while n < self.max_batch:
            try:
                timeout = deadline - time.monotonic()
                msg = self.queue.get_nowait() if timeout <= 0 else self.queue.get(timeout=timeout)
            except queue.Empty:
                break
            if isinstance(msg, dict) and msg.get("t") == "predict" and isinstance(
                    msg.get("texts"), list):
                batch.append(msg)
                n += len(msg["texts"])
            else:
                others.append(msg)  # control frames keep their order after the batch
                break
        return batch, others

    def predict(self, batch: list[dict[str, Any]]) -> None:
        import numpy as np  # here, not at the top: the supervisor imports this module

        assert self.predict_fn is not None
        if any(req.get("x") for req in batch):  # explanations asked: those apart
            for req in batch:
                if req.get("x"):
                    self.explain(req)
            batch = [req for req in batch if not req.get("x")]
            if not batch:
                return
        texts: list[str] = []
        for req in batch:
            texts.extend(req["texts"])
        self.grown = self.grown or len(texts) >= TRIM_AFTER_TEXTS
        failing = fault("predict", f"{self.model_name}@{self.model_version}", self.sock)
        try:
            if failing:
                raise RuntimeError("test fault: this model version fails every request")
            rows = []
            in_model = 0.0
            for i in range(0, len(texts), self.max_batch):
                t0 = time.perf_counter()
                scores = self.predict_fn(texts[i:i + self.max_batch])
                in_model += time.perf_counter() - t0
                # 6 digits say all a probability needs, and keep frames and JSON short
                rows.extend(np.round(scores.astype(np.float64), 6).tolist())
        except Exception as exc:  # a bad batch must not kill the worker
            if len(batch) > 1:  # isolate the request that broke it
                for req in batch:
                    self.predict([req])
                return
            self.send({"t": "error", "id": batch[0]["id"], "code": "predict_failed",
                       "message": f"{type(exc).__name__}: {exc}"})
            return
        frames, pos = [], 0
        for req in batch:
            n = len(req["texts"])
            msg = {"t": "result", "id": req["id"], "scores": rows[pos:pos + n]}
            if not pos:  # the batch's figures ride on its first frame (metrics)
                msg["bn"], msg["bs"] = len(texts), in_model
            frames.append(protocol.encode(msg))
            pos += n
        self.sock.sendall(b"".join(frames))  # one write for the whole batch

    def explain(self, req: dict[str, Any]) -> None:
        """A request with "x": k: scores plus each text's k strongest n-grams
        (model_worker/explain.py), answered as {"scores", "explain"}."""
        import numpy as np

        from model_worker import explain

        try:
            k = req["x"]
            if isinstance(k, bool) or not isinstance(k, int) or k < 0:
                raise ValueError("'x' must be a non-negative integer")
            cached = self._explainer
            if cached is None or cached[0] is not self.predict_fn:  # built once per model
                model = getattr(self.predict_fn, "model", None)
                if getattr(self.predict_fn, "lean", False):
                    # the lean engine serves without Keras: the first explanation loads the model
                    import keras

                    from model_worker import textmodel  # noqa: F401  (registers the layers)

                    path = getattr(self.predict_fn, "path")
                    model = keras.saving.load_model(os.path.join(path, "model.keras"), safe_mode=True)
                self._explainer = cached = (self.predict_fn, explain.explainer_for(model))
            t0 = time.perf_counter()
            serve = self.predict_fn
            if serve is not None and getattr(serve, "lean", False):
                # the scores are the served ones (the lean plan's; the Keras
                # graph's differ in the last float digits), and the label
                # explained is their top one: asking for an explanation never
                # changes the prediction
                probs = np.asarray(serve(req["texts"]))
                _, explained = cached[1](req["texts"], k, probs.argmax(axis=1))
            else:
                probs, explained = cached[1](req["texts"], k)
            took = time.perf_counter() - t0
        except explain.CannotExplain as exc:
            self.send({"t": "error", "id": req["id"], "code": "cannot_explain", "message": str(exc)})
            return
        except Exception as exc:  # a bad request must not kill the worker
            self.send({"t": "error", "id": req["id"], "code": "predict_failed",
                       "message": f"{type(exc).__name__}: {exc}"})
            return
        for e in explained:
            e["label"] = self.labels[e.pop("label_index")]
        rows = np.round(probs.astype(np.float64), 6).tolist()
        self.send({"t": "result", "id": req["id"], "scores": {"scores": rows, "explain": explained},
                   "bn": len(req["texts"]), "bs": took})

    def handle(self, msg: Any) -> bool:
        """Handle one control frame; False means exit."""
        if msg is _EOF:
            return False
        if isinstance(msg, Exception):
            log.error("bad frame from supervisor: %s", msg)
            os._exit(EXIT_PROTOCOL)
        kind = msg.get("t")
        if kind == "predict":
            if self.predict_fn is None:
                self.send({"t": "error", "id": msg.get("id"), "code": "not_loaded",
                           "message": "no model loaded"})
            elif not isinstance(msg.get("texts"), list) or not all(
                    isinstance(x, str) for x in msg["texts"]):
                self.send({"t": "error", "id": msg.get("id"), "code": "bad_request",
                           "message": "texts must be a list of strings"})
            else:
                batch, others = self._gather(msg)
                self.predict(batch)
                return all(self.handle(m) for m in others)
        elif kind == "load":
            try:
                self.load(msg)
            except Exception as exc:
                self.send({"t": "error", "code": "load_failed",
                           "message": f"{type(exc).__name__}: {exc}"})
                log.error("model load failed: %s", exc)
                os._exit(EXIT_LOAD)
        elif kind == "serve":
            self.restore_priority()
        elif kind == "ping":
            self.send({"t": "pong", "id": msg.get("id")})
        elif kind == "stop":
            return False
        else:
            self.send({"t": "error", "id": msg.get("id"), "code": "unknown_type",
                       "message": f"unknown frame type {kind!r}"})
        return True

    def start_reader(self) -> None:
        threading.Thread(target=_reader, args=(self.sock, self.queue), daemon=True,
                         name="frame-reader").start()

    def run(self) -> None:
        while self.handle(self.queue.get()):
            if self.grown and self.queue.empty() and time.monotonic() - self.trimmed >= TRIM_EVERY_S:
                # idle after a large call: its scratch pages go back (rate-bounded,
                # so that a steady batch load does not pay for them again and again)
                release_free_memory()
                self.grown, self.trimmed = False, time.monotonic()


def _malloc_trim() -> Callable[[], Any] | None:
    try:
        import ctypes

        trim = ctypes.CDLL(None).malloc_trim  # glibc; other C libraries: nothing to do
    except (OSError, AttributeError):
        return None
    return lambda: trim(0)


_TRIM = _malloc_trim()

# glibc mallopt parameters
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 64 << 20


def fix_malloc_thresholds() -> bool:
    """Fix glibc's mmap and trim thresholds at the values it reaches by
    itself once a process has freed large blocks: blocks up to 32 MB from
    the heap, and the heap's top kept up to 64 MB (release_free_memory
    gives it back when the worker is idle).

    Left dynamic, they depend on which blocks a process happened to free
    while it loaded its model: a load that frees a block of a megabyte
    sets them low, and then every batch's scratch arrays (megabytes) are
    fresh pages, faulted in and zeroed, and given back at the end of
    the call. That cost a quarter of a lean plan's batch throughput,
    measured (bench/pretrained_cost.py, from one load step to another).
    Fixed, every worker runs its batches the same way. False where the C
    library is not glibc (nothing done)."""
    try:
        import ctypes

        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))


# Trim after a call that held at least this many texts, when the worker is
# idle, at most once this many seconds.
TRIM_AFTER_TEXTS = 64
TRIM_EVERY_S = 30.0


def release_free_memory() -> float:
    """Give the C heap's free pages back to the system (glibc malloc_trim).

    Loading a model reads its weights into buffers that are copied into the
    variables and freed, and a large batch leaves its scratch tensors freed;
    glibc keeps such pages in the process, where they count in its USS and
    PSS for as long as it lives: about twice a word table's size, measured
    (bench/pretrained_cost.py). About 1 ms with a model loaded. Returns the
    seconds it took."""
    t0 = time.perf_counter()
    if _TRIM is not None:
        _TRIM()
    return time.perf_counter() - t0


def _set_threads(options: dict[str, Any]) -> None:
    import tensorflow as tf

    intra = int(options.get("intra_op_threads") or 0)
    inter = int(options.get("inter_op_threads") or 0)
    if intra:
        tf.config.threading.set_intra_op_parallelism_threads(intra)
    if inter:
        tf.config.threading.set_inter_op_parallelism_threads(inter)


def main(sock: socket.socket, options: dict[str, Any],
         stderr: socket.socket | None = None) -> None:
    """Process entry point (forked from the zygote, or spawned with `stderr`,
    the supervisor's relay of its stderr)."""
    adopt_stderr(stderr)
    fix_malloc_thresholds()  # before the load: its frees must not decide them
    logging.basicConfig(level=options.get("log_level", "INFO"),
                        format="%(asctime)s %(levelname)s [worker %(process)d] %(message)s")
    quiet_tensorflow(options.get("log_level", "INFO"))  # forked: the zygote did
    die_with_parent(options.get("parent_pid"))
    base_nice = os.getpriority(os.PRIO_PROCESS, 0)
    nice = int(options.get("boot_nice", 0))
    if nice:  # a standby imports TensorFlow without slowing the serving worker
        os.nice(nice)
    try:
        import keras  # noqa: F401  (spawned: the expensive part of a worker's start)
        quiet_absl(options.get("log_level", "INFO"))
        _set_threads(options)
    except Exception as exc:
        log.error("TensorFlow import failed: %s", exc)
        os._exit(EXIT_BOOT)
    worker = Worker(sock, options)
    try:
        worker.send({"t": "booted", "pid": os.getpid()})
        worker.start_reader()
        if nice:
            # raised back to base_nice when it is given a model to serve
            # (that needs the right to raise priority, which root has)
            worker.restore_nice = base_nice
        worker.run()
    except (BrokenPipeError, ConnectionResetError):
        pass  # the supervisor went away: nothing left to answer
    sys.stdout.flush()
    sys.stderr.flush()
    # skip TensorFlow's slow interpreter shutdown: nothing is left to save
    os._exit(EXIT_OK)
