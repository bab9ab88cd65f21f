"""uvicorn's h11 protocol with a header timeout: a connection must send a whole request head
within `header_timeout` seconds of opening, and of each response's end (keep-alive).

uvicorn arms its keep-alive timer only after a response, and cancels it on the first byte
that comes; a connection that never sends anything, or trickles its headers a byte at a time
(slowloris), would otherwise stay open for ever. The timer here runs from the start of each
request's wait until h11 has parsed the request line and headers.

Each connection's kernel send buffer has a fixed size (SEND_BUFFER_BYTES). It also hands
each request a way to drop its connection at once (`ABORT_EXTENSION` in the
scope's extensions), which `CutOffResponse` uses on a client that does not read.

Connections are bounded apart from requests (`ConnectionPool`, --http-max-connections):
uvicorn's `limit_concurrency` counts open connections too, so a flood of idle sockets took
every request slot. Past the bound a new connection closes the one idle longest (waiting for
a request head, as nginx reuses connections), so idle sockets cannot lock requests out.
"""

import asyncio
import socket
from collections import OrderedDict

import h11
import structlog
from kvpager.services.http.streams import ABORT_EXTENSION
from uvicorn.protocols.http.h11_impl import H11Protocol

log = structlog.get_logger(__name__)

# The kernel's share of what a slow client has not taken yet (it doubles the value). Token
# streams need a few kB/s; 256 KiB keeps 1,000 stalled clients under 0.5 GiB instead of 4 GiB.
SEND_BUFFER_BYTES = 256 * 1024


class ConnectionPool:
    """One server's open connections, at most `max_connections`, in the order they last
    became idle: a connection past the bound closes the longest-idle one, or is refused when
    every one has a request in flight."""

    def __init__(self, max_connections: int) -> None:
        self.max_connections = max_connections
        self._open: OrderedDict[HeaderTimeoutProtocol, None] = OrderedDict()

    def admit(self, protocol: "HeaderTimeoutProtocol") -> bool:
        if len(self._open) >= self.max_connections:
            oldest_idle = next((p for p in self._open if p.idle), None)
            if oldest_idle is None:
                return False
            self.remove(oldest_idle)
            oldest_idle.transport.close()
        self._open[protocol] = None
        return True

    def went_idle(self, protocol: "HeaderTimeoutProtocol") -> None:
        if protocol in self._open:
            self._open.move_to_end(protocol)

    def remove(self, protocol: "HeaderTimeoutProtocol") -> None:
        self._open.pop(protocol, None)


class HeaderTimeoutProtocol(H11Protocol):
    header_timeout: float = 10.0  # set per server by `protocol_class`
    pool: ConnectionPool = ConnectionPool(1 << 30)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._header_timer: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        if not self.pool.admit(self):
            log.warning("connection refused: every connection has a request in flight")
            transport.abort()
            return
        sock = transport.get_extra_info("socket")
        if sock is not None:  # a fixed size: no autotuning up to tcp_wmem's 4 MiB a client
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # a request head has been parsed
            self._disarm_header_timer()
            # the request's task has not run yet: it sees this in its scope
            extensions = self.scope.setdefault("extensions", {})
            extensions[ABORT_EXTENSION] = self.transport.abort

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self._arm_header_timer()  # unless a pipelined request is already in

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        self.pool.remove(self)
        super().connection_lost(exc)

    @property
    def idle(self) -> bool:
        """Waiting for a request head: no request of this connection is in flight."""
        return self._header_timer is not None

    def _arm_header_timer(self) -> None:
        self._disarm_header_timer()
        self._header_timer = self.loop.call_later(self.header_timeout, self._on_header_timeout)
        self.pool.went_idle(self)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _on_header_timeout(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            log.info("connection closed: no request head in time", client=self.client)
            self.transport.close()


def protocol_class(header_timeout: float, max_connections: int) -> type[HeaderTimeoutProtocol]:
    """The protocol class for uvicorn's `http=` setting: this server's timeout and pool."""
    attributes = {"header_timeout": header_timeout, "pool": ConnectionPool(max_connections)}
    return type("HeaderTimeoutProtocol", (HeaderTimeoutProtocol,), attributes)
