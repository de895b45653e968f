"""Listening sockets for the gateway and the emulator (the standard library only, so the emulator
can use it without the gateway's dependencies)."""

from __future__ import annotations

import socket


def listen(host: str, port: int, *, reuse_port: bool = False) -> socket.socket:
    """A non-blocking listening TCP socket on ``host:port`` (port 0 picks a free one)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        # Accepted connections inherit it (uvloop sets it too): every SSE event leaves at once.
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((host, port))
        sock.listen(2048)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


def listen_shared(host: str, port: int, count: int) -> list[socket.socket]:
    """``count`` listening sockets on one address (``SO_REUSEPORT``: the kernel spreads new
    connections over them); port 0 picks a free one for all."""
    socks: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = listen(host, port, reuse_port=True)
            socks.append(sock)
            port = sock.getsockname()[1]
    except OSError:
        for sock in socks:
            sock.close()
        raise
    return socks
