"""The gateway's HTTP server: uvicorn over h11, with the connection limits of GatewayConfig.

uvicorn gives the connection cap (`limit_concurrency`: a request on a connection past
`max_connections` open ones, or past as many requests in flight, gets 503) and the idle
keep-alive timeout (`keep_alive_timeout_s`). The protocol here adds what uvicorn lacks:

- a deadline on each request's line and headers, `header_timeout_s` from connecting, or
  from the first byte of the next request on a kept-alive connection (uvicorn has none:
  a client sending a byte at a time would hold its connection, and a share of
  `max_connections`, forever); then 408 and the connection is closed;
- a cap on their size, `max_header_bytes`, also for a head that arrives whole (h11's
  `max_incomplete_event_size`, set to the same, caps only one that arrives in pieces);
  then 431 and closed.

The body has its own deadline and cap (`body_timeout_s`, `max_body_bytes`: app.RequestGuard).
"""

from __future__ import annotations

import asyncio
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from .config import GatewayConfig, knob


class HeaderTimeoutProtocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on each request's line and headers, and a
    cap on their size."""

    header_timeout_s: float = 10.0
    max_header_bytes: int = 16 * 1024

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]  # as uvicorn's: narrower than asyncio's
        self._header_timer: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():  # reading a request's head
            pending = self.conn.trailing_data[0] + data
            end = pending.find(b"\r\n\r\n", 0, self.max_header_bytes + 4)
            if (end + 4 if end >= 0 else len(pending)) > self.max_header_bytes:
                return self._refuse(431, "Request Header Fields Too Large",
                                    f"the request's line and headers are larger than {self.max_header_bytes} bytes "
                                    f"({knob('max_header_bytes')})")
        super().data_received(data)
        self._watch_head()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # may start a pipelined request already buffered
        self._cancel_header_timer()
        self._watch_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def _watch_head(self) -> None:
        """Armed while part of a request's head is here and the rest is not; off otherwise."""
        if self.transport.is_closing():
            self._cancel_header_timer()
        elif self.conn.their_state is not h11.IDLE:
            self._cancel_header_timer()  # the head is whole: the body, if any, is the app's to time
        elif self._header_timer is None and self.conn.trailing_data[0]:
            self._arm_header_timer()

    def _arm_header_timer(self) -> None:
        self._cancel_header_timer()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_timed_out)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timed_out(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        self._refuse(408, "Request Timeout", f"the request's headers did not arrive within {self.header_timeout_s:g} s "
                                             f"({knob('header_timeout_s')})")

    def _refuse(self, status: int, reason: str, message: str) -> None:
        """Answer `status` and close. No request was parsed, so h11 cannot frame the
        response: it is written as bytes."""
        self._cancel_header_timer()
        body = message.encode()
        self.transport.write(f"HTTP/1.1 {status} {reason}\r\ncontent-type: text/plain; charset=utf-8\r\n"
                             f"connection: close\r\ncontent-length: {len(body)}\r\n\r\n".encode() + body)
        self.transport.close()


def uvicorn_config(config: GatewayConfig, app: Any, **overrides: Any):
    """The uvicorn.Config that serves `app` under `config`'s address and limits."""
    import uvicorn

    protocol = type("GatewayHTTPProtocol", (HeaderTimeoutProtocol,), {
        "header_timeout_s": config.header_timeout_s, "max_header_bytes": config.max_header_bytes})
    settings: dict[str, Any] = dict(
        host=config.host, port=config.port, log_level="warning", timeout_graceful_shutdown=5,
        http=protocol, ws="none", lifespan="on", server_header=False,
        # uvicorn counts the connection asking among the open ones: +1 serves max_connections of them
        limit_concurrency=config.max_connections + 1, timeout_keep_alive=config.keep_alive_timeout_s,
        h11_max_incomplete_event_size=config.max_header_bytes,
    )
    return uvicorn.Config(app, **(settings | overrides))
