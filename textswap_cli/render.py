"""Readable output with rich: tables for status, models and jobs, a job's epochs,
and the live progress of a training job. Tolerant of missing keys, so an
older or newer server's answers still print."""
from __future__ import annotations

import time
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table

out = Console(highlight=False)
err = Console(stderr=True, highlight=False, soft_wrap=True)


def _mb(n: Any) -> str:
    return f"{n / 1e6:.0f} MB" if isinstance(n, (int, float)) else "-"


def _num(x: Any, digits: int = 4) -> str:
    return f"{x:.{digits}f}" if isinstance(x, float) else ("-" if x is None else str(x))


def _when(ts: Any) -> str:
    if not isinstance(ts, (int, float)):
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


def _ref(model: Any) -> str:
    if not isinstance(model, dict) or not model.get("name"):
        return "-"
    return f"{model['name']} v{model.get('version')}"


# -- status --------------------------------------------------------------------------
def status(s: dict[str, Any]) -> None:
    sup = s.get("supervisor") or {}
    out.print(f"[bold]supervisor[/] pid {sup.get('pid')}, up {_num(sup.get('uptime_s'), 0)} s, "
              f"RSS {_mb(sup.get('rss_bytes'))}, store {sup.get('models_dir')}, "
              f"restarts {s.get('restarts', 0)}")
    models = s.get("models")
    if models is None and s.get("serving"):  # a server from before model slots
        serving = s["serving"]
        models = {serving.get("name"): {**serving, "state": "SERVING"}}
        s = {**s, "default": serving.get("name")}
    table = Table(title="models", title_justify="left")
    for col in ("model", "version", "state", "replicas", "default", "labels"):
        table.add_column(col)
    for name, m in sorted((models or {}).items()):
        labels = m.get("labels") or []
        table.add_row(str(name), str(m.get("version", "-")), str(m.get("state", "-")),
                      str(m.get("replicas", 1)), "*" if name == s.get("default") else "",
                      ", ".join(labels[:6]) + (" ..." if len(labels) > 6 else ""))
    out.print(table if models else "no model is serving")
    workers = list(s.get("workers") or [])
    if workers:
        wt = Table(title="workers", title_justify="left")
        for col in ("gen", "pid", "state", "model", "in flight", "served", "RSS"):
            wt.add_column(col)
        for w in workers:
            wt.add_row(str(w.get("generation")), str(w.get("pid")), str(w.get("state")),
                       _ref(w.get("model")), str(w.get("inflight", "-")),
                       str(w.get("served", "-")), _mb(w.get("rss_bytes")))
        out.print(wt)
    for f in s.get("failed_models") or []:
        out.print(f"[red]FAILED[/] {_ref(f)}: {f.get('reason') or f}")
    active = [j for j in s.get("jobs") or [] if j.get("state") in ("queued", "running")]
    if active:
        jobs(active, title="active jobs")


# -- models --------------------------------------------------------------------------
def models(answer: dict[str, Any]) -> None:
    serving = answer.get("serving") or {}
    serving_set = {(serving.get("name"), serving.get("version"))} if serving else set()
    for m in answer.get("serving_models") or []:  # newer servers may list several
        serving_set.add((m.get("name"), m.get("version")))
    table = Table(title="models in the store", title_justify="left")
    for col in ("model", "version", "serving", "labels", "accuracy", "macro F1", "examples",
                "created"):
        table.add_column(col)
    for m in answer.get("models") or []:
        for v in m.get("versions") or []:
            metrics = v.get("metrics") or {}
            data = v.get("data") or {}
            table.add_row(m.get("name"), str(v.get("version")),
                          "*" if (m.get("name"), v.get("version")) in serving_set else "",
                          str(len(v.get("labels") or [])), _num(metrics.get("accuracy")),
                          _num(metrics.get("macro_f1")), str(data.get("examples", "-")),
                          str(v.get("created_at", "-")))
    out.print(table if answer.get("models") else "the store has no models")


# -- jobs ----------------------------------------------------------------------------
def _where(progress: dict[str, Any]) -> str:
    """'candidate 3/17' (model search), 'epoch 2/10' (Keras training), or the phase."""
    if "candidate" in progress:
        total = progress.get("of") or progress.get("candidates") or "?"
        return f"candidate {progress['candidate']}/{total}"
    if progress.get("epochs"):
        return f"epoch {progress.get('epoch', 0)}/{progress['epochs']}"
    return progress.get("phase") or "-"


