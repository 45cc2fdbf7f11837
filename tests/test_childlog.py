"""control/childlog.py: a child's stderr read by the supervisor, line by line.

Real child processes write to the relay's other end as their fd 2 (the way
TensorFlow's processes do); no TensorFlow here (test_zygote.py has that)."""
from __future__ import annotations

import asyncio
import io
import logging
import subprocess
import sys

from control.childlog import StderrRelay, is_tensorflow_line

TF_LINES = [
    "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",
    "I0000 00:00:1796406176.809378    2109 port.cc:153] oneDNN custom operations are on.",
    "W0000 00:00:1796406178.557946    2109 port.cc:148] TF_ENABLE_ONEDNN_OPTS is not set",
    "I0000 00:00:1796406334.044784    5347 cpu_feature_guard.cc:227] This TensorFlow binary",
    "To enable the following instructions: AVX2 FMA, in other operations, rebuild "
    "TensorFlow with the appropriate compiler flags.",
]
OWN_LINES = [
    "2026-12-04 18:00:00,000 ERROR [worker 123] model news v3 cannot load: no such file",
    "Traceback (most recent call last):",
    "I0 am not a TensorFlow line",
    "中文 line",
]


def test_known_tensorflow_lines_are_recognised_and_no_others():
    assert all(is_tensorflow_line(x) for x in TF_LINES)
    assert not any(is_tensorflow_line(x) for x in OWN_LINES)


def _relay_children(scripts: list[str]) -> tuple[StderrRelay, str]:
    """Run children whose fd 2 is one relay's other end; the relay ends at
    their last exit (EOF)."""
    out = io.StringIO()

    async def main() -> StderrRelay:
        relay = StderrRelay("tensorflow", out=out)
        procs = [subprocess.Popen([sys.executable, "-c", s], stderr=relay.child_end)
                 for s in scripts]
        relay.started()
        for p in procs:
            while p.poll() is None:
                await asyncio.sleep(0.01)
        deadline = asyncio.get_running_loop().time() + 30
        while relay._open and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        assert not relay._open, "the relay did not see EOF"
        return relay

    return asyncio.run(main()), out.getvalue()


def test_tensorflow_lines_go_to_the_debug_log_and_others_to_stderr(caplog):
    caplog.set_level(logging.DEBUG, logger="textswap.tensorflow")
    lines = [TF_LINES[0], OWN_LINES[0], TF_LINES[1], OWN_LINES[3], TF_LINES[3], TF_LINES[4]]
    script = "import sys\n" + "".join(
        f"sys.stderr.write({x!r} + '\\n'); sys.stderr.flush()\n" for x in lines) \
        + "sys.stderr.write('no newline at exit')\n"
    relay, out = _relay_children([script])
    assert out.splitlines() == [OWN_LINES[0], OWN_LINES[3], "no newline at exit"]
    moved = [r.getMessage() for r in caplog.records if r.name == "textswap.tensorflow"]
    assert moved == [f"tensorflow: {x}" for x in (TF_LINES[0], TF_LINES[1], TF_LINES[3],
                                                  TF_LINES[4])]
    assert (relay.tensorflow_lines, relay.other_lines) == (4, 3)


def test_several_writers_share_one_relay_without_losing_lines():
    script = ("import sys\n"
              "for i in range(2000):\n"
              "    sys.stderr.write(TAG + ' line ' + str(i) + '\\n')\n")
    relay, out = _relay_children([f"TAG = {t!r}\n" + script for t in ("a", "b", "c")])
    got = out.splitlines()
    assert len(got) == 6000
    for tag in "abc":
        assert [x for x in got if x.startswith(tag + " ")] == [f"{tag} line {i}" for i in range(2000)]
