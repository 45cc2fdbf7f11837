"""The inference port's HTTP/1.1 server: httptools' parser on an asyncio Protocol.

Tornado's own HTTP/1 connection is pure Python: a coroutine per request,
its header parsing and buffering were most of the supervisor's CPU per
single-text request once the RequestHandler was out of the way
(frontend/fastpath.py). This server parses with httptools (llhttp, the
parser Node.js uses, in C) and drives the very same delegate Tornado's
HTTPServer drives: `start_request(server_conn, request_conn)`, then the
message delegate's `headers_received`, `data_received`, `finish` and
`on_connection_close`, with an `httputil.HTTPConnection` (`_Exchange`) to
answer through. So POST /predict and OIP infer go to fastpath.py's lean path
and every other request to the inference Application's handlers, unchanged;
`server.http_parser: tornado` serves the port with Tornado's HTTPServer
instead (the same answers: tests/test_service.py runs on both;
tests/test_httpwire.py checks this server's HTTP byte by byte).

What it keeps of Tornado's HTTP/1.1 behaviour: keep-alive as Tornado decides
it (HTTP/1.1 unless "Connection: close"; HTTP/1.0 only when asked), requests
answered one at a time and in order (pipelined ones wait, reading paused;
and while the client reads none of its answers, the next request waits, as
Tornado waits on its writes),
"100 (Continue)" for "Expect: 100-continue", chunked request bodies, chunked
responses that declare no length, HEAD and 304 without a body, a delegate's
awaitable honoured before the next event (flow control of streamed bodies),
the transport body cap (a connection past it is cut off), the body timeout.
What it adds: a header timeout (`server.header_timeout_s`: a client sending
its request line and headers slowly is cut off, with 408) and an idle
timeout for kept-alive connections (`server.idle_timeout_s`); a malformed
request gets a JSON 400 and a header block over 64 KiB a JSON 431, each
with "Connection: close" (after the answers of the requests before it).
"""
from __future__ import annotations

import asyncio
import collections
import logging
import socket
from typing import Any, Callable

import httptools
from tornado import httputil, netutil

from frontend import jsonwire

log = logging.getLogger("textswap.http")

MAX_HEADER_BYTES = 65536  # Tornado's default max_header_size

# parser events, queued per connection and handed to the delegate in order
_HEADERS, _BODY, _DONE, _END, _REJECT = 0, 1, 2, 3, 4


class _Context:
    """What Tornado's HTTPServerRequest reads of a connection's context."""

    __slots__ = ("remote_ip", "protocol", "address")

    def __init__(self, address: Any) -> None:
        self.address = address
        self.remote_ip = address[0] if isinstance(address, tuple) and address else "0.0.0.0"  # nosec B104 # a name, nothing bound
        self.protocol = "http"

    def __str__(self) -> str:
        return self.remote_ip


