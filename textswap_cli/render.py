"""Readable output with rich: tables for status, models and jobs, a job's epochs,
and the live progress of a training job. Tolerant of missing keys, so an
older or newer server's answers still print."""
from __future__ import annotations

import time
from typing import Any

from rich.console import Console
from rich.markup import escape as rich_escape
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
    for name, m in sorted((models or {}).items()):
        rollout_lines(str(name), m)
    for f in s.get("failed_models") or []:
        out.print(f"[red]FAILED[/] {_ref(f)}: " + rich_escape(str(f.get("reason") or f)))
    active = [j for j in s.get("jobs") or [] if j.get("state") in ("queued", "running")]
    if active:
        jobs(active, title="active jobs")


# -- applies and rollouts ------------------------------------------------------------
def secs(x: Any) -> str:
    if not isinstance(x, (int, float)):
        return "-"
    return f"{1000 * x:.1f} ms" if x < 0.1 else f"{x:.2f} s"


def _pct(x: Any) -> str:
    return f"{100 * x:.1f}%" if isinstance(x, (int, float)) else "-"


def _stats(st: Any) -> str:
    """rollouts.VersionStats.describe(): requests, errors, latencies."""
    if not isinstance(st, dict):
        return "-"
    ms = lambda v: f"{v:.1f} ms" if isinstance(v, (int, float)) else "-"  # noqa: E731
    return (f"{st.get('requests', 0)} req, {st.get('errors', 0)} errors "
            f"({_pct(st.get('error_rate'))}), p50 {ms(st.get('p50_ms'))}, "
            f"p99 {ms(st.get('p99_ms'))}")


def _phases(phases: Any) -> str:
    """An apply's phase timings."""
    if not isinstance(phases, dict):
        return ""
    return ", ".join(f"{k} {secs(v)}" for k, v in phases.items() if isinstance(v, (int, float)))


def gate(info: Any) -> None:
    if not isinstance(info, dict):
        return
    if info.get("skipped"):
        out.print("quality gate: skipped on request")
        return
    cand, serv = info.get("candidate") or {}, info.get("serving")
    line = (f"quality gate: {'passed' if info.get('passed') else 'refused'}, accuracy "
            f"{_num(cand.get('accuracy'))} on {info.get('golden_examples')} golden examples")
    if isinstance(serv, dict):
        line += f" (serving v{serv.get('version')}: {_num(serv.get('accuracy'))})"
    out.print(line)


def applied(answer: dict[str, Any]) -> None:
    took = f" in {answer['total_s']:.2f} s" if isinstance(answer.get("total_s"), float) else ""
    how = " (instant: it was still loaded)" if answer.get("from_probation") else ""
    out.print(f"now serving {_ref(answer.get('current'))}{took}{how} "
              f"(previous: {_ref(answer.get('previous'))})")
    phases = _phases(answer.get("phases_s"))
    if phases:
        out.print("phases: " + phases)
    gate(answer.get("gate"))
    p = answer.get("probation")
    if isinstance(p, dict):
        name = (answer.get("current") or {}).get("name", "NAME")
        out.print(f"v{p.get('version')} stays loaded for {p.get('remaining_s', 0):.0f} s: "
                  f"`textswap rollback {name}` is instant until then")


def candidate_started(answer: dict[str, Any]) -> None:
    mode, frac = answer.get("mode"), answer.get("fraction")
    what = "gets a copy of" if mode == "shadow" else "answers"
    out.print(f"{_ref(answer.get('candidate'))} runs as a {mode} beside "
              f"{_ref(answer.get('serving'))}: it {what} {_pct(frac)} of requests "
              f"(ready in {secs(answer.get('total_s'))}); then `textswap promote "
              f"{answer.get('name')}` or `textswap abort {answer.get('name')}`")


def candidate_figures(c: Any) -> None:
    if not isinstance(c, dict):
        return
    if c.get("mode") == "shadow":
        out.print(f"shadow v{c.get('version')}: mirrored {c.get('mirrored')}, compared "
                  f"{c.get('compared')}, agreement {_pct(c.get('agreement_rate'))}, mean "
                  f"score diff {_num(c.get('mean_score_diff'))}, skipped (busy) "
                  f"{c.get('skipped_busy')}")
    else:
        out.print(f"canary v{c.get('version')} ({_pct(c.get('fraction'))}): "
                  f"{_stats(c.get('candidate'))}")
        out.print(f"  serving: {_stats(c.get('serving'))}")
    for d in c.get("disagreements") or []:
        out.print(f"  differs: {d.get('text')!r}: {(d.get('serving') or {}).get('label')} -> "
                  f"{(d.get('candidate') or {}).get('label')}", markup=False)