def _figures(entry: dict[str, Any]) -> str:
    """The figures of one epoch or candidate, for the progress line."""
    if "loss" in entry:
        return (f"loss {_num(entry.get('loss'))}  val acc "
                f"{_num(entry.get('val_accuracy'))}")
    if "score" in entry:
        return (f"{entry.get('name', '')} score {_num(entry.get('score'))}  best "
                f"{_num(entry.get('best_score'))}")
    return ""


def jobs(items: list[dict[str, Any]], title: str = "training jobs") -> None:
    table = Table(title=title, title_justify="left")
    for col in ("id", "model", "state", "progress", "accuracy", "result", "created",
                "elapsed"):
        table.add_column(col)
    for j in items:
        state = j.get("state", "-")
        colour = {"succeeded": "green", "failed": "red", "interrupted": "yellow",
                  "cancelled": "yellow", "running": "cyan"}.get(state, "white")
        table.add_row(str(j.get("id")), str(j.get("name")), f"[{colour}]{state}[/]",
                      _where(j.get("progress") or {}),
                      _num((j.get("metrics") or {}).get("accuracy")), _ref(j.get("result")),
                      _when(j.get("created_at")),
                      f"{j['elapsed_s']:.1f} s" if j.get("elapsed_s") is not None else "-")
    out.print(table if items else "no training jobs")


def job_log(job: dict[str, Any]) -> None:
    """A job's story: what, its epochs (or candidates), result or error, log tail."""
    out.print(f"[bold]job {job.get('id')}[/]: train {job.get('name')} on "
              f"{(job.get('data') or {}).get('examples', '?')} examples -> "
              f"{job.get('state')}")
    history = job.get("history") or []
    if history:
        first = ("candidate", "name", "epoch", "loss", "val_loss", "accuracy", "val_accuracy",
                 "val_macro_f1", "score", "best_score")
        keys = [k for k in first if any(k in h for h in history)]
        keys += sorted({k for h in history for k in h if k not in keys and k not in
                        ("epochs", "candidates", "of") and isinstance(h[k], (int, float))})
        table = Table(title="history", title_justify="left")
        for k in keys:
            table.add_column(k)
        for h in history:
            table.add_row(*[_num(h.get(k)) for k in keys])
        out.print(table)
    if job.get("result"):
        out.print(f"published {_ref(job['result'])}; metrics: accuracy "
                  f"{_num((job.get('metrics') or {}).get('accuracy'))}, macro F1 "
                  f"{_num((job.get('metrics') or {}).get('macro_f1'))}")
    if job.get("applied"):
        applied = job["applied"]
        out.print(f"apply: {applied.get('error') or 'now serving ' + _ref(applied.get('current'))}")
    if job.get("error"):
        out.print(f"[red]error:[/] {job['error']}")
    if job.get("log_tail"):
        out.rule("log tail")
        out.print(job["log_tail"], markup=False)


class JobProgress:
    """A live bar for one job: epoch or candidate i/n, and the latest figures
    (loss and validation accuracy, or a candidate's validation score)."""

    def __init__(self, job_id: str) -> None:
        self.progress = Progress(
            TextColumn("[bold]{task.description}"), BarColumn(),
            TextColumn("{task.fields[where]}"), TextColumn("{task.fields[figures]}"),
            TimeElapsedColumn(), console=err, transient=False)
        self.task: TaskID = self.progress.add_task(f"job {job_id}", total=None,
                                                   where="queued", figures="")

    def __enter__(self) -> "JobProgress":
        self.progress.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.progress.stop()

    def update(self, job: dict[str, Any]) -> None:
        p = job.get("progress") or {}
        if "candidate" in p:
            total, done = p.get("of") or p.get("candidates"), p["candidate"]
        else:
            total, done = p.get("epochs"), p.get("epoch")
        where = job.get("state", "")
        if where == "running":
            where = "publishing" if p.get("phase") == "publishing" else _where(p)
        history = job.get("history") or []
        self.progress.update(self.task, total=total or None, completed=done or 0,
                             where=where, figures=_figures(history[-1] if history else p))