def _error_bytes(status: int, code: str, message: str) -> bytes:
    body = jsonwire.dumps({"error": {"code": code, "message": message}})
    reason = httputil.responses.get(status, "Unknown")
    return (f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json; charset=utf-8\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode("latin1") + body


class WireServer:
    """Serves `delegate` (an `httputil.HTTPServerConnectionDelegate`) on HTTP/1.1."""

    def __init__(self, delegate: httputil.HTTPServerConnectionDelegate, *, max_body_size: int,
                 body_timeout: float, header_timeout: float, idle_timeout: float) -> None:
        self.delegate = delegate
        self.max_body_size = max_body_size
        self.body_timeout = body_timeout
        self.header_timeout = header_timeout
        self.idle_timeout = idle_timeout
        self._servers: list[asyncio.Server] = []
        self._sweeper: asyncio.TimerHandle | None = None
        # timeouts fire within this much after their deadline
        self.sweep_s = min(1.0, max(0.05, min(body_timeout or 1.0, header_timeout, idle_timeout) / 4))
        self._starting: list[tuple[asyncio.Task[Any], socket.socket]] = []
        self.connections: set[_Connection] = set()

    def listen(self, port: int, address: str = "") -> None:
        """Binds now (an OSError is the caller's, as with Tornado's listen);
        serving starts on the running loop."""
        loop = asyncio.get_running_loop()
        for sock in netutil.bind_sockets(port, address=address or None):
            self._starting.append((loop.create_task(self._serve(sock)), sock))
        if self._sweeper is None:
            self._sweeper = loop.call_later(self.sweep_s, self._sweep)

    def _sweep(self) -> None:
        """The connections whose timeout's deadline passed (header, body, idle)."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        for conn in [c for c in self.connections if c.deadline and c.deadline <= now]:
            try:
                conn._timeout(conn.timer_kind)
            except Exception:  # pragma: no cover - keep sweeping the others
                log.exception("timing out %s", conn.context)
        self._sweeper = loop.call_later(self.sweep_s, self._sweep)

    async def _serve(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        self._servers.append(await loop.create_server(lambda: _Connection(self), sock=sock))

    def stop(self) -> None:
        """No new connections; those open finish what they are answering."""
        for task, sock in self._starting:
            if not task.done():  # not serving yet: it never will
                task.cancel()
                sock.close()
        # the sweep goes on: the connections still open keep their timeouts
        for server in self._servers:
            server.close()

    @property
    def sockets(self) -> list[socket.socket]:
        return [s for server in self._servers for s in server.sockets]


class _Connection(asyncio.Protocol):
    """One TCP connection: parses, queues the parser's events, and hands them
    to one exchange (request and answer) at a time."""

    def __init__(self, server: WireServer) -> None:
        self.server = server
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.context: _Context | None = None
        self.events: collections.deque[tuple[Any, ...]] = collections.deque()
        self.exchange: _Exchange | None = None  # the request being answered
        self.blocked = False  # waiting on a delegate's awaitable
        self.paused = False  # reading paused: events wait for the answer before them
        self.ended = False  # closing or closed: nothing more is read or handed on
        self.refused = False  # a request was refused: nothing more is read
        self.deadline = 0.0  # loop time the armed timeout fires at (0: none); WireServer sweeps
        self.timer_kind = ""
        self.loop = asyncio.get_running_loop()
        self.in_headers = False
        self.message_done = False
        self.header_bytes = 0
        self.body_bytes = 0
        self.url: list[bytes] = []
        self.headers: list[tuple[bytes, bytes]] = []
        self.write_waiters: list[asyncio.Future[None]] = []
        self.writing_paused = False

    # -- asyncio.Protocol ------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no asyncio.Transport subclass
        self.context = _Context(transport.get_extra_info("peername"))
        self.server.connections.add(self)
        self._arm("idle", self.server.idle_timeout)

    def connection_lost(self, exc: Exception | None) -> None:
        self.ended = True
        self.server.connections.discard(self)
        self._disarm()
        self.resume_writing()  # writers waiting for room: there is none to wait for
        self.events.clear()
        ex, self.exchange = self.exchange, None
        if ex is not None:
            ex.lost()
        try:
            self.server.delegate.on_close(self)
        except Exception:  # pragma: no cover - the delegate's own bug
            log.exception("closing a connection")

    def data_received(self, data: bytes) -> None:
        if self.ended or self.refused:
            return
        if self.in_headers or self.exchange is None:
            self.header_bytes += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # no protocol switch here: the request is answered as plain HTTP,
            # and nothing after it is read
            if not self.ended:
                if not self.message_done:
                    self.events.append((_DONE,))
                self.events.append((_END,))
        except httptools.HttpParserCallbackError as exc:  # a bug of ours, not the client's
            log.error("parsing a request from %s", self.context, exc_info=exc.__context__ or exc)
            self._fail(500, "internal_error", "the request could not be read")
        except httptools.HttpParserError as exc:
            self._fail(400, "bad_request", f"malformed HTTP request: {exc}")
        if self.ended:
            return
        if self.in_headers and self.header_bytes > MAX_HEADER_BYTES and not self.refused:
            self._fail(431, "headers_too_large",
                       f"the request line and headers exceed {MAX_HEADER_BYTES} bytes")
        self._drain()
        if self.events and not self.paused and not self.ended:
            self.paused = True  # the next request waits for this answer: TCP holds the rest
            self.transport.pause_reading()  # type: ignore[union-attr]

    def pause_writing(self) -> None:
        self.writing_paused = True

    def resume_writing(self) -> None:
        self.writing_paused = False
        waiters, self.write_waiters = self.write_waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)
        if self.events and not self.ended:  # requests held back while the client read nothing
            asyncio.get_running_loop().call_soon(self._drain)

    # -- httptools callbacks -----------------------------------------------------
    def on_message_begin(self) -> None:
        self.in_headers = True
        self.message_done = False
        self.url = []
        self.headers = []
        self.body_bytes = 0
        if self.exchange is None:
            self._arm("header", self.server.header_timeout)

    def on_url(self, url: bytes) -> None:
        self.url.append(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.in_headers = False
        self.header_bytes = 0
        if self.ended or self.refused:
            return
        parser = self.parser
        headers = httputil.HTTPHeaders()
        try:
            for name, value in self.headers:
                # the field value without the whitespace around it, as Tornado reads it
                headers.add(name.decode("latin1"), value.decode("latin1").strip(" \t"))
        except httputil.HTTPInputError as exc:  # a value Tornado refuses (a control character)
            self._fail(400, "bad_request", f"malformed HTTP request: {exc}")
            return
        declared = headers.get("Content-Length", "")
        if declared.isdigit() and int(declared) > self.server.max_body_size:
            # as Tornado's server refuses it, before reading a byte of it
            self._fail(413, "body_too_large", f"request body of {int(declared)} bytes exceeds "
                                              f"the limit of {self.server.max_body_size}")
            return
        start_line = httputil.RequestStartLine(parser.get_method().decode("latin1"),
                                               b"".join(self.url).decode("latin1"),
                                               "HTTP/" + parser.get_http_version())
        self.events.append((_HEADERS, start_line, headers, parser.should_keep_alive()))

    def on_body(self, body: bytes) -> None:
        if self.ended or self.refused:
            return
        self.body_bytes += len(body)
        if self.body_bytes > self.server.max_body_size:
            log.info("closing the connection of %s: a body over the transport cap", self.context)
            self._fail(413, "body_too_large",
                       f"request body exceeds the limit of {self.server.max_body_size} bytes")
            return
        self.events.append((_BODY, body))

    def on_message_complete(self) -> None:
        self.message_done = True
        if not self.ended and not self.refused:
            self.events.append((_DONE,))

    # -- handing events to the delegate -----------------------------------------
    def _drain(self) -> None:
        events = self.events
        while events and not self.blocked and not self.ended:
            kind = events[0][0]
            if kind == _HEADERS and (self.exchange is not None or self.writing_paused):
                # the answer before it is not finished yet, or the client is
                # not reading its answers: the next request waits (TCP holds the rest)
                break
            if kind == _REJECT and self.exchange is not None and self.exchange.read_done:
                break  # the refusal is of a request behind the one being answered
            event = events.popleft()
            result: Any = None
            try:
                if kind == _HEADERS:
                    self._disarm()
                    ex = self.exchange = _Exchange(self, event[1], event[2], event[3])
                    ex.delegate = self.server.delegate.start_request(self, ex)
                    if self.server.body_timeout:
                        self._arm("body", self.server.body_timeout)
                    result = ex.delegate.headers_received(event[1], event[2])
                    if result is None:
                        ex.continue_if_expected()
                elif kind == _REJECT:  # of the request being read, or of the next one
                    if self.exchange is None or not self.exchange.started:
                        self._write(event[1])
                    self._close()
                    return
                elif kind == _END:
                    if self.exchange is None:
                        self._close()
                    else:
                        self.exchange.keep_alive = False
                else:
                    ex = self.exchange  # type: ignore[assignment]
                    if ex is None or ex.delegate is None:  # pragma: no cover - events are ordered
                        continue
                    if kind == _BODY:
                        result = ex.delegate.data_received(event[1])
                    else:
                        ex.read_done = True
                        if self.timer_kind == "body":
                            self._disarm()
                        ex.delegate.finish()  # an answer finished in it moves on (_next)
            except Exception:
                log.exception("answering %s", self.context)
                self._close()
                return
            if result is not None:
                self.blocked = True
                asyncio.ensure_future(result).add_done_callback(self._unblock)
        if not events and self.paused and not self.ended:
            self.paused = False
            self.transport.resume_reading()  # type: ignore[union-attr]

    def _unblock(self, future: asyncio.Future[Any]) -> None:
        self.blocked = False
        if self.ended:
            return
        if not future.cancelled() and future.exception() is not None:
            log.error("answering %s", self.context, exc_info=future.exception())
            self._close()
            return
        if self.exchange is not None:
            self.exchange.continue_if_expected()
        self._drain()

    def _next(self) -> None:
        """The exchange is answered and its request read: on to the next one."""
        ex, self.exchange = self.exchange, None
        if ex is None or not ex.keep_alive:
            self._close()
            return
        if self.in_headers:
            self._arm("header", self.server.header_timeout)
        elif not self.events:
            self._arm("idle", self.server.idle_timeout)
        if self.events:
            asyncio.get_running_loop().call_soon(self._drain)

    # -- timeouts and errors -------------------------------------------------------
    def _arm(self, kind: str, seconds: float) -> None:
        """One timeout at a time, a deadline the server's sweep reads (a timer
        a request, armed and cancelled three times over, cost more)."""
        if seconds > 0 and not self.ended:
            self.timer_kind = kind
            self.deadline = self.loop.time() + seconds
        else:
            self._disarm()

    def _disarm(self) -> None:
        self.deadline = 0.0
        self.timer_kind = ""

    def _timeout(self, kind: str) -> None:
        self._disarm()
        if self.ended:
            return
        if kind == "header":
            self._reject(408, "request_timeout", f"the request line and headers did not arrive "
                                                 f"within {self.server.header_timeout:g} s")
        elif kind == "body":
            self._cut(408, "request_timeout",
                      f"the request body did not arrive within {self.server.body_timeout:g} s")
        else:
            self._close()  # idle: nothing to say

    def _reject(self, status: int, code: str, message: str) -> None:
        """An answer of our own where no answer has begun; then the connection ends."""
        if self.exchange is None or not self.exchange.started:
            self._write(_error_bytes(status, code, message))
        self._close()

    def _fail(self, status: int, code: str, message: str) -> None:
        """The request being read is refused: nothing more is read. When it is
        the one being answered (or none is), now; when it is a request behind
        one still being answered, after that answer, in order."""
        self.refused = True
        ex = self.exchange
        if (ex is not None and not ex.read_done) or (ex is None and not self.events):
            self._reject(status, code, message)
        else:
            self.events.append((_REJECT, _error_bytes(status, code, message)))

    def _cut(self, status: int, code: str, message: str) -> None:
        log.info("closing the connection of %s: %s", self.context, message)
        self._reject(status, code, message)

    def _write(self, data: bytes) -> None:
        if not self.ended and self.transport is not None:
            self.transport.write(data)

    def _close(self) -> None:
        self._disarm()
        self.events.clear()
        if self.transport is not None and not self.ended:
            self.transport.close()  # what is written still goes out first
        self.ended = True

    def drained(self) -> asyncio.Future[None]:
        """A future done when the transport takes more writes."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self.writing_paused and not self.ended:
            self.write_waiters.append(future)
        else:
            future.set_result(None)
        return future


