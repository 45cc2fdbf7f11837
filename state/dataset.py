"""Training data: read, check and normalise it before any process starts.

A /train request names its data one of two ways:
    {"path": "file.jsonl" | "file.csv"}   a UTF-8 file on the server's disk,
                                          under one of the configured data roots
    {"examples": [{"text": ..., "label": ...}, ...]}   inline
plus, optionally, "labels": [...] to declare the label set (then a declared
label without examples, or an example with an undeclared label, is an error).

Multi-label data (several labels per text): JSONL/inline rows with
"labels": [...] instead of "label", or a CSV `labels` column split on
"label_separator" (default "|"). Every row then gives a non-empty label set;
a row with "label" among them is an error (one convention per data set).

The request's own "labels" (beside "data", not in it) describes each label:
{"<label>": "<description>"} (check_descriptions); without data it is a
zero-shot training's data, one row per label (from_descriptions), with data
one more example per label (add_descriptions).

Everything that can be known up front is checked here, in the supervisor,
so the caller gets a 400 naming the problem instead of a failed job later.
Imports no TensorFlow.
"""
from __future__ import annotations

import collections
import csv
import hashlib
import io
import json
import os
from dataclasses import dataclass, field
from typing import Any

MAX_EXAMPLES = 2_000_000
MAX_FILE_BYTES = 1 << 30
MAX_TEXT_CHARS = 20_000
# A label may have a single example: it trains, always on the training side of
# cross-validation and of the validation split (it is never tested), and the
# job's data summary and the training report warn about it. At least one label
# needs CV_MIN_PER_LABEL examples, so that cross-validation has a test side.
MIN_PER_LABEL = 1
CV_MIN_PER_LABEL = 2
# A label that only feedback brings becomes a class from this many fed-back
# texts on (one wrong click does not create a class).
NEW_LABEL_MIN = 2
DEFAULT_SEPARATOR = "|"  # CSV `labels` column: "a|b|c"


class DataError(ValueError):
    pass


@dataclass
class Dataset:
    texts: list[str]
    labels: list[Any]  # a label per text; multi-label: a sorted list of labels per text
    source: str
    counts: dict[str, int] = field(default_factory=dict)  # multi-label: texts per label
    multi_label: bool = False

    @property
    def sha256(self) -> str:
        h = hashlib.sha256()
        for t, lab in zip(self.texts, self.labels):
            h.update(json.dumps([t, lab], ensure_ascii=False).encode())
            h.update(b"\n")
        return h.hexdigest()

    def write_jsonl(self, path: str) -> None:
        key = "labels" if self.multi_label else "label"
        with open(path, "w", encoding="utf-8") as fh:
            for t, lab in zip(self.texts, self.labels):
                fh.write(json.dumps({"text": t, key: lab}, ensure_ascii=False) + "\n")

    def single_example_labels(self) -> list[str]:
        """Labels with one example: trained on, never tested (kept out of the
        CV folds' test sides and of the validation split)."""
        return [k for k, v in self.counts.items() if v == 1]

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"source": self.source, "examples": len(self.texts),
                               "label_counts": self.counts, "sha256": self.sha256}
        single = self.single_example_labels()
        if single:
            out["single_example_labels"] = single
            out["warnings"] = [single_example_warning(single)]
        if self.multi_label:
            out["multi_label"] = True
            out["labels_per_text"] = round(sum(map(len, self.labels)) / max(1, len(self.labels)), 3)
        return out


SAMPLE_VALUES = 5  # label values a message shows at most
SAMPLE_CHARS = 40  # of each, at most this many characters


def sample(values: Any) -> str:
    """A short, escaped sample of values from a data file for a message: the
    first few, each cut and quoted with its control characters escaped, and
    how many more there are (a file's labels may be long or hostile)."""
    values = list(values)
    shown = []
    for x in values[:SAMPLE_VALUES]:
        text = str(x)
        cut = text[:SAMPLE_CHARS]
        quoted = repr(cut)  # control characters escaped
        shown.append(quoted[:-1] + ("..." if len(text) > SAMPLE_CHARS else "") + quoted[-1])
    more = len(values) - SAMPLE_VALUES
    return ", ".join(shown) + (f" and {more} more" if more > 0 else "")


def single_example_warning(labels: list[str]) -> str:
    """The warning of the job's data summary and the training report."""
    shown = sample(labels)
    return (f"{len(labels)} label(s) with a single example ({shown}): trained on, never "
            f"tested (kept on the training side of every cross-validation fold), so the "
            f"reported metrics say nothing about them; add examples")


