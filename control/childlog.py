"""The stderr of the processes that import TensorFlow, relayed by the supervisor.

TensorFlow writes some lines from C++ through absl before absl's logging is
initialised, and those go to stderr whatever `TF_CPP_MIN_LOG_LEVEL` says
(oneDNN's "custom operations are on" notice, on CPUs where oneDNN is on by
default, and absl's "All log messages before absl::InitializeLog()" line).
No setting silences them, so every TensorFlow process (the zygote, with every
worker and trainer it forks, and each spawned worker or trainer) gets a
socket as its fd 2 instead of the supervisor's stderr, and the supervisor
reads it here: TensorFlow's C++ lines go to the debug log, every other line
(the children's own log records, tracebacks) to the supervisor's stderr as
they were written.

    supervisor                               child (fd 2 = the socket's other end)
    StderrRelay --- AF_UNIX stream ------ zygote ── forked workers, trainers
       │ on the IOLoop, line by line
       ├─ TensorFlow C++ line ─► log.debug("tensorflow: ...")
       └─ any other line      ─► sys.stderr

One relay per spawned process: its forked children inherit the same fd 2. The
relay ends by itself when the last process holding the other end has exited
(EOF). Imports no TensorFlow.
"""
from __future__ import annotations

import logging
import re
import socket
import sys
from typing import TextIO

from tornado.ioloop import IOLoop

from state import logformat

log = logging.getLogger("textswap.tensorflow")

# what TensorFlow's C++ side writes: absl/glog records ("I0000 00:00:17.. 123
# port.cc:153] ..."), absl's pre-initialisation notice, and the known second
# line of cpu_feature_guard's notice
TF_LINE = re.compile(
    r"^(?:[IWEF]\d{4} [\d:.]+\s+\d+ [^\s\]]+:\d+\] "
    r"|WARNING: All log messages before absl::InitializeLog\(\) is called"
    r"|To enable the following instructions: .* rebuild TensorFlow)")
_MAX_LINE = 64 * 1024  # a longer run without a newline is relayed as it is


def is_tensorflow_line(line: str) -> bool:
    return TF_LINE.match(line) is not None


class StderrRelay:
    """The reading end of one child's stderr, on the current IOLoop."""

    def __init__(self, name: str, out: TextIO | None = None) -> None:
        self.name = name
        self.out = out
        self.tensorflow_lines = 0  # moved to the debug log
        self.other_lines = 0  # relayed to stderr
        self._buf = b""
        self._loop = IOLoop.current()
        self._reader, self.child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self._reader.setblocking(False)
        self._open = True
        self._loop.add_handler(self._reader.fileno(), self._on_readable, IOLoop.READ)

    def started(self) -> None:
        """The child has its copy of the other end: drop ours, so that EOF
        comes when the last process holding it exits."""
        self.child_end.close()

    def close(self) -> None:
        if not self._open:
            return
        self._open = False
        self._flush(final=True)
        try:
            self._loop.remove_handler(self._reader.fileno())
        except (KeyError, ValueError):
            pass
        self._reader.close()
        if self.child_end.fileno() >= 0:
            self.child_end.close()

    def _on_readable(self, fd: int, events: int) -> None:
        while True:
            try:
                data = self._reader.recv(65536)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                data = b""
            if not data:
                self.close()
                return
            self._buf += data
            self._flush(final=False)

    def _flush(self, final: bool) -> None:
        *lines, rest = self._buf.split(b"\n")
        if final or len(rest) > _MAX_LINE:
            if rest:
                lines.append(rest)
            rest = b""
        self._buf = rest
        for raw in lines:
            self._line(raw.decode("utf-8", "replace"))

    def _line(self, line: str) -> None:
        if is_tensorflow_line(line):
            self.tensorflow_lines += 1
            log.debug("%s: %s", self.name, line)
            return
        self.other_lines += 1
        if logformat.json_on():  # one JSON object a line, on stdout with the rest
            out = self.out or sys.stdout
            line = logformat.child_line(self.name, line)
        else:
            out = self.out or sys.stderr
        try:
            out.write(line + "\n")
            out.flush()
        except (OSError, ValueError):
            pass  # our own stderr is gone: nothing to tell it
