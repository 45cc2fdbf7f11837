"""Frames between the supervisor and its child processes.

Shared by both ends; imports no TensorFlow, so the supervisor can use it.

Every message is one frame::

    +----------------+-------------------------------+
    | length: uint32 | body: msgpack map             |
    | big-endian     | (exactly `length` bytes)      |
    +----------------+-------------------------------+

The body is a map with a type field ``t`` and, for requests that expect an
answer, an ``id`` chosen by the sender, so many requests can be in flight on
one connection and answers may come back in any order.

Frames larger than ``MAX_FRAME`` are refused on both ends: a corrupt length
prefix must not make a reader allocate gigabytes or wait forever for bytes
that will never come.

Messages (supervisor -> worker):
    load      {path, name, version}     load a model, warm it up, answer ready
    predict   {id, texts}               answer result {id, scores} or error {id}
    ping      {id}                      answer pong {id}
    stop      {}                        finish what is queued, then exit 0
Messages (worker -> supervisor):
    booted    {pid}                     TensorFlow imported, waiting for load
    ready     {labels, load_s, warm_s}  model loaded and one prediction done
    result    {id, scores[, bn, bs]}    scores: one list of floats per text; the first
                                      result of a batch adds bn (texts in the model
                                      call) and bs (seconds inside the model)
    error     {id?, code, message}      a request failed; the worker lives on
    pong      {id}
Trainer processes use the same framing for progress/done/failed messages.
"""
from __future__ import annotations

import socket
import struct
from typing import Any, Iterator

import msgpack

HEADER = struct.Struct(">I")
MAX_FRAME = 64 * 1024 * 1024  # 64 MiB: far above any legal batch


class ProtocolError(Exception):
    """The byte stream is not a valid sequence of frames."""


class FrameTooLarge(ProtocolError):
    pass


class BadFrame(ProtocolError):
    """The body is not a msgpack map with a type field."""


class ConnectionClosed(Exception):
    """The peer closed the connection cleanly, between two frames."""


class TruncatedFrame(ProtocolError, ConnectionClosed):
    """The peer went away in the middle of a frame."""


def encode(msg: dict[str, Any]) -> bytes:
    body = msgpack.packb(msg, use_bin_type=True)
    if len(body) > MAX_FRAME:
        raise FrameTooLarge(f"frame of {len(body)} bytes exceeds {MAX_FRAME}")
    return HEADER.pack(len(body)) + body


def _decode_body(body: bytes | memoryview) -> dict[str, Any]:
    try:
        msg = msgpack.unpackb(body, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise BadFrame(f"undecodable frame body: {exc}") from exc
    if not isinstance(msg, dict) or not isinstance(msg.get("t"), str):
        raise BadFrame("frame body is not a map with a type field 't'")
    return msg


class FrameDecoder:
    """Incremental decoder: feed it bytes as they arrive, get whole frames.

    Used by the supervisor on its non-blocking streams, where a read may
    return half a frame or ten frames at once.
    """

    def __init__(self, max_frame: int = MAX_FRAME) -> None:
        self._buf = bytearray()
        self._max = max_frame

    def feed(self, data: bytes) -> Iterator[dict[str, Any]]:
        self._buf += data
        buf = self._buf
        pos = 0
        try:
            while len(buf) - pos >= 4:
                (n,) = HEADER.unpack_from(buf, pos)
                if n > self._max:
                    raise FrameTooLarge(f"frame length {n} exceeds {self._max}")
                if len(buf) - pos - 4 < n:
                    break
                body = bytes(buf[pos + 4 : pos + 4 + n])
                pos += 4 + n
                yield _decode_body(body)
        finally:
            del buf[:pos]

    @property
    def pending(self) -> int:
        """Bytes of an unfinished frame; non-zero at EOF means truncation."""
        return len(self._buf)


def _recv_exact(sock: socket.socket, n: int, *, started: bool) -> bytes:
    chunks = []
    got = 0
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            if got == 0 and not started:
                raise ConnectionClosed("peer closed the connection")
            raise TruncatedFrame(f"connection closed after {got} of {n} bytes")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def read_frame(sock: socket.socket, max_frame: int = MAX_FRAME) -> dict[str, Any]:
    """Blocking read of one frame (used in child processes)."""
    (n,) = HEADER.unpack(_recv_exact(sock, 4, started=False))
    if n > max_frame:
        raise FrameTooLarge(f"frame length {n} exceeds {max_frame}")
    return _decode_body(_recv_exact(sock, n, started=True))


def write_frame(sock: socket.socket, msg: dict[str, Any]) -> None:
    """Blocking write of one frame (used in child processes)."""
    sock.sendall(encode(msg))