def _check_counts(counts: dict[str, int], when: str = "") -> None:
    """At least two labels, and one of them with CV_MIN_PER_LABEL examples."""
    if len(counts) < 2:
        raise DataError(f"{when}need at least two labels; the data has "
                        f"{sample(counts) or 'none'}")
    if max(counts.values()) < CV_MIN_PER_LABEL:
        raise DataError(f"{when}every label has a single example: at least one label needs "
                        f"{CV_MIN_PER_LABEL} examples (cross-validation tests on them)")


def resolve_path(path: Any, roots: list[str]) -> str:
    """The real path of a data file, only if it lies under one of the roots;
    a relative path is read from the first root."""
    if not isinstance(path, str) or not path.strip():
        raise DataError("'data.path' must be a non-empty string")
    if "\x00" in path:
        raise DataError("'data.path' contains a NUL character")
    if not path.isascii():
        try:
            path.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate (a JSON "\ud800" escape)
            raise DataError("'data.path' contains an unpaired surrogate, which is not "
                            "valid Unicode") from None
    real = os.path.realpath(os.path.join(roots[0], path) if roots else path)
    for root in roots:
        root_real = os.path.realpath(root)
        if real == root_real or real.startswith(root_real.rstrip(os.sep) + os.sep):
            break
    else:
        raise DataError(f"'data.path' {path!r} is outside the allowed data folders "
                        f"({', '.join(roots)}); see training.data_roots in config.yaml")
    if not os.path.exists(real):
        raise DataError(f"data file {path!r} does not exist")
    if not os.path.isfile(real):
        raise DataError(f"data path {path!r} is not a regular file")
    size = os.path.getsize(real)
    if size > MAX_FILE_BYTES:
        raise DataError(f"data file is {size} bytes; the limit is {MAX_FILE_BYTES}")
    return real


def _rows_jsonl(text: str) -> list[tuple[int, Any]]:
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append((n, json.loads(line)))
        except ValueError as exc:
            raise DataError(f"line {n}: not valid JSON ({exc})") from None
    return rows


def _rows_csv(text: str, delimiter: str, separator: str = DEFAULT_SEPARATOR) -> list[tuple[int, Any]]:
    reader = csv.DictReader(io.StringIO(text, newline=""), delimiter=delimiter)
    names = {f.strip() for f in reader.fieldnames or [] if f}
    if "text" not in names or len({"label", "labels"} & names) != 1:
        # the header's own words are not echoed: the file may not be data at all
        raise DataError(f"CSV header must name the columns 'text' and 'label' (or 'labels', "
                        f"several labels per text split on {separator!r}); its first line has "
                        f"{len(reader.fieldnames or [])} column(s), "
                        f"{'with' if 'text' in names else 'without'} 'text', "
                        f"{'with' if {'label', 'labels'} & names else 'without'} 'label(s)'")
    multi = "labels" in names
    try:
        rows = [(n + 2, {k.strip() if k else k: v for k, v in row.items()})
                for n, row in enumerate(reader)]
    except csv.Error as exc:
        raise DataError(f"CSV error: {exc}") from None
    if multi:  # "a|b" -> ["a", "b"]; a missing cell stays None (reported as missing)
        for _, row in rows:
            if isinstance(row.get("labels"), str):
                row["labels"] = row["labels"].split(separator)
    return rows


def read_file(path: str, separator: str = DEFAULT_SEPARATOR) -> list[tuple[int, Any]]:
    with open(path, "rb") as fh:
        raw = fh.read()
    if raw.startswith(b"\xef\xbb\xbf"):
        raw = raw[3:]
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(f"data file is not UTF-8 (byte {exc.start}: {exc.reason})") from None
    ext = os.path.splitext(path)[1].lower()
    if ext in (".jsonl", ".ndjson", ".json"):
        return _rows_jsonl(text)
    if ext in (".csv", ".tsv"):
        return _rows_csv(text, "\t" if ext == ".tsv" else ",", separator)
    if text.lstrip().startswith("{"):
        return _rows_jsonl(text)
    return _rows_csv(text, ",", separator)


def _label_set(at: str, value: Any) -> list[str]:
    """A multi-label row's labels: stripped, distinct, sorted; 400 when bad."""
    if not isinstance(value, list):
        raise DataError(f"{at}: 'labels' must be a list of strings")
    out = set()
    for label in value:
        if isinstance(label, bool) or not isinstance(label, (str, int)):
            raise DataError(f"{at}: each of 'labels' must be a string (or an integer)")
        label = str(label).strip()
        if not label:
            raise DataError(f"{at}: 'labels' has an empty label")
        out.add(label)
    if not out:
        raise DataError(f"{at}: 'labels' is empty: every text needs at least one label")
    return sorted(out)


