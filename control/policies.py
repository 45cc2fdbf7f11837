"""Per-model retrain policies and the retraining that folds feedback in (docs/loop.md).

``Policies``:

    get(name) -> dict | None        the model's policy: config ``policies.<name>``
                                    overlaid by what PUT /models/<name>/policy stored
    put(name, policy) -> dict       validated (PolicyError, a 400), written atomically to
                                    ``<models_dir>/.policies.json`` before it takes effect;
                                    blocking: call it from an executor
    delete(name)                    the same, removing the stored policy

Keys: ``retrain_after_labels`` (int >= 1, or null: off), ``apply`` ("gate",
"canary", "swap" or "none"), ``min_score`` (a default abstain threshold for
/predict, in (0, 1]), ``holdout`` (the share of feedback held back as the
gate's golden set, default 0.2).

What a model's last training used (its data source and parameters), the
moment its feedback was last folded in (the watermark new labels are counted
from) and the feedback hold-out live in ``<models_dir>/.loop/<name>.json``.

The retrain loop: after each committed POST /feedback the handler calls
``labels_arrived(name)``; when the policy's number of labels has arrived since
the last training, a job starts with the feedback folded in (a hold-out share
kept out of it), and its result is applied as the policy says: "gate" (an
apply through the quality gate, the hold-out beside any registered golden
set), "canary", "swap" (no gate) or "none" (published only). The history
records the cause ("retrain after 200 labels") and the outcome.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import threading
import time
from typing import TYPE_CHECKING, Awaitable, Callable, Literal, TypedDict

from tornado.ioloop import IOLoop

from state.config import ConfigError
from state.dataset import is_label_set
from state.store import check_name

if TYPE_CHECKING:
    from control.jobs import Job
    from control.rollout_state import GoldenSet
    from state.dataset import Dataset
    from control.slots import ApplyResult
    from state.predlog_api import PredictionLogBackend
    from state.statedb import StateDB
    from control.serving import ServingState

log = logging.getLogger("textswap.policies")

FILENAME = ".policies.json"
LOOP_DIR = ".loop"
APPLY = ("gate", "canary", "swap", "none")
KEYS = {"retrain_after_labels", "apply", "min_score", "holdout"}
DEFAULT = {"retrain_after_labels": None, "apply": "gate", "holdout": 0.2}


class PolicyError(ValueError):
    pass


class Policy(TypedDict, total=False):
    """A model's retrain policy, checked (validate)."""
    retrain_after_labels: int | None
    apply: str
    min_score: float
    holdout: float


class HoldOut(TypedDict, total=False):
    """The feedback held out of a policy retrain for its gate."""
    texts: list[str]
    labels: list[str]  # none held out of multi-label feedback
    at: float


class LoopState(TypedDict, total=False):
    """What .loop/<name>.json keeps of a model's last training."""
    last_data: dict[str, object] | None
    last_params: dict[str, object] | None
    trained_at: float
    holdout: HoldOut | None


def validate(policy: object, where: str = "policy") -> Policy:
    if not isinstance(policy, dict):
        raise PolicyError(f"{where} must be an object")
    unknown = sorted(set(policy) - KEYS)
    if unknown:
        raise PolicyError(f"{where}: unknown key(s) {', '.join(map(repr, unknown))}; "
                          f"allowed: {', '.join(sorted(KEYS))}")
    out: Policy = {}
    n = policy.get("retrain_after_labels")
    if n is not None:
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 10_000_000:
            raise PolicyError(f"{where}: 'retrain_after_labels' must be an integer >= 1 "
                              "(or null: no automatic retraining)")
    out["retrain_after_labels"] = n
    apply = policy.get("apply", DEFAULT["apply"])
    if apply not in APPLY:
        raise PolicyError(f"{where}: 'apply' must be one of {', '.join(APPLY)}")
    out["apply"] = apply
    numbers: tuple[tuple[Literal["min_score", "holdout"], bool, float | None], ...] = (
        ("min_score", True, None), ("holdout", False, 0.2))
    for key, low_open, default in numbers:
        v = policy.get(key, default)
        if v is None:
            if key == "min_score":
                continue
            raise PolicyError(f"{where}: '{key}' must be a number")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v):
            raise PolicyError(f"{where}: '{key}' must be a number")
        v = float(v)
        if key == "min_score" and not 0.0 < v <= 1.0:
            raise PolicyError(f"{where}: 'min_score' must be in (0, 1]")
        if key == "holdout" and not 0.0 <= v <= 0.5:
            raise PolicyError(f"{where}: 'holdout' must be between 0 and 0.5")
        out[key] = v
    return out


