"""The `textswap` commands (click). Each one is a thin layer over one or two
HTTP calls; output is a rich table for people, or the server's JSON with
--json for scripts. Exit codes: see client.EXIT_* and README "Command line"."""
from __future__ import annotations

import itertools
import json
import os
import sys
import tarfile
import tempfile
import time
from typing import Any, Callable

import click

from textswap_cli import loopcmds, render
from textswap_cli.client import (DEFAULT_PREDICT_URL, DEFAULT_URL, EXIT_INTERRUPTED, EXIT_OK,
                                 EXIT_REFUSED, EXIT_USAGE, Api, CliError, find_key,
                                 keys_file_path, quote, read_keys_file)
from textswap_cli.data import (InputError, iter_texts, parse_params, read_descriptions,
                               read_examples)

TERMINAL = ("succeeded", "failed", "cancelled", "interrupted")


class Ctx:
    def __init__(self, url: str, predict_url: str, timeout: float, as_json: bool,
                 key: str | None = None, keys_file: str | None = None) -> None:
        self.keys_file = keys_file
        self.manage = Api(url, find_key("admin", url, key, keys_file), timeout)
        self.infer = Api(predict_url, find_key("predict", predict_url, None, keys_file), timeout)
        self.json = as_json


def emit_json(data: Any) -> None:
    click.echo(json.dumps(data, ensure_ascii=False))


def json_option(fn: Callable) -> Callable:
    """--json on every subcommand (also accepted before the subcommand)."""
    def set_json(ctx: click.Context, _param: Any, value: bool) -> None:
        if value:
            ctx.find_object(Ctx).json = True
    return click.option("--json", "as_json", is_flag=True, expose_value=False,
                        callback=set_json, help="Print the server's JSON answer.")(fn)


def _fail(exc: CliError, ctx: Ctx) -> None:
    if ctx.json and exc.body is not None:
        emit_json(exc.body)
    # the message may quote user data: "[...]" in it is text, not rich markup
    render.err.print("[red]error:[/] " + render.rich_escape(str(exc)), markup=True,
                     highlight=False)
    sys.exit(exc.exit_code)


def command(fn: Callable) -> Callable:
    """Shared wrapping: --json, and CliError/InputError -> message + exit code."""
    @click.pass_obj
    def wrapper(ctx: Ctx, *args: Any, **kwargs: Any) -> None:
        try:
            fn(ctx, *args, **kwargs)
        except CliError as exc:
            _fail(exc, ctx)
        except InputError as exc:
            render.err.print(f"[red]error:[/] {exc}", highlight=False)
            sys.exit(EXIT_USAGE)
    wrapper.__name__ = fn.__name__
    wrapper.__doc__ = fn.__doc__
    return json_option(wrapper)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--url", envvar="TEXTSWAP_URL", default=DEFAULT_URL, show_default=True,
              help="Management API (env TEXTSWAP_URL).")
@click.option("--predict-url", envvar="TEXTSWAP_PREDICT_URL", default=DEFAULT_PREDICT_URL,
              show_default=True, help="Inference API (env TEXTSWAP_PREDICT_URL).")
@click.option("--timeout", default=120.0, show_default=True,
              help="Seconds to wait for one HTTP answer.")
@click.option("--json", "as_json", is_flag=True, help="JSON output (any subcommand).")
@click.option("--key", help="The management key (admin, or review for reading); else "
                            "TEXTSWAP_KEY, else a local service's key file.")
@click.option("--keys-file", type=click.Path(dir_okay=False),
              help="A service's key file (env TEXTSWAP_KEYS_FILE; default: "
                   ".textswap/keys.json of this checkout, what `make serve` makes).")
@click.version_option("0.1.0", prog_name="textswap")
@click.pass_context
def cli(ctx: click.Context, url: str, predict_url: str, timeout: float, as_json: bool,
        key: str | None, keys_file: str | None) -> None:
    """Train, apply and query textswap models.

    The management key: --key, else TEXTSWAP_KEY (or TEXTSWAP_ADMIN_KEY,
    TEXTSWAP_MANAGEMENT_TOKEN), else, for a service on this machine, the
    admin key of its key file (--keys-file, TEXTSWAP_KEYS_FILE, else
    .textswap/keys.json of this checkout). Exit codes: 0 ok, 1 the server
    refused or the job failed, 2 usage or unreadable input, 3 cannot connect,
    4 key missing, wrong or of another scope, 130 interrupted.
    """
    ctx.obj = Ctx(url, predict_url, timeout, as_json, key, keys_file)