def check_examples(rows: list[tuple[int, Any]], source: str,
                   declared: list[str] | None = None, partial: bool = False) -> Dataset:
    if not rows:
        raise DataError("the data has no examples")
    if len(rows) > MAX_EXAMPLES:
        raise DataError(f"{len(rows)} examples; the limit is {MAX_EXAMPLES}")
    texts: list[str] = []
    labels: list[Any] = []  # a label per text, or a label set per text
    label: Any
    first = rows[0][1]
    multi = isinstance(first, dict) and "labels" in first and "label" not in first
    key = "labels" if multi else "label"
    for where, row in rows:
        at = f"example {where}" if source == "inline" else f"line {where}"
        if not isinstance(row, dict):
            raise DataError(f"{at}: must be an object with 'text' and '{key}'")
        other = "label" if multi else "labels"
        if other in row and row.get(other) is not None:
            raise DataError(f"{at}: has '{other}' where the data's first row has '{key}': give "
                            f"every row 'label' (one label) or every row 'labels' (a list)")
        text, label = row.get("text"), row.get(key)
        if text is None or label is None:
            raise DataError(f"{at}: missing field '{'text' if text is None else key}'")
        if not isinstance(text, str):
            raise DataError(f"{at}: 'text' must be a string")
        if multi:
            label = _label_set(at, label)
        else:
            if isinstance(label, bool) or not isinstance(label, (str, int)):
                raise DataError(f"{at}: 'label' must be a string (or an integer)")
            label = str(label).strip()
        if not text.strip():
            raise DataError(f"{at}: 'text' is empty")
        if not label:
            raise DataError(f"{at}: 'label' is empty")
        if len(text) > MAX_TEXT_CHARS:
            raise DataError(f"{at}: text has {len(text)} characters; the limit is "
                            f"{MAX_TEXT_CHARS}")
        try:
            text.encode("utf-8")
            for one in (label if multi else [label]):
                one.encode("utf-8")
        except UnicodeEncodeError:
            raise DataError(f"{at}: contains an unpaired surrogate, not valid Unicode") from None
        texts.append(text)
        labels.append(label)
    tally = collections.Counter(x for one in labels for x in one) if multi else collections.Counter(labels)
    counts = dict(sorted(tally.items()))
    if declared is not None:
        if not isinstance(declared, list) or not all(isinstance(x, str) for x in declared):
            raise DataError("'data.labels' must be a list of distinct strings")
        declared = [x.strip() for x in declared]  # compared with stripped example labels
        if not all(declared):
            raise DataError("'data.labels' has an empty label")
        if len(set(declared)) != len(declared):
            raise DataError("'data.labels' must be a list of distinct strings")
        missing = [x for x in declared if x not in counts]
        if missing:
            raise DataError(f"{len(missing)} declared label(s) have no examples: "
                            f"{sample(missing)}")
        extra = [x for x in counts if x not in declared]
        if extra:
            raise DataError(f"examples use {len(extra)} undeclared label(s): {sample(extra)}")
    if not partial:
        _check_counts(counts)
    return Dataset(texts, labels, source, counts, multi)


# -- label descriptions: zero-shot versions, or one extra example per label ---------------
MAX_DESCRIBED_LABELS = 1000
MAX_DESCRIPTION_CHARS = 2000


def check_descriptions(value: Any) -> dict[str, str]:
    """The 'labels' field of a /train request: {label: description}, 2 to
    MAX_DESCRIBED_LABELS labels, both non-empty strings (stripped); DataError."""
    if not isinstance(value, dict):
        raise DataError("'labels' must be an object: {\"<label>\": \"<description>\", ...}")
    if not 2 <= len(value) <= MAX_DESCRIBED_LABELS:
        raise DataError(f"'labels' must describe between 2 and {MAX_DESCRIBED_LABELS} labels; "
                        f"it has {len(value)}")
    out: dict[str, str] = {}
    for label, description in value.items():
        name = label.strip()
        if not name:
            raise DataError("'labels' has an empty label")
        if not isinstance(description, str) or not description.strip():
            raise DataError(f"'labels': the description of {name[:80]!r} must be a non-empty "
                            f"string")
        if not any(ch.isalnum() for ch in description):
            raise DataError(f"'labels': the description of {name[:80]!r} has no word (only "
                            f"punctuation or symbols)")
        if len(description) > MAX_DESCRIPTION_CHARS:
            raise DataError(f"'labels': the description of {name[:80]!r} has "
                            f"{len(description)} characters; the limit is "
                            f"{MAX_DESCRIPTION_CHARS}")
        try:
            name.encode("utf-8")
            description.encode("utf-8")
        except UnicodeEncodeError:
            raise DataError("'labels' contains an unpaired surrogate, not valid Unicode") from None
        if name in out:
            raise DataError(f"'labels' names {name[:80]!r} twice (labels are compared "
                            f"after trimming spaces)")
        out[name] = description.strip()
    return out


