"""Frames over a real socketpair: round trips, many in flight, broken input."""
import socket
import struct
import threading

import msgpack
import pytest

from model_worker import protocol


def test_round_trip_over_socket():
    a, b = socket.socketpair()
    with a, b:
        msgs = [{"t": "predict", "id": i, "texts": ["好" * i, "x"]} for i in range(50)]
        threading.Thread(target=lambda: [protocol.write_frame(a, m) for m in msgs]).start()
        got = [protocol.read_frame(b) for _ in msgs]
        assert got == msgs


def test_decoder_handles_split_and_merged_reads():
    frames = b"".join(protocol.encode({"t": "result", "id": i, "scores": [[0.5, 0.5]]})
                      for i in range(10))
    dec = protocol.FrameDecoder()
    out = []
    for i in range(0, len(frames), 7):  # 7-byte reads split headers and bodies
        out.extend(dec.feed(frames[i:i + 7]))
    assert [m["id"] for m in out] == list(range(10))
    assert dec.pending == 0
    assert [m["id"] for m in protocol.FrameDecoder().feed(frames)] == list(range(10))


def test_clean_close_vs_truncated_frame():
    a, b = socket.socketpair()
    a.close()
    with b, pytest.raises(protocol.ConnectionClosed) as info:
        protocol.read_frame(b)
    assert not isinstance(info.value, protocol.TruncatedFrame)

    a, b = socket.socketpair()
    frame = protocol.encode({"t": "ping", "id": 1})
    a.sendall(frame[:-3])
    a.close()
    with b, pytest.raises(protocol.TruncatedFrame):
        protocol.read_frame(b)


def test_oversized_frame_is_refused_without_reading_it():
    a, b = socket.socketpair()
    with a, b:
        a.sendall(struct.pack(">I", protocol.MAX_FRAME + 1))
        with pytest.raises(protocol.FrameTooLarge):
            protocol.read_frame(b)
    with pytest.raises(protocol.FrameTooLarge):
        list(protocol.FrameDecoder().feed(struct.pack(">I", protocol.MAX_FRAME + 1)))


@pytest.mark.parametrize("body", [b"\xc1\xc1\xc1", msgpack.packb([1, 2]), msgpack.packb({"x": 1})])
def test_garbage_body_is_a_typed_error(body):
    a, b = socket.socketpair()
    with a, b:
        a.sendall(struct.pack(">I", len(body)) + body)
        with pytest.raises(protocol.BadFrame):
            protocol.read_frame(b)
    with pytest.raises(protocol.BadFrame):
        list(protocol.FrameDecoder().feed(struct.pack(">I", len(body)) + body))


def test_encode_refuses_oversized_message(monkeypatch):
    monkeypatch.setattr(protocol, "MAX_FRAME", 100)
    with pytest.raises(protocol.FrameTooLarge):
        protocol.encode({"t": "predict", "texts": ["x" * 200]})