# -- serving -----------------------------------------------------------------------
@cli.command(context_settings={"ignore_unknown_options": True})
@click.option("--config", "config_path", type=click.Path(dir_okay=False),
              help="Config file (default: the project's config.yaml).")
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@json_option
def serve(config_path: str | None, args: tuple[str, ...]) -> None:
    """Run the service in the foreground (what `make serve` runs).

    Extra ARGS go to the service: --host, --port, --manage-host, --manage-port,
    --models-dir.
    """
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    entry = os.path.join(root, "supervisor.py")
    if not os.path.isfile(entry):
        render.err.print(f"error: no service next to this CLI ({entry} is missing); "
                         "`serve` needs the project checkout")
        sys.exit(EXIT_USAGE)
    config_path = os.path.abspath(config_path) if config_path else os.path.join(
        root, "config.yaml")
    # relative paths the caller gave stay relative to the caller's folder
    fixed, it = [], iter(args)
    for a in it:
        if a == "--models-dir":
            fixed += [a, os.path.abspath(next(it, "."))]
        elif a.startswith("--models-dir="):
            fixed.append("--models-dir=" + os.path.abspath(a.split("=", 1)[1]))
        else:
            fixed.append(a)
    os.chdir(root)  # like make serve: ./models is the project's
    argv = [sys.executable, entry, "--config", config_path, *fixed]
    os.execv(sys.executable, argv)  # signals (Ctrl-C) go straight to the service


# -- keys --------------------------------------------------------------------------
@cli.group()
def keys() -> None:
    """The key file of a service on this machine (never prints a key)."""


@keys.command("rotate")
@click.argument("names", nargs=-1, type=click.Choice(["admin", "review", "feedback",
                                                      "predict"]))
