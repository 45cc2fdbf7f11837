"""frontend/httpwire.py, the inference port's HTTP/1.1 server, at the byte level:
real sockets against a WireServer serving a real Tornado Application (the
service's own runs on it in tests/test_service.py and everywhere else).
Each test speaks raw HTTP so that what goes over the wire is what is checked."""
from __future__ import annotations

import asyncio
import json
import time

import pytest
from tornado import httputil
from tornado.web import Application, RequestHandler, stream_request_body

from frontend.httpwire import MAX_HEADER_BYTES, WireServer

CAP = 64 * 1024


class Echo(RequestHandler):
    def get(self) -> None:
        self.finish({"ip": self.request.remote_ip, "path": self.request.path,
                     "query": self.get_argument("q", "")})

    def head(self) -> None:
        self.set_header("Content-Length", "11")

    async def post(self) -> None:
        delay = float(self.get_argument("delay", "0"))
        if delay:
            await asyncio.sleep(delay)  # an answer that takes time, not a wait for a state
        self.finish({"n": len(self.request.body), "body": self.request.body.decode()})


@stream_request_body
class Streamed(RequestHandler):
    """Like the service's JsonHandler: the body arrives in chunks."""

    closed: list[str] = []

    def prepare(self) -> None:
        self.got = bytearray()

    def data_received(self, chunk: bytes) -> None:
        self.got += chunk

    def post(self) -> None:
        self.finish({"n": len(self.got)})

    def on_connection_close(self) -> None:
        Streamed.closed.append(self.request.path)


class Chunked(RequestHandler):
    async def get(self) -> None:
        for part in ("alpha-", "beta-", "gamma"):
            self.write(part)
            await self.flush()  # no Content-Length: the answer goes out chunked
        self.finish()


class Empty(RequestHandler):
    def get(self) -> None:
        self.set_status(204)


class Big(RequestHandler):
    """256 KiB an answer, and a count of the answers begun."""

    served = 0

    def get(self) -> None:
        Big.served += 1
        self.finish(b"b" * 262144)


def _app() -> Application:
    return Application([("/echo", Echo), ("/stream", Streamed), ("/chunked", Chunked),
                        ("/empty", Empty), ("/big", Big)])


class Wire:
    """A WireServer on its own event loop in this thread; raw socket clients."""

    def __init__(self, **kw: float) -> None:
        self.loop = asyncio.new_event_loop()
        settings = {"max_body_size": CAP, "body_timeout": 5.0, "header_timeout": 5.0,
                    "idle_timeout": 30.0, **kw}

        async def start() -> WireServer:
            server = WireServer(_app(), **settings)  # type: ignore[arg-type]
            server.listen(0, address="127.0.0.1")
            while not server.sockets:
                await asyncio.sleep(0)  # the listening task starts on the next turns
            return server

        self.server = self.loop.run_until_complete(start())
        self.port = self.server.sockets[0].getsockname()[1]

    def exchange(self, raw: bytes, until_closed: bool = False, answers: int = 1,
                 timeout: float = 20.0) -> bytes:
        """Sends `raw`, runs the loop until `answers` whole answers (or EOF) came."""
        async def talk() -> bytes:
            reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
            writer.write(raw)
            await writer.drain()
            got = b""
            deadline = time.monotonic() + timeout
            while True:
                left = deadline - time.monotonic()
                assert left > 0, f"no answer within {timeout} s: {got!r}"
                try:
                    chunk = await asyncio.wait_for(reader.read(65536), left)
                except asyncio.TimeoutError:
                    raise AssertionError(f"no answer within {timeout} s: {got!r}") from None
                if not chunk:
                    break
                got += chunk
                if not until_closed and len(parse_all(got)) >= answers:
                    break
            writer.close()
            return got
        return self.loop.run_until_complete(talk())

    def run(self, coro):  # type: ignore[no-untyped-def]
        return self.loop.run_until_complete(coro)

    def close(self) -> None:
        self.server.stop()
        self.loop.run_until_complete(asyncio.sleep(0.05))
        self.loop.close()


@pytest.fixture
def wire():
    w = Wire()
    yield w
    w.close()