def from_descriptions(descriptions: dict[str, str]) -> Dataset:
    """A zero-shot job's data: one row per label, its description as the text
    (control/jobs.py; model_worker/zeroshot.py embeds them)."""
    names = sorted(descriptions)
    return Dataset([descriptions[n] for n in names], names, "descriptions", {n: 1 for n in names})


def add_descriptions(data: Dataset, descriptions: dict[str, str]) -> Dataset:
    """The data with each description as one more example of its label (a label
    that only a description names becomes a single-example label)."""
    texts, labels = list(data.texts), list(data.labels)
    for name in sorted(descriptions):
        texts.append(descriptions[name])
        labels.append([name] if data.multi_label else name)
    tally = (collections.Counter(x for one in labels for x in one) if data.multi_label
             else collections.Counter(labels))
    return Dataset(texts, labels, data.source, dict(sorted(tally.items())), data.multi_label)


def load(spec: Any, roots: list[str], partial: bool = False) -> Dataset:
    """Read and check the 'data' field of a /train request. partial: the label
    counts are checked later (merge_feedback folds feedback in first)."""
    if not isinstance(spec, dict):
        raise DataError("'data' must be an object: {\"path\": ...} or {\"examples\": [...]}")
    unknown = set(spec) - {"path", "examples", "labels", "label_separator"}
    if unknown:
        raise DataError(f"unknown field(s) in 'data': {sorted(unknown)}")
    if ("path" in spec) == ("examples" in spec):
        raise DataError("'data' needs exactly one of 'path' or 'examples'")
    declared = spec.get("labels")
    separator = spec.get("label_separator", DEFAULT_SEPARATOR)
    if not isinstance(separator, str) or not separator or separator.strip() != separator or (
            separator in (",", "\t", '"', "\n", "\r")):
        raise DataError("'data.label_separator' must be a non-empty string without blanks at "
                        "its ends, other than the CSV's own delimiter or quote (default '|')")
    if "examples" in spec:
        examples = spec["examples"]
        if not isinstance(examples, list):
            raise DataError("'data.examples' must be a list of {\"text\", \"label\"} "
                            "(or {\"text\", \"labels\": [...]}) objects")
        return check_examples(list(enumerate(examples)), "inline", declared, partial)
    path = resolve_path(spec["path"], roots)
    return check_examples(read_file(path, separator), path, declared, partial)


# -- feedback labels: one label, or a label set stored as one string ------------------------
def encode_label_set(labels: Any) -> str:
    """A label set as the prediction log's `label` text: the JSON of the sorted
    distinct list, e.g. '["a","b"]' ('[]': the text has no label)."""
    return json.dumps(sorted({str(x) for x in labels}), ensure_ascii=False,
                      separators=(",", ":"))


def is_label_set(value: Any) -> bool:
    """Whether a stored label is an encoded label set (only the canonical form is)."""
    return isinstance(decode_truth(value), list)


def decode_truth(value: Any) -> Any:
    """A stored feedback label: a list (sorted, distinct) for an encoded label
    set, else the value itself (one label, a plain string). Only the canonical
    encoding decodes, so a single label that merely starts with '[' stays one."""
    if not (isinstance(value, str) and value.startswith("[") and value.endswith("]")):
        return value
    try:
        parsed = json.loads(value)
    except ValueError:
        return value
    if (isinstance(parsed, list) and all(isinstance(x, str) for x in parsed)
            and encode_label_set(parsed) == value):
        return parsed
    return value