def held_out(text: str, share: float) -> bool:
    """Whether a fed-back text belongs to the hold-out: by a hash of the text, so
    it stays on the same side at every retraining."""
    if share <= 0:
        return False
    h = int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:4], "big")
    return h < share * 2**32


def _write_atomic(path: str, data: object) -> None:
    tmp = f"{path}.tmp.{os.getpid()}.{threading.get_ident()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(data, fh, ensure_ascii=False)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


class Policies:
    def __init__(self, config: dict[str, object], root: str, serving: "ServingState",
                 predlog: "PredictionLogBackend", db: "StateDB",
                 apply: Callable[..., Awaitable["ApplyResult"]],
                 submit: Callable[..., Awaitable["Job"]],
                 reusable: Callable[[str, dict[str, object]], dict[str, object]] | None = None
                 ) -> None:
        """config: the `policies` section; root: the model store's folder;
        apply: the applies' apply (a retrained version goes through the gate);
        submit: the jobs' submit (the job manager holds this object);
        reusable: the jobs' check that the last training's data can be read
        again (JobManager.reusable; blocking)."""
        self.serving, self.predlog, self.db, self.apply = serving, predlog, db, apply
        self.submit = submit
        self.root = root
        self.path = os.path.join(self.root, FILENAME)
        self.dir = os.path.join(self.root, LOOP_DIR)
        self._lock = threading.Lock()
        self.config: dict[str, Policy] = {}
        for name, p in (config or {}).items():
            try:
                check_name(name)
                self.config[name] = validate(p, f"policies.{name}")
            except Exception as exc:  # reported at start, never a crash later
                raise ConfigError(f"config policies.{name}: {exc}") from None
        self.stored: dict[str, Policy] = {}
        try:
            with open(self.path, encoding="utf-8") as fh:
                self.stored = {k: validate(v) for k, v in json.load(fh).items()}
        except FileNotFoundError:
            pass
        except (OSError, ValueError, PolicyError, AttributeError) as exc:
            log.error("cannot read %s (%s): stored policies ignored", self.path, exc)
        # name -> the policy's job while it runs ("checking" before it is submitted)
        self.running: dict[str, Job | str] = {}
        self.last: dict[str, dict[str, object]] = {}  # name -> the last policy retrain's outcome
        self.gating: dict[str, HoldOut] = {}  # name -> hold-out, while its apply runs
        # name -> why a retrain cannot start (409 data_gone: the last training's
        # file is gone), until a training with data or the file's return clears it
        self.blocked: dict[str, dict[str, object]] = {}
        self.reusable = reusable

    # -- the policy ------------------------------------------------------------------------
    def get(self, name: str) -> Policy | None:
        p = self.stored.get(name) or self.config.get(name)
        return p.copy() if p is not None else None

    def describe(self, name: str) -> dict[str, object]:
        p = self.get(name)
        return {"name": name, "policy": p,
                "source": "api" if name in self.stored else "config" if p else None,
                "running_job": getattr(self.running.get(name), "id", None),
                "last_retrain": self.last.get(name),
                "state": "data_gone" if name in self.blocked else
                "running" if name in self.running else "ready",
                "blocked": self.blocked.get(name)}

    def put(self, name: str, policy: object) -> Policy:
        """Validate, persist, then use (blocking: from an executor)."""
        check_name(name)
        p = validate(policy)
        with self._lock:
            stored = {**self.stored, name: p}
            _write_atomic(self.path, stored)
            self.stored = stored
        return p

    def delete(self, name: str) -> bool:
        with self._lock:
            if name not in self.stored:
                return False
            stored = {k: v for k, v in self.stored.items() if k != name}
            _write_atomic(self.path, stored)
            self.stored = stored
        return True

    # -- what the last training used (blocking file access) ----------------------------------
    def _state_path(self, name: str) -> str:
        return os.path.join(self.dir, f"{name}.json")

    def model_state(self, name: str) -> LoopState:
        try:
            with open(self._state_path(name), encoding="utf-8") as fh:
                return json.load(fh)
        except (OSError, ValueError):
            return {}

    def _update_state(self, name: str, **changes: object) -> None:
        with self._lock:
            os.makedirs(self.dir, exist_ok=True)
            state = {**self.model_state(name), **changes}
            _write_atomic(self._state_path(name), state)

    def remember_training(self, name: str, data_spec: dict[str, object], data: "Dataset",
                          params: dict[str, object] | None, trained_at: float | None,
                          roots: list[str] | None = None) -> None:
        """Keep the source of a training's data for a later retrain without data:
        a file as the real path that was read (`data.source`, resolved under a
        data root) with that root, inline examples copied to
        .loop/<name>.data.jsonl. roots: where the file may have been read from."""
        if "path" in data_spec:
            spec = {k: v for k, v in data_spec.items() if k in ("labels", "label_separator")}
            spec["path"] = path = os.path.realpath(data.source)
            for root in roots or []:
                real = os.path.realpath(root)
                if path.startswith(real.rstrip(os.sep) + os.sep):
                    spec["root"] = real
                    break
        else:
            copy = os.path.join(self.dir, f"{name}.data.jsonl")
            os.makedirs(self.dir, exist_ok=True)
            data.write_jsonl(copy + ".tmp")
            os.replace(copy + ".tmp", copy)
            spec = {"path": copy}
        changes: dict[str, object] = {"last_data": spec, "last_params": params}
        if trained_at is not None:
            changes["trained_at"] = trained_at
        self._update_state(name, **changes)
        self.blocked.pop(name, None)  # a retrain has data to read again

    def forget(self, erased: dict[str, set[str]], whole: bool = False) -> dict[str, int]:
        """Erase texts from the copies kept under .loop/ (blocking: from an
        executor): each model's feedback hold-out (.loop/<name>.json) and its
        inline-data copy (.loop/<name>.data.jsonl) lose the rows with those
        texts; whole: the model's whole log was erased, and its hold-out (made
        of its feedback) goes whole. Each file is rewritten whole (a new file
        replaces it). Returns the rows removed: {"holdout", "data_copy"}."""
        out = {"holdout": 0, "data_copy": 0}
        for name, texts in erased.items():
            if not texts and not whole:
                continue
            with self._lock:
                state = self.model_state(name)
                hold = state.get("holdout") or {}
                held = list(zip(hold.get("texts") or [], hold.get("labels") or []))
                keep = [] if whole else [(t, y) for t, y in held if t not in texts]
                if len(keep) < len(held):
                    state["holdout"] = ({**hold, "texts": [t for t, _ in keep],
                                         "labels": [y for _, y in keep]} if keep else None)
                    _write_atomic(self._state_path(name), state)
                    out["holdout"] += len(held) - len(keep)
                if texts:
                    out["data_copy"] += self._forget_in_copy(name, texts)
        return out

    def _forget_in_copy(self, name: str, texts: set[str]) -> int:
        """The inline-data copy of `name` without the rows holding `texts`."""
        copy = os.path.join(self.dir, f"{name}.data.jsonl")
        try:
            with open(copy, encoding="utf-8") as fh:
                lines = fh.read().splitlines()
        except FileNotFoundError:
            return 0
        keep = []
        for line in lines:
            try:
                text = json.loads(line).get("text")
            except (ValueError, AttributeError):
                text = None
            if text not in texts:
                keep.append(line)
        if len(keep) == len(lines):
            return 0
        tmp = f"{copy}.tmp.{os.getpid()}.{threading.get_ident()}"
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write("".join(line + "\n" for line in keep))
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, copy)
        return len(lines) - len(keep)

    def last_training(self, name: str
                      ) -> tuple[dict[str, object] | None, dict[str, object] | None]:
        s = self.model_state(name)
        return s.get("last_data"), s.get("last_params")

    def holdout(self, name: str) -> HoldOut | None:
        """The feedback hold-out of the last policy retrain: {"texts", "labels"}."""
        h = self.model_state(name).get("holdout")
        return h if h and h.get("texts") else None

    def gate_set(self, name: str, golden: "GoldenSet | None") -> "GoldenSet | None":
        """The gate's golden set while a policy retrain applies: the registered
        one (if any) plus the feedback hold-out; otherwise `golden` unchanged."""
        hold = self.gating.get(name)
        if not hold:
            return golden
        texts = (list(golden.get("texts", [])) if golden else []) + hold["texts"]
        labels = (list(golden.get("labels", [])) if golden else []) + hold["labels"]
        sha = hashlib.sha256(json.dumps([texts, labels], ensure_ascii=False).encode()).hexdigest()
        return {"name": name, "texts": texts, "labels": labels, "sha256": sha,
                "source": "golden set + feedback hold-out" if golden else "feedback hold-out",
                "min_accuracy": golden.get("min_accuracy") if golden else None}

    # -- the loop --------------------------------------------------------------------------
    def labels_arrived(self, name: str) -> None:
        """On the IOLoop, after feedback for `name` was committed."""
        p = self.get(name)
        if not p or not p.get("retrain_after_labels") or name in self.running:
            return
        if self.serving.stopping:
            return
        self.running[name] = "checking"
        IOLoop.current().spawn_callback(self._maybe_retrain, name, p)

    async def _maybe_retrain(self, name: str, p: Policy) -> None:
        loop = IOLoop.current()
        try:
            state = await loop.run_in_executor(None, self.model_state, name)
            since = state.get("trained_at")
            n = await loop.run_in_executor(None, self.predlog.feedback_count, name, since)
            if n < p["retrain_after_labels"]:  # type: ignore[operator]  # set: labels_arrived
                return
            if name in self.blocked and self.reusable is not None:
                # still gone? one stat, not a read of every label, at each new label
                await loop.run_in_executor(None, self.reusable, name, state.get("last_data"))
                self.blocked.pop(name, None)
            await self.retrain(name, p, n)
        except Exception as exc:
            code = getattr(exc, "code", None)
            if code == "data_gone":  # stays so until the data is back: said once
                if name not in self.blocked:
                    log.warning("retrain policy of %s cannot retrain: %s", name, exc)
                    self._history(name, "retrain_failed", f"retrain policy: {exc}", None,
                                  {"code": code})
                self.blocked[name] = {"code": code, "message": str(exc), "since": (
                    self.blocked.get(name) or {}).get("since", time.time())}
                self.last[name] = {"at": time.time(), "error": str(exc), "code": code}
                return
            if code is not None:  # a refusal of the job (JobError): no traceback
                log.error("retrain policy of %s failed: %s", name, exc)
            else:
                log.exception("retrain policy of %s failed", name)
            self.last[name] = {"at": time.time(), "error": str(exc)}
            self._history(name, "retrain_failed", f"retrain policy: {exc}", None, {})
        finally:
            self.running.pop(name, None)

    async def retrain(self, name: str, p: Policy, n: int) -> dict[str, object]:
        loop = IOLoop.current()
        cause = f"retrain after {n} labels"
        started = time.time()
        examples = await loop.run_in_executor(None, self.predlog.feedback_examples, name)
        share = p.get("holdout", 0.2) if p["apply"] == "gate" else 0.0
        if any(is_label_set(lab) for _, lab in examples):
            share = 0.0  # multi-label feedback: the gate compares top labels, not sets
        train = [(t, lab) for t, lab in examples if not held_out(t, share)]
        hold = [(t, lab) for t, lab in examples if held_out(t, share)]
        job = await self.submit(name, None, None, False, feedback=train,
                                         watermark=started)
        self.running[name] = job
        await loop.run_in_executor(None, lambda: self._update_state(
            name, holdout={"texts": [t for t, _ in hold], "labels": [lab for _, lab in hold],
                           "at": started} if hold else None))
        log.info("%s: %s: job %s (%d feedback rows, %d held out for the gate)", name, cause,
                 job.id, len(train), len(hold))
        self._history(name, "retrain", cause, None,
                      {"job": job.id, "apply": p["apply"], "feedback": len(train),
                       "held_out": len(hold)})
        await job.done_future()
        outcome: dict[str, object] = {"at": time.time(), "cause": cause, "job": job.id,
                                   "state": job.state, "apply": p["apply"],
                                   "held_out": len(hold), "train_s": round(
                                       (job.finished or time.time()) - started, 3)}
        if job.state != "succeeded" or job.result is None:
            outcome["error"] = job.error
            self.last[name] = outcome
            self._history(name, "retrain_failed", f"{cause}: job {job.state}", None, outcome)
            return outcome
        version = job.result["version"]
        outcome["version"] = version
        t = time.monotonic()
        if hold:
            self.gating[name] = {"texts": [x for x, _ in hold], "labels": [y for _, y in hold]}
        try:
            if p["apply"] == "gate":
                res = await self.apply(name, version, source="train")
            elif p["apply"] == "canary":
                res = await self.apply(name, version, source="train", mode="canary")
            elif p["apply"] == "swap":
                res = await self.apply(name, version, source="train", gate=False)
            else:
                res = None
            outcome["applied"] = res is not None
            outcome["gate"] = (res or {}).get("gate")
        except Exception as exc:
            outcome["applied"] = False
            outcome["refused"] = str(exc)
            outcome["gate"] = (getattr(exc, "details", None) or {}).get("gate")
        finally:
            self.gating.pop(name, None)
        outcome["apply_s"] = round(time.monotonic() - t, 3)
        self.last[name] = outcome
        what = ("applied" if outcome["applied"] else
                "published only" if p["apply"] == "none" else "not applied")
        self._history(name, "retrain_done", f"{cause}: v{version} {what}", version, outcome)
        log.info("%s: %s: v%s %s", name, cause, version, what)
        return outcome

    def _history(self, name: str, kind: str, reason: str, version: int | None,
                 details: dict[str, object]) -> None:
        try:
            self.db.add_history(name, kind, source="policy", to_version=version, reason=reason,
                              details=details)
        except Exception as exc:
            log.error("cannot record %s of %s: %s", kind, name, exc)