def rollout_lines(name: str, m: dict[str, Any]) -> None:
    """Probation, candidate and rollbacks of one model, one line each."""
    p = m.get("probation")
    if isinstance(p, dict):
        out.print(f"{name}: probation, v{p.get('version')} kept loaded "
                  f"{p.get('remaining_s', 0):.0f} s more (v{p.get('watching_version')}: "
                  f"{_stats(p.get('new_version'))})", markup=False)
    c = m.get("candidate")
    if isinstance(c, dict):
        extra = (f", agreement {_pct(c.get('agreement_rate'))} over {c.get('compared')}"
                 if c.get("mode") == "shadow" else "")
        out.print(f"{name}: {c.get('mode')} candidate v{c.get('version')} "
                  f"({_pct(c.get('fraction'))}){extra}", markup=False)
    for r in m.get("rolled_back") or []:
        out.print(f"{name}: v{r.get('version')} rolled back to v{r.get('back_to')} "
                  f"({'auto' if r.get('auto') else 'manual'}, {_when(r.get('at'))}): "
                  f"{r.get('reason')}", markup=False)


def rollout(answer: dict[str, Any]) -> None:
    name = str(answer.get("name"))
    out.print(f"[bold]{rich_escape(name)}[/] serves v{answer.get('version')} "
              f"(previous: v{answer.get('previous_version')}); since the swap: "
              f"{_stats(answer.get('serving'))}", markup=True)
    rollout_lines(name, answer)
    candidate_figures(answer.get("candidate"))
    if not (answer.get("probation") or answer.get("candidate") or answer.get("rolled_back")):
        out.print("no probation, no candidate, nothing rolled back")


def _versions(r: dict[str, Any]) -> str:
    f, t, kind = r.get("from_version"), r.get("to_version"), r.get("kind")
    if kind in ("shadow", "canary"):
        return f"v{t} beside v{f}"
    if kind in ("abort", "gate_refused"):
        return f"v{t}" + (f" (v{f} serves)" if f is not None else "")
    if kind == "probation_ended":
        return f"v{f} unloaded"
    if f is not None and t is not None and f != t:
        return f"v{f} -> v{t}"
    return f"v{t}" if t is not None else (f"v{f}" if f is not None else "")


def history(rows: list[dict[str, Any]]) -> None:
    table = Table(title="history (newest first)", title_justify="left")
    for col in ("time", "event", "model", "versions", "source", "reason / phases"):
        table.add_column(col, overflow="fold")
    colours = {"rollback": "red", "crash": "red", "failed": "red", "gate_refused": "red",
               "apply_failed": "red", "apply": "cyan", "promote": "cyan", "abort": "yellow"}
    for r in rows:
        kind = str(r.get("kind"))
        colour = colours.get(kind, "white")
        detail = r.get("reason") or _phases(r.get("phases"))
        table.add_row(_when(r.get("at")), f"[{colour}]{kind}[/]", str(r.get("name") or "-"),
                      _versions(r), str(r.get("source") or "-"),
                      rich_escape(str(detail or "")))
    out.print(table if rows else "no events yet")


def golden(g: dict[str, Any]) -> None:
    counts = ", ".join(f"{k} {v}" for k, v in (g.get("label_counts") or {}).items())
    floor = g.get("min_accuracy")
    out.print(f"golden set of {g.get('name')}: {g.get('examples')} examples ({counts}); "
              f"min accuracy {floor if floor is not None else '-'}; source {g.get('source')}; "
              f"sha256 {str(g.get('sha256'))[:12]}", markup=False)


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
            n_labels = str(len(v.get("labels") or []))
            accuracy = _num(metrics.get("accuracy"))
            if metrics.get("multi_label"):  # several labels per text: micro-F1, not accuracy
                n_labels += " (multi-label)"
                accuracy = f"micro-F1 {_num(metrics.get('micro_f1'))}"
            table.add_row(m.get("name"), str(v.get("version")),
                          "*" if (m.get("name"), v.get("version")) in serving_set else "",
                          n_labels, accuracy,
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


def label_sets(answer: dict[str, Any], texts: list[str]) -> None:
    """A multi-label model's answer as a table: each text with its label set."""
    table = Table(title=f"labels from {_ref(answer.get('model'))}", title_justify="left")
    for col in ("text", "labels", "top"):
        table.add_column(col)
    for text, p in zip(texts, answer.get("predictions") or []):
        sets = p.get("labels")
        if sets is None and p.get("label") is not None:  # a single-label model
            sets = [{"label": p["label"], "score": p.get("score")}]
        chosen = ", ".join(f"{x['label']} {_num(x['score'], 2)}" for x in sets or [])
        table.add_row(text[:60], chosen or ("(abstained)" if p.get("abstained") else "-"),
                      f"{p.get('label')} {_num(p.get('score'), 2)}")
    out.print(table)
