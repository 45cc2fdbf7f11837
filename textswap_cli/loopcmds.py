"""The learning loop's commands (docs/loop.md): feedback, review, policy.

    textswap feedback REQUEST_ID LABEL [--index N]     one label
    textswap feedback REQUEST_ID --labels a,b,c        a whole batch, in order
    textswap feedback REQUEST_ID --label-set a,b [--index N]   a multi-label model: one text's set
    textswap feedback --file queue.csv                 a labelled review export
    textswap feedback --model NAME --file data.csv     labelled texts (no prediction)
    textswap review NAME [--limit 50] [--strategy uncertain|random] [--export queue.csv]
    textswap policy NAME [--retrain-after N] [--apply gate|canary|swap|none] [--min-score X]

POST /feedback is on the inference port and takes the feedback key:
TEXTSWAP_FEEDBACK_KEY (or TEXTSWAP_FEEDBACK_TOKEN), else a local service's
key file (client.find_key).
"""
from __future__ import annotations

import csv
import io
from typing import Any

import click

from textswap_cli import render
from textswap_cli.client import EXIT_REFUSED, Api, CliError, find_key, quote
from textswap_cli.data import InputError, read_examples

EXPORT_COLUMNS = ["request_id", "index", "text", "predicted", "score", "label"]


def _feedback_api(ctx: Any) -> Api:
    return Api(ctx.infer.base, find_key("feedback", ctx.infer.base, keys_file=ctx.keys_file),
               ctx.infer.timeout)


