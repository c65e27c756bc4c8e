"""uvicorn's HTTP/1.1 protocol, with OpenAI-shaped errors for requests it cannot parse.

A request whose framing is broken (a negative ``Content-Length``, a bad
request line) never reaches the app: uvicorn's h11 protocol answers it
itself, in plain text. Clients of this server expect every error as
``{"error": {...}}``, so this subclass answers the same 400 with that body.
"""

from __future__ import annotations

import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from .protocol import APIError


class JSONErrorH11Protocol(H11Protocol):
    def send_400_response(self, msg: str) -> None:
        body = json.dumps(APIError(400, f"malformed HTTP request: {msg}", code="bad_request").body()).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"),
                      h11.Data(data=body), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()
