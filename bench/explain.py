"""What an explanation costs: explain (k n-grams) against the plain predict.

    python -m bench.explain [--rows 3000] [--budget 40] [--k 5]

Trains an `auto` model exactly as a /train job does (the bundled Chinese
reviews, data/demo/, plus the English half of --english if given) and times,
in this process, the served predict function against the worker's explainer
on the same texts: single texts and batches of 64, calls alternating, the
median of each. The issue's bar: explain at most 3x the predict it rides on.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=3000, help="training texts from data/demo")
    ap.add_argument("--budget", type=float, default=40.0, help="auto's time_budget_s")
    ap.add_argument("--k", type=int, default=5)
    args = ap.parse_args()
    from bench.accuracy import explain_latency, train_like_trainer  # bench/accuracy.py

    with open(os.path.join(ROOT, "data", "demo", "sentiment_zh.jsonl"), encoding="utf-8") as fh:
        rows = [json.loads(line) for line in fh]
    random.Random(7).shuffle(rows)
    train, probe = rows[:args.rows], [r["text"] for r in rows[args.rows:args.rows + 400]]
    result = train_like_trainer([r["text"] for r in train], [r["label"] for r in train],
                                {"architecture": "auto", "time_budget_s": args.budget})
    chosen = ((getattr(result, "report", None) or {}).get("chosen") or {})
    lat = explain_latency(result.model, probe, k=args.k)
    print(f"\nexplain (k={args.k}) vs predict, auto on {args.rows} reviews "
          f"(chosen: {json.dumps(chosen.get('members', chosen))[:160]})")
    print(f"{'batch':>6} {'predict ms':>11} {'explain ms':>11} {'ratio':>6}")
    for name, r in lat.items():
        print(f"{name.split('_')[1]:>6} {r['predict_ms']:11.3f} {r['explain_ms']:11.3f} "
              f"{r['ratio']:6.2f}")
    worst = max(r["ratio"] for r in lat.values())
    print(f"worst ratio {worst:.2f} (bar: 3.00)")
    return 0 if worst <= 3.0 else 1


if __name__ == "__main__":
    sys.exit(main())
