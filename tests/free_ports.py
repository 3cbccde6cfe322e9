"""A loopback port P with P + 1 ... P + n - 1 free too, for code that gives its k-th server or process P + k.

One port from bind(0) alone let the second server land on a port another process held (CI, Errno 98)."""

from __future__ import annotations

import contextlib
import socket


def free_ports(n: int) -> int:
    for _ in range(200):
        with contextlib.ExitStack() as stack:
            socks = [stack.enter_context(socket.socket()) for _ in range(n)]
            socks[0].bind(("127.0.0.1", 0))
            port = socks[0].getsockname()[1]
            try:
                for k, s in enumerate(socks[1:], 1):
                    s.bind(("127.0.0.1", port + k))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no {n} consecutive free ports on 127.0.0.1")
