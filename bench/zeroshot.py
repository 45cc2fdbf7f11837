"""Zero-shot versions from label descriptions on an English development set (issue 28).

    .venv/bin/python bench/zeroshot.py                  # debian_en, the 100-text point too
    .venv/bin/python bench/zeroshot.py --no-curve-point # zero-shot figures only

On debian_en's fixed test split (bench/datasets.py; 10 archive sections), with
the one-line descriptions below (written for this bench from the section
names, not tuned on the test texts):
  zero-shot     the served graph of model_worker/zeroshot.py (word table,
                StringLookup, Embeddings), as a /train with "labels" and no data
                trains it
  cosine rule   the same rule computed directly in NumPy from the package's own
                tokenizer on whole texts: mean subword vector of the text, cosine
                to each description's, argmax (the figure the issue measured from
                outside); the two should agree (the word table drops punctuation
                and case, which the package keeps)
  names only    zero-shot with each label's name as its description
  auto@100 / tfidf-svc@100
                auto (pretrained view allowed) and TF-IDF + LinearSVC trained on
                100 labelled texts of the training split (bench/accuracy.py
                --curve's subsample), the learning curve's first point
Also printed: the expected calibration error of the zero-shot scores at the
fixed temperature, and the temperature that would minimise it on this test set
(for information only: the served temperature is fixed, there are no labels
to fit it on). Results go to bench/.cache/zeroshot.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

SET = "debian_en"
DESCRIPTIONS = {
    "admin": "system administration: users, backups, disks, boot, logs, monitoring, servers",
    "devel": "software development: compilers, programming languages, debuggers, build tools",
    "games": "games to play: arcade, puzzle, strategy, board and card games, players, levels",
    "graphics": "graphics: images, pictures, photos, drawing, rendering, 3D, image formats",
    "net": "networking: network protocols, servers, clients, connections, DNS, IP, VPN",
    "science": "science: mathematics, physics, chemistry, biology, astronomy, data analysis",
    "sound": "sound and music: audio players, MIDI, recording, synthesizers, speakers",
    "text": "text processing: editors, documents, fonts, dictionaries, spelling, formatting",
    "utils": "utilities: small command-line tools, file managers, archives, converters",
    "web": "the web: web servers, browsers, HTTP, websites, HTML, web applications",
}


def cosine_rule(texts: list[str], descriptions: list[str]):
    """argmax of cos(mean subword vector of the text, of each description), the
    package's way: its tokenizer on the whole text, no special tokens."""
    import numpy as np

    from model_worker import pretrained

    tok, book = pretrained.tokenizer(), pretrained.codebook()
    tok.no_padding()
    tok.no_truncation()

    def means(items: list[str]) -> "np.ndarray":
        out = np.zeros((len(items), book.shape[1]), np.float32)
        for i, enc in enumerate(tok.encode_batch(items, add_special_tokens=False)):
            if enc.ids:
                out[i] = book[np.clip(enc.ids, 0, len(book) - 1)].astype(np.float32).mean(0)
        norm = np.linalg.norm(out, axis=1, keepdims=True)
        return out / np.maximum(norm, 1e-12)

    return (means(texts) @ means(descriptions).T).argmax(1)


def zero_shot(ds, descriptions: dict[str, str]) -> tuple[dict, "object"]:
    import numpy as np

    import metrics
    from model_worker import serving, zeroshot
    from model_worker.params import validate_params

    names = sorted(descriptions)
    started = time.monotonic()
    res = zeroshot.train([descriptions[n] for n in names], names,
                         validate_params({"architecture": "zero_shot"}))
    train_s = time.monotonic() - started
    probs = serving.predict_proba(serving.make_predict_fn(res.model), ds.test_texts)
    order = [res.labels.index(n) for n in ds.labels]
    probs = probs[:, order]
    y = np.array([ds.labels.index(label) for label in ds.test_labels])
    pred = probs.argmax(1)
    row = {"accuracy": metrics.accuracy(y, pred), "macro_f1": metrics.macro_f1(y, pred, len(ds.labels)),
           "train_s": round(train_s, 2), "ece": metrics.expected_calibration_error(probs, y),
           "temperature": zeroshot.TEMPERATURE}
    # the temperature that would minimise ECE here (information only)
    logits = np.log(np.clip(probs, 1e-30, 1.0)) * zeroshot.TEMPERATURE  # = cosines + const
    best = min((metrics.expected_calibration_error(_softmax(logits / t), y), t)
               for t in (0.01, 0.02, 0.03, 0.05, 0.07, 0.1, 0.15, 0.2, 0.3))
    row["ece_best"], row["temperature_ece_best"] = round(best[0], 4), best[1]
    return row, pred


def _softmax(z):
    import numpy as np

    z = z - z.max(1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(1, keepdims=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--no-curve-point", action="store_true", help="skip auto and tfidf-svc at 100 texts")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS"):
        os.environ[var] = str(args.threads)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import numpy as np

    import datasets
    import metrics

    ds = datasets.load(SET)
    assert sorted(DESCRIPTIONS) == ds.labels, (sorted(DESCRIPTIONS), ds.labels)
    out: dict = {"set": SET, "test_texts": len(ds.test_texts), "labels": len(ds.labels),
                 "descriptions": DESCRIPTIONS}
    out["zero_shot"], pred = zero_shot(ds, DESCRIPTIONS)
    y = np.array([ds.labels.index(label) for label in ds.test_labels])
    rule = cosine_rule(ds.test_texts, [DESCRIPTIONS[n] for n in ds.labels])
    out["cosine_rule"] = {"accuracy": metrics.accuracy(y, rule),
                          "macro_f1": metrics.macro_f1(y, rule, len(ds.labels)),
                          "agreement_with_zero_shot": round(float(np.mean(rule == pred)), 4)}
    out["names_only"], _ = zero_shot(ds, {n: n for n in ds.labels})
    if not args.no_curve_point:
        import accuracy

        small = accuracy.subsample(ds, 100)
        out["auto@100"] = accuracy._auto_cell(small, {"pretrained": True}, False)
        out["tfidf-svc@100"] = accuracy.score(small, accuracy.run_tfidf_svc(small))
    print(f"{SET}: {len(ds.test_texts)} test texts, {len(ds.labels)} labels")
    for key in ("zero_shot", "cosine_rule", "names_only", "auto@100", "tfidf-svc@100"):
        if key in out:
            row = out[key]
            extra = "".join(f"  {k} {row[k]}" for k in ("train_s", "ece", "temperature",
                                                          "ece_best", "temperature_ece_best",
                                                          "agreement_with_zero_shot", "chosen")
                            if k in row)
            print(f"  {key:14s} accuracy {row['accuracy']:.4f}  macro-F1 {row['macro_f1']:.4f}{extra}")
    path = ROOT / "bench" / ".cache" / "zeroshot.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    main()