def _read_queue(path: str) -> list[dict[str, str]]:
    """Rows of a review export with the 'label' column filled in (blank: skipped)."""
    try:
        with open(path, encoding="utf-8-sig", newline="") as fh:
            text = fh.read()
    except OSError as exc:
        raise InputError(f"cannot read {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise InputError(f"{path} is not UTF-8") from None
    reader = csv.DictReader(io.StringIO(text, newline=""))
    cols = set(reader.fieldnames or [])
    if not {"request_id", "label"} <= cols:
        raise InputError(f"{path} needs the columns request_id and label (as `textswap "
                         f"review --export` writes them); it has {sorted(cols)}")
    rows = []
    for n, row in enumerate(reader, 2):
        if not (row.get("label") or "").strip():
            continue
        if not (row.get("request_id") or "").strip():
            raise InputError(f"{path} line {n}: no request_id")
        idx = (row.get("index") or "0").strip() or "0"
        if not idx.isdigit():
            raise InputError(f"{path} line {n}: index {idx!r} is not a number")
        rows.append({"request_id": row["request_id"].strip(), "index": int(idx),
                     "label": row["label"].strip()})
    return rows


def register(cli: Any, command: Any, emit_json: Any) -> None:
    """Add feedback, review and policy to the `textswap` group (textswap_cli/main.py
    calls it; this module does not import main, so no import circle)."""
    Ctx = Any  # noqa: N806  the command's context object (main.Ctx)

    @cli.command()
    @click.argument("request_id", required=False)
    @click.argument("label", required=False)
    @click.option("--index", type=click.IntRange(min=0), help="The text's place in a batch.")
    @click.option("--labels", help="Comma-separated labels for the whole batch, in order.")
    @click.option("--label-set", "label_set",
                  help="A multi-label model: one text's label set, comma-separated ('' for "
                       "none of the labels).")
    @click.option("--file", "file_", type=click.Path(dir_okay=False),
                  help="A labelled review export (CSV), or with --model labelled texts.")
    @click.option("--model", help="With --file: texts and labels for this model (no prediction).")
    @command
    def feedback(ctx: Ctx, request_id: str | None, label: str | None, index: int | None,
                 labels: str | None, label_set: str | None, file_: str | None,
                 model: str | None) -> None:
        """Send true labels back (POST /feedback): they become training data."""
        api = _feedback_api(ctx)
        if file_ is not None:
            if request_id or label or labels or label_set is not None or index is not None:
                raise click.UsageError("--file takes no REQUEST_ID, LABEL, --labels, "
                                       "--label-set or --index")
            if model is not None:
                examples = read_examples(file_)
                answers = [api.post("/feedback", {"model": model,
                                                  "examples": examples[i:i + 500]})
                           for i in range(0, len(examples), 500)]
                stored = sum(a["stored"] for a in answers)
                new = sorted({x for a in answers for x in a.get("new_labels", [])})
                out = {"stored": stored, "new_labels": new}
            else:
                rows = _read_queue(file_)
                stored, failed, new = 0, [], set()
                for row in rows:
                    try:
                        a = api.post("/feedback", row)
                    except CliError as exc:
                        failed.append({**row, "error": str(exc)})
                        continue
                    stored += a["stored"]
                    for i in a["items"]:  # multi-label models answer "labels", "new_labels"
                        if i.get("new_label"):
                            new.update(i["new_labels"] if "new_labels" in i else [i["label"]])
                out = {"stored": stored, "new_labels": sorted(new), "failed": failed}
            if ctx.json:
                emit_json(out)
            else:
                render.out.print(f"{out['stored']} label(s) stored"
                                 + (f"; new labels: {', '.join(out['new_labels'])}"
                                    if out["new_labels"] else ""))
                for f in out.get("failed", []):
                    render.err.print(f"[red]failed:[/] {f['request_id']}#{f['index']}: "
                                     f"{render.rich_escape(f['error'])}", highlight=False)
            if out.get("failed"):
                raise SystemExit(EXIT_REFUSED)
            return
        if model is not None:
            raise click.UsageError("--model goes with --file")
        given = sum(x is not None for x in (label, labels, label_set))
        if request_id is None or given != 1:
            raise click.UsageError("give REQUEST_ID and LABEL, REQUEST_ID --labels a,b,..., "
                                   "REQUEST_ID --label-set a,b, or --file")
        body: dict[str, Any] = {"request_id": request_id}
        if label_set is not None:
            body["labels"] = [x.strip() for x in label_set.split(",") if x.strip()]
            if index is not None:
                body["index"] = index
        elif labels is not None:
            if index is not None:
                raise click.UsageError("--index goes with LABEL, not --labels")
            body["labels"] = [x.strip() for x in labels.split(",")]
        else:
            body["label"] = label
            if index is not None:
                body["index"] = index
        answer = api.post("/feedback", body)
        if ctx.json:
            emit_json(answer)
            return
        for item in answer["items"]:
            got, predicted = item.get("label", item.get("labels")), item["predicted"]
            if isinstance(got, list):  # a multi-label model's label sets
                got, predicted = ", ".join(got) or "(none)", ", ".join(predicted) or "(none)"
            render.out.print(f"{item['request_id']}#{item['index']}: {got} (predicted "
                             f"{predicted})" + (" [new label]" if item["new_label"] else ""))


    @cli.command()
    @click.argument("name")
    @click.option("--limit", type=click.IntRange(1, 1000), default=50, show_default=True)
    @click.option("--strategy", type=click.Choice(["uncertain", "random"]), default="uncertain",
                  show_default=True)
    @click.option("--export", "export_", type=click.Path(dir_okay=False),
                  help="Write the queue as CSV (fill in 'label', send with feedback --file).")
    @command
    def review(ctx: Ctx, name: str, limit: int, strategy: str, export_: str | None) -> None:
        """Logged predictions of NAME with no feedback yet, least certain first."""
        answer = ctx.manage.get(f"/models/{quote(name)}/review?limit={limit}&strategy={strategy}")
        items = answer["items"]
        if export_ is not None:
            with open(export_, "w", encoding="utf-8", newline="") as fh:
                w = csv.writer(fh)
                w.writerow(EXPORT_COLUMNS)
                for it in items:
                    w.writerow([it["request_id"], it["index"], it["text"], it["label"],
                                "" if it.get("score") is None else f"{it['score']:.4f}", ""])
            if not ctx.json:
                render.out.print(f"{len(items)} item(s) written to {export_}; fill in 'label' and "
                                 f"send them with `textswap feedback --file {export_}`")
        if ctx.json:
            emit_json(answer)
        elif export_ is None:
            from rich.table import Table
            t = Table("request_id", "#", "predicted", "score", "text")
            for it in items:
                t.add_row(it["request_id"], str(it["index"]), str(it["label"]),
                          "" if it.get("score") is None else f"{it['score']:.3f}",
                          render.rich_escape(it["text"][:80]))
            render.out.print(t)


    @cli.command()
    @click.argument("name")
    @click.option("--retrain-after", type=click.IntRange(min=1),
                  help="Retrain (feedback folded in) after this many new labels.")
    @click.option("--apply", "apply_", type=click.Choice(["gate", "canary", "swap", "none"]),
                  help="What to do with the retrained version.")
    @click.option("--min-score", type=click.FloatRange(0.0, 1.0, min_open=True),
                  help="Default abstain threshold of /predict for NAME.")
    @click.option("--delete", "delete_", is_flag=True, help="Remove NAME's stored policy.")
    @command
    def policy(ctx: Ctx, name: str, retrain_after: int | None, apply_: str | None,
               min_score: float | None, delete_: bool) -> None:
        """Show or set NAME's retrain policy."""
        path = f"/models/{quote(name)}/policy"
        if delete_:
            answer = ctx.manage.delete(path)
        elif retrain_after is None and apply_ is None and min_score is None:
            answer = ctx.manage.get(path)
        else:
            body: dict[str, Any] = {k: v for k, v in (("retrain_after_labels", retrain_after),
                                                      ("apply", apply_), ("min_score", min_score))
                                    if v is not None}
            answer = ctx.manage.put(path, body)
        if ctx.json:
            emit_json(answer)
        else:
            p = answer.get("policy")
            render.out.print(f"{name}: " + ("no policy" if not p else ", ".join(
                f"{k} {v}" for k, v in p.items())) + (f" (from {answer['source']})"
                                                       if answer.get("source") else ""))