def parse_all(data: bytes) -> list[tuple[int, dict[str, str], bytes]]:
    """Every whole answer in `data`: (status, headers lowercased, body de-chunked)."""
    out = []
    while data:
        head, sep, rest = data.partition(b"\r\n\r\n")
        if not sep:
            break
        lines = head.decode("latin1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {k.lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:])}
        if status == 100:
            data = rest
            continue
        if headers.get("transfer-encoding") == "chunked":
            body = b""
            while True:
                size_line, sep, rest = rest.partition(b"\r\n")
                if not sep:
                    return out
                size = int(size_line, 16)
                if len(rest) < size + 2:
                    return out
                body += rest[:size]
                rest = rest[size + 2:]
                if size == 0:
                    break
        elif "content-length" in headers:
            n = int(headers["content-length"])
            if len(rest) < n:
                break
            body, rest = rest[:n], rest[n:]
        else:
            body, rest = rest, b""
        out.append((status, headers, body))
        data = rest
    return out


def post(path: str, body: bytes, extra: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n{extra}\r\n"
            .encode() + body)


def test_keep_alive_and_pipelined_requests_answered_in_order(wire):
    """Two requests in one write: the slower first one is answered first, on
    the same connection, which stays open (no Connection: close)."""
    raw = post("/echo?delay=0.2", b"first") + post("/echo", b"second")
    answers = parse_all(wire.exchange(raw, answers=2))
    assert [json.loads(b)["body"] for _, _, b in answers] == ["first", "second"]
    assert all(s == 200 and "connection" not in h for s, h, _ in answers)
    got = json.loads(parse_all(wire.exchange(b"GET /echo?q=%E4%BD%A0 HTTP/1.1\r\nHost: x\r\n\r\n"))[0][2])
    assert got == {"ip": "127.0.0.1", "path": "/echo", "query": "你"}


def test_header_values_are_read_without_the_whitespace_around_them(wire):
    """As Tornado reads them ("Bearer " is "Bearer"): a fuzzer's trailing
    space once reached Tornado's header check and failed the request."""
    raw = b"GET /echo HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \t\r\nX-A:  b  \r\n\r\n"
    (status, _, body), = parse_all(wire.exchange(raw))
    assert status == 200, body


def test_http10_closes_unless_kept_alive(wire):
    data = wire.exchange(b"GET /echo HTTP/1.0\r\n\r\n", until_closed=True)
    (status, headers, _), = parse_all(data)
    assert status == 200 and "connection" not in headers
    data = wire.exchange(b"GET /echo HTTP/1.0\r\nConnection: keep-alive\r\n\r\n" * 2, answers=2)
    answers = parse_all(data)
    assert len(answers) == 2 and answers[0][1]["connection"] == "Keep-Alive"
    (status, headers, _), = parse_all(wire.exchange(
        b"GET /echo HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", until_closed=True))
    assert status == 200 and headers["connection"] == "close"


def test_chunked_request_body_and_chunked_answer(wire):
    body = b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"
    raw = b"POST /stream HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" + body
    (status, _, got), = parse_all(wire.exchange(raw))
    assert status == 200 and json.loads(got) == {"n": 11}
    (status, headers, got), = parse_all(wire.exchange(b"GET /chunked HTTP/1.1\r\nHost: x\r\n\r\n"))
    assert headers["transfer-encoding"] == "chunked" and got == b"alpha-beta-gamma"


def test_head_and_204_carry_no_body(wire):
    raw = b"HEAD /echo HTTP/1.1\r\nHost: x\r\n\r\nGET /empty HTTP/1.1\r\nHost: x\r\n\r\n"
    data = wire.exchange(raw + b"GET /echo HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
                         until_closed=True)
    first, _, rest = data.partition(b"\r\n\r\n")
    assert first.startswith(b"HTTP/1.1 200") and b"Content-Length: 11" in first
    second, _, rest = rest.partition(b"\r\n\r\n")
    assert second.startswith(b"HTTP/1.1 204"), data  # right after HEAD's headers: no body
    assert rest.startswith(b"HTTP/1.1 200"), data


def test_expect_100_continue(wire):
    async def talk() -> tuple[bytes, bytes]:
        reader, writer = await asyncio.open_connection("127.0.0.1", wire.port)
        writer.write(b"POST /stream HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n"
                     b"Expect: 100-continue\r\n\r\n")
        interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        writer.write(b"abcd")
        final = await asyncio.wait_for(reader.readuntil(b"}"), 10)
        writer.close()
        return interim, final
    interim, final = wire.run(talk())
    assert interim == b"HTTP/1.1 100 (Continue)\r\n\r\n"
    assert final.startswith(b"HTTP/1.1 200") and final.endswith(b'{"n": 4}')


@pytest.mark.parametrize("raw,status,code", [
    (b"GARBAGE\r\n\r\n", 400, "bad_request"),
    (b"POST /echo HTTP/1.1\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\nabcd", 400, "bad_request"),
    (b"POST /echo HTTP/1.1\r\nContent-Length: x\r\n\r\n", 400, "bad_request"),
    (b"POST /echo HTTP/1.1\r\nTransfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\n", 400,
     "bad_request"),
    (b"GET /echo HTTP/1.1\r\nX-Big: " + b"a" * (MAX_HEADER_BYTES + 10), 431, "headers_too_large"),
    (b"GET /echo HTTP/1.1\r\nX-Odd: a\x7fb\r\n\r\n", 400, "bad_request"),
])
def test_bad_requests_get_a_json_error_and_the_connection_ends(wire, raw, status, code):
    (got, headers, body), = parse_all(wire.exchange(raw, until_closed=True))
    assert got == status and headers["connection"] == "close"
    assert json.loads(body)["error"]["code"] == code


def test_a_bad_request_behind_one_being_answered_is_refused_after_it(wire):
    """Pipelined: the first request's answer comes first, whole, then the
    refusal of the broken one behind it, then the connection ends."""
    raw = post("/echo?delay=0.2", b"first") + b"GARBAGE\r\n\r\n"
    answers = parse_all(wire.exchange(raw, until_closed=True))
    assert [s for s, _, _ in answers] == [200, 400], answers
    assert json.loads(answers[0][2])["body"] == "first"
    raw = post("/echo?delay=0.2", b"first") + post("/stream", b"x" * (CAP + 1))
    answers = parse_all(wire.exchange(raw, until_closed=True))
    assert [s for s, _, _ in answers] == [200, 413], answers


def test_a_client_that_reads_no_answers_stops_being_read(wire):
    """Requests pipelined by a client that reads none of the answers are
    not all answered into memory: once the answers back up, the next
    request waits (as Tornado's server waits on its writes); read, all come."""
    Big.served = 0
    n = 40

    async def talk() -> tuple[int, int]:
        reader, writer = await asyncio.open_connection("127.0.0.1", wire.port)
        writer.write(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n" * n)
        await writer.drain()
        deadline = time.monotonic() + 10
        seen = -1
        while time.monotonic() < deadline and Big.served != seen:  # until it stops moving
            seen = Big.served
            await asyncio.sleep(0.3)
        served_unread = Big.served
        got = 0
        while got < n * 262144:
            chunk = await asyncio.wait_for(reader.read(1 << 20), 20)
            assert chunk
            got += chunk.count(b"b")
        writer.close()
        return served_unread, Big.served
    unread, total = wire.run(talk())
    assert unread < n // 2, unread
    assert total == n


def test_body_over_the_transport_cap_is_cut_off(wire):
    """Declared over the cap: refused before a byte of it is read; chunked
    past the cap: cut off where it passes it."""
    raw = b"POST /stream HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % (CAP + 1)
    (status, headers, got), = parse_all(wire.exchange(raw, until_closed=True))
    assert status == 413 and json.loads(got)["error"]["code"] == "body_too_large"
    chunk = b"x" * 4096
    raw = (b"POST /stream HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
           + b"%x\r\n%s\r\n" % (len(chunk), chunk) * (CAP // len(chunk) + 1))
    (status, headers, got), = parse_all(wire.exchange(raw, until_closed=True))
    assert status == 413 and headers["connection"] == "close"


def test_an_upgrade_is_answered_as_plain_http_once(wire):
    """No protocol switch here: the request gets its ordinary answer, once,
    and the connection ends (what follows is not HTTP)."""
    raw = (b"GET /echo HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n"
           b"\x81\x85not http")
    answers = parse_all(wire.exchange(raw, until_closed=True))
    assert [s for s, _, _ in answers] == [200]


def test_slow_headers_get_408_and_idle_connections_close():
    w = Wire(header_timeout=0.3, idle_timeout=0.3)
    try:
        started = time.monotonic()
        (status, headers, body), = parse_all(w.exchange(b"GET /echo HTTP/1.1\r\nHost:",
                                                        until_closed=True))
        assert status == 408 and json.loads(body)["error"]["code"] == "request_timeout"
        assert time.monotonic() - started < 10
        # kept alive after an answer, then idle: closed without a word
        data = w.exchange(b"GET /echo HTTP/1.1\r\nHost: x\r\n\r\n", until_closed=True)
        assert len(parse_all(data)) == 1 and data.count(b"HTTP/1.1") == 1
    finally:
        w.close()


def test_slow_body_gets_408():
    w = Wire(body_timeout=0.3)
    try:
        (status, _, body), = parse_all(w.exchange(post("/stream", b"abc")[:-1], until_closed=True))
        assert status == 408 and "body" in json.loads(body)["error"]["message"]
    finally:
        w.close()


def test_a_client_gone_mid_body_is_told_to_the_handler(wire):
    Streamed.closed.clear()

    async def talk() -> None:
        _, writer = await asyncio.open_connection("127.0.0.1", wire.port)
        writer.write(b"POST /stream HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\nabc")
        await writer.drain()
        deadline = time.monotonic() + 10
        while not wire.server.connections and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        writer.close()
        while not Streamed.closed and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
    wire.run(talk())
    assert Streamed.closed == ["/stream"]
    assert not wire.server.connections


def test_header_injection_is_refused():
    """A header value with CR/LF never reaches the wire (as Tornado refuses it)."""
    from frontend.httpwire import _Exchange

    class Conn:
        context = None
        written: list[bytes] = []

        def _write(self, data: bytes) -> None:
            self.written.append(data)

    ex = _Exchange(Conn(), httputil.RequestStartLine("GET", "/", "HTTP/1.1"),  # type: ignore[arg-type]
                   httputil.HTTPHeaders(), True)
    ex.read_done = True
    with pytest.raises(ValueError, match="CR or LF"):
        ex.write_headers(httputil.ResponseStartLine("HTTP/1.1", 200, "OK"),
                         httputil.HTTPHeaders({"X-Evil": "a\r\nSet-Cookie: x"}))
    assert Conn.written == []


def test_stop_ends_listening_but_not_open_connections(wire):
    async def talk() -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", wire.port)
        writer.write(post("/echo?delay=0.3", b"in flight"))
        await writer.drain()
        deadline = time.monotonic() + 10
        while not wire.server.connections and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        wire.server.stop()
        got = await asyncio.wait_for(reader.readuntil(b"}"), 10)
        writer.close()
        with pytest.raises(OSError):
            await asyncio.open_connection("127.0.0.1", wire.port)
        return got
    got = wire.run(talk())
    assert got.startswith(b"HTTP/1.1 200") and b"in flight" in got


def _request(kind: int, i: int) -> tuple[bytes, dict]:
    """One request of three kinds and the answer's body it must get."""
    body = f"body {i} " + "漢字" * (i % 7) + "x" * (i * 37 % 300)
    raw = body.encode()
    if kind == 0:
        return f"GET /echo?q=r{i} HTTP/1.1\r\nHost: x\r\n\r\n".encode(), {
            "ip": "127.0.0.1", "path": "/echo", "query": f"r{i}"}
    if kind == 1:
        return post("/echo", raw), {"n": len(raw), "body": body}
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(raw[j:j + 50]), raw[j:j + 50])
                      for j in range(0, len(raw), 50)) + b"0\r\n\r\n"
    return (b"POST /stream HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" + chunks,
            {"n": len(raw)})


def test_any_split_of_a_pipelined_stream_gets_the_same_answers(wire):
    """Requests of three kinds, back to back on one connection, cut at
    arbitrary bytes into separate writes: every answer comes, in order, the
    same as when each request is sent whole."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
    @given(kinds=st.lists(st.integers(0, 2), min_size=1, max_size=6),
           cuts=st.lists(st.integers(1, 400), min_size=0, max_size=30))
    def check(kinds: list[int], cuts: list[int]) -> None:
        reqs = [_request(k, i) for i, k in enumerate(kinds)]
        stream = b"".join(r for r, _ in reqs)
        stream += b"GET /echo HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        pieces, pos = [], 0
        for cut in cuts:
            if pos >= len(stream):
                break
            pieces.append(stream[pos:pos + cut])
            pos += cut
        pieces.append(stream[pos:])

        async def talk() -> bytes:
            reader, writer = await asyncio.open_connection("127.0.0.1", wire.port)
            for piece in pieces:
                if piece:
                    writer.write(piece)
                    await writer.drain()
                    await asyncio.sleep(0.001)  # apart, so that they arrive apart
            got = await asyncio.wait_for(reader.read(), 20)  # until the service closes
            writer.close()
            return got
        answers = parse_all(wire.run(talk()))
        assert [s for s, _, _ in answers] == [200] * (len(reqs) + 1)
        assert [json.loads(b) for _, _, b in answers[:-1]] == [want for _, want in reqs]
    check()