def merge_feedback(data: Dataset, examples: list[tuple[str, str]]) -> tuple[Dataset, dict[str, Any]]:
    """The training data with fed-back labels folded in (docs/loop.md): a text in
    both keeps the feedback's label (or label set); a label that the data lacks
    becomes a class once it has NEW_LABEL_MIN examples (until then its rows wait,
    reported). Labels are stored as the prediction log keeps them: one label a
    plain string, a label set encoded (encode_label_set). One label per text does
    not fold into multi-label data, nor a label set into single-label data."""
    decoded = [(text, decode_truth(label)) for text, label in examples]
    sets = sum(isinstance(lab, list) for _, lab in decoded)
    if data.multi_label and sets < len(decoded):
        raise DataError("feedback with one label per text cannot be folded into multi-label "
                        "training data: a multi-label model takes label sets ('labels': [...]); "
                        "train without 'feedback'")
    if not data.multi_label and sets:
        raise DataError(f"{sets} feedback label set(s) cannot be folded into single-label "
                        "training data (one label per text); train without 'feedback'")
    if data.multi_label:
        return _merge_sets(data, decoded)
    known = set(data.counts)
    fed: dict[str, str] = {}
    for text, label in decoded:
        label = str(label).strip()
        if text and text.strip() and label and len(text) <= MAX_TEXT_CHARS:
            fed[text] = label
    new_counts = collections.Counter(lab for lab in fed.values() if lab not in known)
    waiting = {lab for lab, n in new_counts.items() if n < NEW_LABEL_MIN}
    fed = {t: lab for t, lab in fed.items() if lab not in waiting}
    texts, labels, replaced, overlap = [], [], 0, 0
    for t, lab in zip(data.texts, data.labels):
        if t in fed:
            overlap += 1
            replaced += fed[t] != lab
            continue  # the feedback row below stands for it
        texts.append(t)
        labels.append(lab)
    for t, lab in fed.items():
        texts.append(t)
        labels.append(lab)
    counts = dict(sorted(collections.Counter(labels).items()))
    _check_merged(counts)
    new_labels = sorted(lab for lab in new_counts if lab not in waiting)
    summary = {"rows": len(fed), "new_label_rows": sum(new_counts[lab] for lab in new_labels),
               "new_labels": new_labels, "relabelled": replaced,
               "added": len(fed) - min(overlap, len(fed)),
               "waiting": {lab: new_counts[lab] for lab in sorted(waiting)}}
    return Dataset(texts, labels, data.source, counts), summary


def _check_merged(counts: dict[str, int]) -> None:
    _check_counts(counts, "with the feedback folded in: ")


def _merge_sets(data: Dataset, decoded: list[tuple[str, Any]]) -> tuple[Dataset, dict[str, Any]]:
    """merge_feedback for multi-label data: label sets per text. A fed-back empty
    set (the text has no label) takes the text out of the training data: every
    training text needs a label (check_examples); it is counted as
    `no_label_rows`. A new label with fewer than NEW_LABEL_MIN texts waits: it is
    left out of the sets (a set left empty leaves its text out too)."""
    known = set(data.counts)
    fed: dict[str, list[str]] = {}
    for text, labels in decoded:
        labels = sorted({str(x).strip() for x in labels} - {""})
        if text and text.strip() and len(text) <= MAX_TEXT_CHARS:
            fed.pop(text, None)
            fed[text] = labels
    new_counts = collections.Counter(x for labs in fed.values() for x in labs if x not in known)
    waiting = {lab for lab, n in new_counts.items() if n < NEW_LABEL_MIN}
    no_label = sum(1 for labs in fed.values() if not labs)
    kept = {t: [x for x in labs if x not in waiting] for t, labs in fed.items()}
    texts, labels, replaced, overlap = [], [], 0, 0
    for t, labs in zip(data.texts, data.labels):
        if t in fed:
            overlap += 1
            replaced += kept[t] != sorted(labs)
            continue  # the feedback row below stands for it (or takes it out)
        texts.append(t)
        labels.append(list(labs))
    rows, present = 0, set(data.texts)
    for t, labs in kept.items():
        if labs:
            texts.append(t)
            labels.append(labs)
            rows += 1
    counts = dict(sorted(collections.Counter(x for labs in labels for x in labs).items()))
    _check_merged(counts)
    new_labels = sorted(lab for lab in new_counts if lab not in waiting)
    summary = {"rows": rows, "multi_label": True,
               "new_label_rows": sum(1 for labs in kept.values() if set(labs) & set(new_labels)),
               "new_labels": new_labels, "relabelled": replaced,
               "added": sum(1 for t, labs in kept.items() if labs and t not in present),
               "no_label_rows": no_label,
               "waiting": {lab: new_counts[lab] for lab in sorted(waiting)}}
    return Dataset(texts, labels, data.source, counts, True), summary