class _Exchange(httputil.HTTPConnection):
    """One request and its answer: the `request_conn` its delegate writes to."""

    def __init__(self, conn: _Connection, start_line: httputil.RequestStartLine,
                 headers: httputil.HTTPHeaders, parser_keep_alive: bool) -> None:
        self.conn = conn
        self.context = conn.context
        self.start_line = start_line
        self.delegate: httputil.HTTPMessageDelegate | None = None
        self.keep_alive = parser_keep_alive and self._can_keep_alive(start_line, headers)
        self.read_done = False
        self.started = False  # the status line is written
        self.finished = False
        self.chunked = False
        self.no_body = False  # HEAD, 204, 304
        self.close_callback: Callable[[], None] | None = None
        self.expect_continue = (start_line.version == "HTTP/1.1"
                                and headers.get("Expect", "").lower() == "100-continue")

    @staticmethod
    def _can_keep_alive(start_line: httputil.RequestStartLine, headers: httputil.HTTPHeaders) -> bool:
        """Tornado's rule (HTTP1Connection._can_keep_alive)."""
        connection = headers.get("Connection")
        connection = connection.lower() if connection is not None else None
        if start_line.version == "HTTP/1.1":
            return connection != "close"
        if ("Content-Length" in headers or headers.get("Transfer-Encoding", "").lower() == "chunked"
                or start_line.method in ("HEAD", "GET")):
            return connection == "keep-alive"
        return False

    def continue_if_expected(self) -> None:
        if self.expect_continue and not self.started and not self.read_done:
            self.expect_continue = False
            self.conn._write(b"HTTP/1.1 100 (Continue)\r\n\r\n")

    def lost(self) -> None:
        """The connection closed while this exchange was open: the delegate is
        told while its request was still being read, else the close callback
        (as Tornado tells one or the other, once)."""
        callback, self.close_callback = self.close_callback, None
        if self.delegate is not None and not self.read_done:
            self.read_done = True
            try:
                self.delegate.on_connection_close()
            except Exception:  # pragma: no cover - the delegate's own bug
                log.exception("closing a request")
        elif callback is not None:
            callback()

    # -- httputil.HTTPConnection --------------------------------------------------
    def set_close_callback(self, callback: Callable[[], None] | None) -> None:
        self.close_callback = callback

    def write_headers(self, start_line: httputil.RequestStartLine | httputil.ResponseStartLine,
                      headers: httputil.HTTPHeaders, chunk: bytes | None = None
                      ) -> asyncio.Future[None]:
        assert isinstance(start_line, httputil.ResponseStartLine)
        code = start_line.code
        self.started = True
        version = self.start_line.version
        self.no_body = self.start_line.method == "HEAD" or code in (204, 304)
        self.chunked = (version == "HTTP/1.1" and code not in (204, 304)
                        and "Content-Length" not in headers and "Transfer-Encoding" not in headers)
        if not self.read_done:
            self.keep_alive = False  # answered before its body was read: the rest cannot be framed
        if not self.chunked and not self.no_body and "Content-Length" not in headers:
            self.keep_alive = False  # the body ends where the connection does
        if version == "HTTP/1.1" and not self.keep_alive:
            headers["Connection"] = "close"
        elif version == "HTTP/1.0" and self.keep_alive:
            headers["Connection"] = "Keep-Alive"
        if self.chunked:
            headers["Transfer-Encoding"] = "chunked"
        lines = [f"HTTP/1.1 {code} {start_line.reason}"]
        lines.extend(f"{name}: {value}" for name, value in headers.get_all())
        for line in lines:
            if "\r" in line or "\n" in line:
                raise ValueError(f"illegal characters (CR or LF) in a header: {line!r}")
        data = "\r\n".join(lines).encode("latin1") + b"\r\n\r\n"
        if chunk:
            data += self._framed(chunk)
        self.conn._write(data)
        return self.conn.drained()

    def _framed(self, chunk: bytes) -> bytes:
        if self.no_body or not chunk:
            return b""
        if self.chunked:
            return b"%x\r\n%s\r\n" % (len(chunk), chunk)
        return chunk

    def write(self, chunk: bytes) -> asyncio.Future[None]:
        data = self._framed(chunk)
        if data:
            self.conn._write(data)
        return self.conn.drained()

    def finish(self) -> None:
        if self.finished:
            return
        self.finished = True
        self.close_callback = None
        if self.chunked and not self.no_body:
            self.conn._write(b"0\r\n\r\n")
        conn = self.conn
        if conn.exchange is not self:
            return
        if not self.read_done:
            conn._close()  # answered before the request was read: the connection ends here
        else:
            conn._next()
