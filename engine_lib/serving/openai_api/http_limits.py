"""The front door's connection limits, the ones a proxy in front of it would set (nginx's client_header_timeout
and keepalive_timeout).

uvicorn closes a keep-alive connection that stays idle after a response (`timeout_keep_alive`), but has no
limit before a request's headers are complete: a connection that sends nothing, or a byte of its headers now
and then, stays open for good (measured: over 420 s), each one a socket and a slot of the process's files.
`HeaderTimeoutProtocol` closes a connection whose next request's headers are not complete HEADER_TIMEOUT_S
after it opened or after its last response; a request being answered, however long, is never cut.
"""

from __future__ import annotations

import asyncio
from typing import Optional

from uvicorn.protocols.http.h11_impl import H11Protocol

HEADER_TIMEOUT_S = 15.0  # from a connection's start or its last response to its next request's complete headers
KEEP_ALIVE_S = 5.0  # an idle keep-alive connection (no byte of a next request) is closed after this (uvicorn's)
DRAIN_MARGIN_S = 2.0  # at SIGTERM, running requests get the gate's drain and this much to write their answer


class HeaderTimeoutProtocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on request headers. Owned by the event loop: no lock."""

    header_timeout_s = HEADER_TIMEOUT_S

    _header_timer: Optional[asyncio.TimerHandle] = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:  # a request's headers are complete: it is being answered
            self._cancel_header_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.cycle is None or self.cycle.response_complete:  # no pipelined request began meanwhile
            self._arm_header_timer()

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        self._cancel_header_timer()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_too_slow)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            self.transport.close()
