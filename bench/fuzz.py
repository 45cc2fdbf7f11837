"""Fuzz both live APIs with schemathesis, 1,000+ generated cases each.

    .venv/bin/python -m bench.fuzz [--cases 1000] [--seed random|N]

The same setup and checks as tests/test_openapi.py (which runs fewer cases so
`make test` stays short): a real service on free ports with the fuzzing
config, tiny real models, the OpenAPI documents read from /openapi.json.
Prints, per API, the cases run, the failures and errors, and the seed to
replay them with; exits 1 when anything failed. Needs schemathesis
(requirements-dev.txt).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from tests.test_openapi import (AUTH, restore_default, run_schemathesis,  # noqa: E402
                          server_errors, start_service, summarize)

# schemathesis's --max-examples counts per operation; the management API has
# twenty operations and a stateful phase, so it needs fewer per operation
PER_OPERATION_SHARE = {"inference": 1.0, "management": 0.1}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", type=int, default=1000, help="generated cases per API, at least")
    p.add_argument("--seed", default="random", help="'random' or an integer")
    args = p.parse_args()
    work = tempfile.mkdtemp(prefix="textswap-fuzz-")
    print(f"work folder: {work}", flush=True)
    tiny = os.path.join(work, "tiny")
    subprocess.run([sys.executable, os.path.join(ROOT, "tests", "tinymodels.py"), tiny],
                   check=True, cwd=ROOT, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    svc = start_service(tiny, os.path.join(work, "service"))
    failed = False
    try:
        for api, port, headers in (("inference", svc.port, None),
                                   ("management", svc.mport, AUTH)):
            n = max(10, int(args.cases * PER_OPERATION_SHARE[api]))
            t = time.monotonic()
            before = len(svc.log())
            result = run_schemathesis(f"http://127.0.0.1:{port}/openapi.json",
                                      os.path.join(work, api), max_examples=n, seed=args.seed,
                                      headers=headers, timeout=3600)
            errors_logged = server_errors(svc.log()[before:])
            print(f"{api}: {summarize(result)}; {time.monotonic() - t:.0f}s; "
                  f"500s in the service log: {len(errors_logged)}", flush=True)
            if result["test_cases"]["generated"] < args.cases:
                print(f"{api}: fewer than {args.cases} cases generated", flush=True)
                failed = True
            if api == "management":  # the fuzzer may unload the default model
                print(restore_default(svc) or "the default model served throughout",
                      flush=True)
            if result["failures"] or result["errors"] or errors_logged:
                failed = True
                print(result["output"][-8000:])
                print("\n".join(errors_logged[:20]))
    finally:
        svc.stop()
    print("FAILED" if failed else "OK", f"(reports under {work})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
