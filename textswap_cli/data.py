"""Client-side input: training files read here and sent inline, and --param values.

`textswap train` reads DATA on the caller's machine, so it works against a
remote service. Only the shape is checked here (UTF-8, a text and a label per
row); the service checks the rest (labels, counts, lengths) and says what is
wrong, so the two never disagree on what is valid.
"""
from __future__ import annotations

import csv
import io
import json
import os
from typing import Any, Iterator


class InputError(ValueError):
    """Local input the command cannot use (exit code 2)."""


def read_examples(path: str) -> list[dict[str, Any]]:
    """[{"text", "label"}, ...] from a CSV/TSV (header text,label) or JSONL file."""
    try:
        with open(path, "rb") as fh:
            raw = fh.read()
    except OSError as exc:
        raise InputError(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise InputError(f"{path} is not UTF-8 (byte {exc.start}: {exc.reason})") from None
    ext = os.path.splitext(path)[1].lower()
    if ext in (".jsonl", ".ndjson", ".json") or (
            ext not in (".csv", ".tsv") and text.lstrip().startswith("{")):
        rows = _jsonl(text, path)
    else:
        rows = _csv(text, path, "\t" if ext == ".tsv" else ",")
    if not rows:
        raise InputError(f"{path} has no examples")
    return rows


def read_descriptions(path: str) -> dict[str, Any]:
    """{"<label>": "<description>", ...} from a JSON file (POST /train's "labels");
    the service checks the labels and descriptions themselves."""
    try:
        with open(path, "rb") as fh:
            raw = fh.read()
    except OSError as exc:
        raise InputError(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        value = json.loads(raw.decode("utf-8-sig"))
    except UnicodeDecodeError as exc:
        raise InputError(f"{path} is not UTF-8 (byte {exc.start}: {exc.reason})") from None
    except ValueError as exc:
        raise InputError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise InputError(f"{path}: expected a JSON object {{\"<label>\": \"<description>\", ...}}")
    return value


def _jsonl(text: str, path: str) -> list[dict[str, Any]]:
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as exc:
            raise InputError(f"{path} line {n}: not valid JSON ({exc})") from None
        if not isinstance(row, dict):
            raise InputError(f"{path} line {n}: expected an object with 'text' and 'label'")
        # pass the two fields on as they are; the service judges their values
        rows.append({k: row.get(k) for k in ("text", "label")})
    return rows


def _csv(text: str, path: str, delimiter: str) -> list[dict[str, Any]]:
    reader = csv.DictReader(io.StringIO(text, newline=""), delimiter=delimiter)
    fields = {(f or "").strip(): f for f in reader.fieldnames or []}
    if "text" not in fields or "label" not in fields:
        raise InputError(f"{path}: the header must name the columns 'text' and 'label' "
                         f"(got {reader.fieldnames})")
    try:
        return [{"text": row[fields["text"]], "label": (row[fields["label"]] or "").strip()}
                for row in reader]
    except csv.Error as exc:
        raise InputError(f"{path}: CSV error: {exc}") from None


def parse_params(pairs: tuple[str, ...]) -> dict[str, Any]:
    """--param k=v ...: numbers and true/false/null as JSON, anything else a string."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise InputError(f"--param {pair!r}: expected KEY=VALUE, e.g. epochs=10")
        try:
            out[key.strip()] = json.loads(value)
        except ValueError:
            out[key.strip()] = value
    return out


def iter_texts(args: tuple[str, ...], stdin: Any) -> Iterator[str]:
    """Texts from the arguments, else one per non-empty stdin line, as they arrive."""
    if args:
        yield from args
        return
    for line in stdin:
        if line.strip():
            yield line.rstrip("\r\n")
