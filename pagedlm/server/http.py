"""uvicorn's HTTP/1.1 protocol, with OpenAI-shaped errors for requests it cannot parse, and deadlines.

A request whose framing is broken (a negative ``Content-Length``, a bad
request line) never reaches the app: uvicorn's h11 protocol answers it
itself, in plain text. Clients of this server expect every error as
``{"error": {...}}``, so this subclass answers the same 400 with that body.

Slow clients cannot hold a connection open: a connection has
``header_timeout_s`` to finish a request's headers (from when it opens, or
from the end of the previous response on a kept-alive connection), and a
request ``body_timeout_s`` to finish its body (the app's ``read_body``
answers 408 at that deadline; the protocol closes the connection a second
later for a body nobody reads). A connection beyond ``max_connections`` is
answered 503 and closed at once. `protocol` makes the class with those values.
"""

from __future__ import annotations

import asyncio
import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from .protocol import APIError

BODY_GRACE_S = 1.0  # the app's own 408 comes first


class JSONErrorH11Protocol(H11Protocol):
    header_timeout_s: float | None = None
    body_timeout_s: float | None = None
    max_connections: int | None = None
    _deadline: asyncio.TimerHandle | None = None

    def send_400_response(self, msg: str) -> None:
        body = json.dumps(APIError(400, f"malformed HTTP request: {msg}", code="bad_request").body()).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"),
                      h11.Data(data=body), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()

    # -- deadlines and the connection cap ------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if self.max_connections is not None and len(self.connections) > self.max_connections:
            body = json.dumps(APIError(503, f"the server has {self.max_connections} connections open "
                                       f"(--max-connections); retry later", type="server_error",
                                       code="too_many_connections").body()).encode()
            transport.write(b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
                            b"retry-after: 1\r\nconnection: close\r\ncontent-length: %d\r\n\r\n%s"
                            % (len(body), body))
            transport.close()
            return
        self._arm(self.header_timeout_s)

    def data_received(self, data: bytes) -> None:
        before = self.conn.their_state
        super().data_received(data)
        if self.conn.their_state is not before:
            self._follow()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._follow()  # kept alive: the next request's headers are due

    def _follow(self) -> None:
        """The deadline for what the client owes now: headers, a body, or nothing."""
        state = self.conn.their_state
        if state is h11.IDLE:
            self._arm(self.header_timeout_s)
        elif state is h11.SEND_BODY:
            self._arm(self.body_timeout_s + BODY_GRACE_S if self.body_timeout_s is not None else None)
        else:  # the whole request is in (or the connection is ending)
            self._arm(None)

    def connection_lost(self, exc: Exception | None) -> None:
        self._arm(None)
        super().connection_lost(exc)

    def _arm(self, seconds: float | None) -> None:
        """Close the connection in ``seconds`` (None: no deadline), replacing the previous deadline."""
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline = self.loop.call_later(seconds, self._expire) if seconds is not None else None

    def _expire(self) -> None:
        self._deadline = None
        if not self.transport.is_closing():
            self.transport.close()


def protocol(header_timeout_s: float, body_timeout_s: float, max_connections: int) -> type[JSONErrorH11Protocol]:
    """The protocol class for uvicorn's ``http=``, with these limits."""
    return type("PagedlmH11Protocol", (JSONErrorH11Protocol,), {
        "header_timeout_s": header_timeout_s, "body_timeout_s": body_timeout_s,
        "max_connections": max_connections})