@click.pass_obj
def keys_rotate(ctx: Ctx, names: tuple[str, ...]) -> None:
    """New keys for NAMES (default: every key in the file), written whole to a
    new file that replaces the old one (temp file, fsync, rename): the
    service uses them within a second, without a restart; the old ones stop
    working then."""
    import secrets

    path = keys_file_path(ctx.keys_file)
    old = read_keys_file(path)
    if not old:
        render.err.print(f"error: no key file at {path} (a service makes it on its first "
                         "start; --keys-file or TEXTSWAP_KEYS_FILE names another)")
        sys.exit(EXIT_USAGE)
    chosen = list(names) or sorted(old)
    new = {**old, **{n: secrets.token_urlsafe(32) for n in chosen}}
    folder = os.path.dirname(path)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".keys-", suffix=".tmp")  # mode 0600
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump({"keys": new, "created": time.time()}, fh, indent=1)
            fh.write("\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    dfd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    if ctx.json:
        emit_json({"keys_file": path, "rotated": chosen})
    else:
        click.echo(f"new {', '.join(chosen)} key(s) in {path}")


@keys.command("path")
@click.pass_obj
def keys_path(ctx: Ctx) -> None:
    """Where the key file is looked for, and the names it holds."""
    path = keys_file_path(ctx.keys_file)
    names = sorted(read_keys_file(path))
    if ctx.json:
        emit_json({"keys_file": path, "names": names})
    else:
        click.echo(f"{path}: {', '.join(names) if names else 'no key file there'}")


@cli.command()
@command
def dashboard(ctx: Ctx) -> None:
    """A one-time dashboard URL that logs a browser in (admin key)."""
    got = ctx.manage.post("/auth/code", {})
    if ctx.json:
        emit_json(got)
    else:
        click.echo(got["url"])


# -- training ----------------------------------------------------------------------
@cli.command()
@click.argument("name")
@click.argument("data", required=False)
@click.option("--feedback", is_flag=True,
              help="Fold NAME's fed-back labels in; without DATA, its last training's data.")
@click.option("--param", "-p", "params", multiple=True, metavar="KEY=VALUE",
              help="A training parameter, e.g. -p epochs=10 (repeatable).")
@click.option("--apply", "apply_", is_flag=True, help="Apply the model once trained.")
@click.option("--wait", is_flag=True, help="Follow the job until it ends (progress bar).")
@click.option("--server-path", is_flag=True,
              help="DATA is a path on the server (under its data roots), not a local file.")
@click.option("--labels-file", "labels_file", metavar="FILE",
              help="A JSON object {label: description}: without DATA a zero-shot version "
                   "(scores: uncalibrated similarities); with DATA one more example per label.")
@command
def train(ctx: Ctx, name: str, data: str | None, params: tuple[str, ...], apply_: bool,
          wait: bool, server_path: bool, feedback: bool = False,
          labels_file: str | None = None) -> None:
    """Train model NAME on DATA (a CSV with text,label columns, or JSONL).

    DATA is read here and sent inline, so the service may be remote.
    """
    body: dict[str, Any] = {"name": name, "apply": apply_,
                            "params": parse_params(params) if params or data or labels_file
                            else None}
    if labels_file is not None:
        body["labels"] = read_descriptions(labels_file)
    if feedback:
        body["feedback"] = True
    elif data is None and labels_file is None:
        raise click.UsageError("DATA is needed (or --feedback: the last training's data; "
                               "or --labels-file: a zero-shot version)")
    if data is not None:
        body["data"] = {"path": data} if server_path else {"examples": read_examples(data)}
    try:
        job = ctx.manage.post("/train", body)["job"]
    except CliError as exc:
        if exc.status == 413:
            exc.args = (f"{exc.args[0]}\nthe data is too large to send inline: put the file "
                        "under the server's data roots and use --server-path",)
        raise
    if not wait:
        if ctx.json:
            emit_json({"job": job})
        else:
            render.out.print(f"job {job['id']} {job['state']}: train {name} on "
                             f"{job['data'].get('examples')} examples; follow it with "
                             f"`textswap logs {job['id']}`")
        return
    _follow(ctx, job, apply_)


def _follow(ctx: Ctx, job: dict[str, Any], apply_: bool) -> None:
    """Poll the job until it ends (and, with --apply, until its apply is done)."""
    job_id = job["id"]
    path = f"/train/{quote(job_id)}"

    def ended(j: dict[str, Any]) -> bool:
        if j["state"] not in TERMINAL:
            return False
        return not (apply_ and j["state"] == "succeeded" and j.get("applied") is None)

    bar = None if ctx.json else render.JobProgress(job_id)
    try:
        if bar:
            bar.__enter__()
        while not ended(job):
            time.sleep(0.5)  # polling an HTTP API: the server keeps no push channel
            job = ctx.manage.get(path)["job"]
            if bar:
                bar.update(job)
    except KeyboardInterrupt:
        if bar:
            bar.__exit__(None, None, None)
            bar = None
        _offer_cancel(ctx, job_id, path)
        sys.exit(EXIT_INTERRUPTED)
    finally:
        if bar:
            bar.__exit__(None, None, None)
    if ctx.json:
        emit_json({"job": job})
    else:
        render.job_log({**job, "log_tail": None if job["state"] == "succeeded"
                        else job.get("log_tail")})
    applied_error = (job.get("applied") or {}).get("error")
    if job["state"] != "succeeded" or applied_error:
        sys.exit(EXIT_REFUSED)


def _offer_cancel(ctx: Ctx, job_id: str, path: str) -> None:
    if not sys.stdin.isatty():
        render.err.print(f"interrupted; job {job_id} goes on (cancel: "
                         f"`textswap jobs --cancel {job_id}`)")
        return
    try:
        cancel = click.confirm(f"\nCancel job {job_id}?", default=False, err=True)
    except (click.Abort, KeyboardInterrupt):
        cancel = False
    if not cancel:
        render.err.print(f"job {job_id} goes on; follow it with `textswap logs {job_id}`")
        return
    try:
        job = ctx.manage.delete(path)["job"]
        render.err.print(f"job {job_id} {job['state']}")
    except CliError as exc:
        render.err.print(f"[red]error:[/] {exc}")


@cli.command()
@click.option("--cancel", "cancel_id", metavar="JOB", help="Cancel this queued or running job.")
@command
def jobs(ctx: Ctx, cancel_id: str | None) -> None:
    """List training jobs, newest first (finished ones survive restarts)."""
    if cancel_id:
        answer = ctx.manage.delete(f"/train/{quote(cancel_id)}")
        if ctx.json:
            emit_json(answer)
        else:
            render.out.print(f"job {cancel_id} {answer['job']['state']}")
        return
    answer = ctx.manage.get("/train")
    if ctx.json:
        emit_json(answer)
    else:
        render.jobs(answer.get("jobs") or [])


@cli.command()
@click.argument("job_id", metavar="JOB")
@command
def logs(ctx: Ctx, job_id: str) -> None:
    """A job's epochs (or candidates), result or error, and its log tail."""
    answer = ctx.manage.get(f"/train/{quote(job_id)}")
    if ctx.json:
        emit_json(answer)
    else:
        render.job_log(answer["job"])


# -- models ------------------------------------------------------------------------
@cli.command()
@click.argument("name")
@click.argument("version", type=click.IntRange(min=1), required=False)
@click.option("--replicas", type=click.IntRange(min=1), help="Worker processes for it.")
@click.option("--no-default", is_flag=True, help="Serve it beside the default model.")
@click.option("--mode", type=click.Choice(["normal", "shadow", "canary"]), default="normal",
              show_default=True, help="normal: swap (the previous version stays loaded in "
              "probation); shadow: a copy of requests goes to it, answers compared and "
              "dropped; canary: it answers a share of requests.")
@click.option("--fraction", type=click.FloatRange(0.0, 1.0, min_open=True),
              help="Share of requests for a shadow or canary (default 1 and 0.1).")
@click.option("--no-gate", is_flag=True,
              help="Skip the quality gate (the golden set of `textswap golden`).")
@click.option("--min-accuracy", type=click.FloatRange(0.0, 1.0),
              help="Refuse the version below this golden-set accuracy.")
@command
def apply(ctx: Ctx, name: str, version: int | None, replicas: int | None,
          no_default: bool, mode: str, fraction: float | None, no_gate: bool,
          min_accuracy: float | None) -> None:
    """Serve model NAME (its latest version unless VERSION is given).

    A golden set registered with `textswap golden` gates the apply: a version
    that scores worse than the serving one is refused (exit 1).
    """
    if fraction is not None and mode == "normal":
        raise click.UsageError("--fraction needs --mode shadow or canary")
    body: dict[str, Any] = {"name": name, "version": version}
    if replicas is not None:  # sent only when given: older servers refuse unknown fields
        body["replicas"] = replicas
    if no_default:
        body["default"] = False
    if mode != "normal":
        body["mode"] = mode
    if fraction is not None:
        body["fraction"] = fraction
    if no_gate:
        body["gate"] = False
    if min_accuracy is not None:
        body["min_accuracy"] = min_accuracy
    answer = ctx.manage.post("/apply", body, timeout=max(ctx.manage.timeout, 300.0))
    if ctx.json:
        emit_json(answer)
    elif mode != "normal":
        render.candidate_started(answer)
    else:
        render.applied(answer)


def _needs_route(exc: CliError, what: str) -> CliError:
    if exc.missing_endpoint:
        return CliError(f"this server does not support {what} (it answered 404 for the "
                        "endpoint itself); upgrade the service", EXIT_REFUSED, exc.body,
                        exc.status)
    return exc


@cli.command()
@click.argument("name")
@command
def unload(ctx: Ctx, name: str) -> None:
    """Stop serving model NAME (its workers drain and exit)."""
    try:
        answer = ctx.manage.post("/unload", {"name": name})
    except CliError as exc:
        raise _needs_route(exc, "unload (POST /unload)") from None
    emit_json(answer) if ctx.json else render.out.print(f"unloaded {name}")


@cli.command()
@click.argument("name")
@command
def rollback(ctx: Ctx, name: str) -> None:
    """Serve the version of NAME that served before the current one."""
    try:
        answer = ctx.manage.post("/rollback", {"name": name},
                                 timeout=max(ctx.manage.timeout, 300.0))
    except CliError as exc:
        raise _needs_route(exc, "rollback (POST /rollback)") from None
    if ctx.json:
        emit_json(answer)
    else:
        how = "instantly (the previous version was still loaded)" if answer.get("instant") \
            else "by an apply"
        took = answer.get("took_s")
        render.out.print(f"rolled back {answer.get('name', name)} v{answer.get('from_version')}"
                         f" -> v{answer.get('to_version')} {how}"
                         + (f" in {took:.3f} s" if isinstance(took, (int, float)) else ""))


@cli.command()
@click.argument("name")
@click.option("--no-gate", is_flag=True, help="Skip the quality gate.")
@command
def promote(ctx: Ctx, name: str, no_gate: bool) -> None:
    """The shadow or canary candidate of NAME serves all requests."""
    body: dict[str, Any] = {"name": name}
    if no_gate:
        body["gate"] = False
    answer = ctx.manage.post("/promote", body, timeout=max(ctx.manage.timeout, 300.0))
    if ctx.json:
        emit_json(answer)
        return
    render.out.print(f"promoted {name} v{answer.get('to_version')} from {answer.get('mode')} "
                     f"(v{answer.get('from_version')} before; swap "
                     f"{render.secs(answer.get('swap_s'))})")
    render.candidate_figures(answer.get("figures"))
    render.gate(answer.get("gate"))


@cli.command()
@click.argument("name")
@command
def abort(ctx: Ctx, name: str) -> None:
    """Drop the shadow or canary candidate of NAME (its workers stop)."""
    answer = ctx.manage.post("/abort", {"name": name})
    if ctx.json:
        emit_json(answer)
        return
    render.out.print(f"aborted the {answer.get('mode')} of {name} "
                     f"v{answer.get('aborted_version')}")
    render.candidate_figures(answer.get("figures"))


@cli.command()
@click.argument("name")
@command
def rollout(ctx: Ctx, name: str) -> None:
    """Rollout state of NAME: probation, a shadow/canary candidate's figures,
    versions rolled back."""
    answer = ctx.manage.get(f"/rollouts/{quote(name)}")
    emit_json(answer) if ctx.json else render.rollout(answer)


@cli.command()
@click.option("--name", "name", help="Only this model's events.")
@click.option("--limit", type=click.IntRange(1, 1000), default=20, show_default=True,
              help="Newest events listed.")
@command
def history(ctx: Ctx, name: str | None, limit: int) -> None:
    """Applies, rollbacks, promotions, crashes... newest first (kept across restarts)."""
    query = f"?limit={limit}" + (f"&name={quote(name)}" if name else "")
    answer = ctx.manage.get("/history" + query)
    emit_json(answer) if ctx.json else render.history(answer.get("history") or [])


@cli.command()
@click.argument("name")
@click.argument("data", required=False)
@click.option("--min-accuracy", type=click.FloatRange(0.0, 1.0),
              help="Also refuse any version below this accuracy on the set.")
@click.option("--server-path", is_flag=True,
              help="DATA is a path on the server (under its data roots), not a local file.")
@click.option("--delete", "delete_", is_flag=True, help="Remove NAME's golden set.")
@command
def golden(ctx: Ctx, name: str, data: str | None, min_accuracy: float | None,
           server_path: bool, delete_: bool) -> None:
    """Register DATA (CSV or JSONL, as for train) as NAME's golden set: applies
    and promotions of NAME are refused when a version scores worse on it than
    the serving one. Without DATA: show the set."""
    path = f"/models/{quote(name)}/golden"
    if delete_:
        if data is not None:
            raise click.UsageError("--delete takes no DATA")
        answer = ctx.manage.delete(path)
        emit_json(answer) if ctx.json else render.out.print(f"golden set of {name} removed")
        return
    if data is None:
        if min_accuracy is not None or server_path:
            raise click.UsageError("--min-accuracy and --server-path need DATA")
        answer = ctx.manage.get(path)
    else:
        body: dict[str, Any] = {"data": {"path": data} if server_path
                                else {"examples": read_examples(data)}}
        if min_accuracy is not None:
            body["min_accuracy"] = min_accuracy
        answer = ctx.manage.put(path, body)
    emit_json(answer) if ctx.json else render.golden(answer.get("golden") or {})


@cli.command()
@command
def status(ctx: Ctx) -> None:
    """Models, workers, restarts and active jobs of the running service."""
    answer = ctx.manage.get("/status")
    emit_json(answer) if ctx.json else render.status(answer)


@cli.command()
@command
def models(ctx: Ctx) -> None:
    """Every model and version in the store, with its metrics."""
    answer = ctx.manage.get("/models")
    emit_json(answer) if ctx.json else render.models(answer)


@cli.command()
@click.argument("name")
@click.argument("version", type=click.IntRange(min=1))
@click.argument("directory", type=click.Path(file_okay=False))
@command
def export(ctx: Ctx, name: str, version: int, directory: str) -> None:
    """Download model NAME VERSION's portable artifact and unpack it into DIRECTORY."""
    if os.path.isdir(directory) and os.listdir(directory):
        raise InputError(f"{directory} exists and is not empty")
    path = f"/models/{quote(name)}/{version}/artifact"
    with tempfile.TemporaryFile() as tmp:
        try:
            size = ctx.manage.download(path, tmp, timeout=max(ctx.manage.timeout, 600.0))
        except CliError as exc:
            raise _needs_route(exc, "artifact export (GET /models/<name>/<version>/"
                                    "artifact)") from None
        tmp.seek(0)
        try:
            with tarfile.open(fileobj=tmp, mode="r:*") as tar:
                members = _strip_prefix(tar.getmembers(), f"{name}/{version}/")
                os.makedirs(directory, exist_ok=True)
                # the "data" filter refuses absolute paths, '..', links out, devices
                tar.extractall(directory, members=members, filter="data")
        except tarfile.TarError as exc:
            raise CliError(f"the artifact is not a valid .tar.gz archive: {exc}") from None
    files = sorted(m.name for m in members if m.isfile())
    if ctx.json:
        emit_json({"name": name, "version": version, "directory": os.path.abspath(directory),
                   "bytes": size, "files": files})
    else:
        render.out.print(f"{name} v{version}: {len(files)} files, {size} bytes -> {directory}")


def _strip_prefix(members: list[tarfile.TarInfo], prefix: str) -> list[tarfile.TarInfo]:
    """The archive names its members <name>/<version>/...: DIR gets what is inside."""
    if not all(m.name.startswith(prefix) or m.name == prefix.rstrip("/") for m in members):
        return members
    kept = []
    for m in members:
        m.name = m.name[len(prefix):]
        if m.name:
            kept.append(m)
    return kept


# -- predicting --------------------------------------------------------------------
@cli.command()
@click.argument("texts", nargs=-1)
@click.option("--model", help="Model name (default: the default model).")
@click.option("--top-k", type=click.IntRange(min=1), help="Ranked labels per text.")
@click.option("--batch-size", default=64, show_default=True, type=click.IntRange(1, 1024),
              help="Texts per request.")
@click.option("--explain", type=click.IntRange(1, 100), default=None,
              help="Give each prediction its N strongest n-grams (auto's linear models).")
@click.option("--min-score", type=click.FloatRange(0.0, 1.0), default=None,
              help="Abstain (label null) below this top score.")
@click.option("--table", is_flag=True,
              help="A table instead of JSON lines: each text with its label set "
                   "(a multi-label model's labels, else the top label).")
@command
def predict(ctx: Ctx, texts: tuple[str, ...], model: str | None, top_k: int | None,
            batch_size: int, explain: int | None, min_score: float | None,
            table: bool = False) -> None:
    """Classify TEXTS (or stdin, one text per line); one JSON line out per text.

    Output lines: {"text", "label", "score", "top", "model"}, in input order,
    plus "abstained" with --min-score, "explanation" with --explain and
    "labels" for a multi-label model.
    """
    stream = iter_texts(texts, click.get_text_stream("stdin"))
    count = 0
    while True:
        batch = list(itertools.islice(stream, batch_size))
        if not batch:
            break
        body: dict[str, Any] = {"texts": batch}
        if model:
            body["model"] = model
        if top_k:
            body["top_k"] = top_k
        if explain:
            body["explain"] = explain
        if min_score is not None:
            body["min_score"] = min_score
        answer = ctx.infer.post("/predict", body)
        if table:
            render.label_sets(answer, batch)
            count += len(batch)
            continue
        for text, p in zip(batch, answer["predictions"]):
            click.echo(json.dumps({"text": text, **p, "model": answer.get("model")},
                                  ensure_ascii=False))
        count += len(batch)
    if count == 0:
        raise InputError("no texts: give them as arguments or one per line on stdin")


loopcmds.register(cli, command, emit_json)  # feedback, review, policy (docs/loop.md)


def main() -> None:
    """Console-script entry point: click's errors keep click's codes (usage: 2),
    Ctrl-C anywhere exits 130."""
    try:
        rv = cli.main(standalone_mode=False)
    except click.exceptions.Abort:
        render.err.print("interrupted")
        sys.exit(EXIT_INTERRUPTED)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    sys.exit(rv if isinstance(rv, int) else EXIT_OK)
