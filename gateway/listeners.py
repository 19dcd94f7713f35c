"""The listening sockets of a process group (``gateway.processes``), by mode.

- ``reuseport`` (the default): the supervisor binds one ``SO_REUSEPORT`` socket per slot and
  the member of that slot inherits it. The kernel spreads connections evenly over the
  slots. A rolling reload hands the slot's socket from the old member to its replacement:
  the old one closes only its copy, so the connections queued on the socket stay there
  for the new one. When a member dies its slot's socket is closed (the few connections
  queued on it are reset: an error, not a wait) and new connections go to the other
  slots until the replacement gets a new socket.
- ``shared``: one socket, every member accepts from it. Nothing queued is ever lost, but
  an event loop accepts all it finds ready at once, so keep-alive connections can pile up
  on one member.
- ``reuseport-member``: each member binds its own ``SO_REUSEPORT`` socket; a member that
  stops listening resets the connections queued on its socket, reloads included.

``bench/listen_modes.py`` measured the three (docs/processes.md): ``shared`` put up to all
keep-alive connections on one member; ``reuseport-member`` reset connections during a
reload; ``reuseport`` did neither.
"""

from __future__ import annotations

import socket

MODES = ("reuseport", "shared", "reuseport-member")
BACKLOG = 4096


class Listeners:
    def __init__(self, mode: str, host: str, port: int, size: int) -> None:
        if mode not in MODES:
            raise ValueError(f"listen mode must be one of {', '.join(MODES)}, not {mode!r}")
        self.mode, self.host, self.port = mode, host, port
        self.socks: list[socket.socket | None] = [None] * size

    def open(self) -> None:
        """Bind before any member starts (a port that is taken fails the group at once)."""
        if self.mode == "reuseport-member":
            return
        first = bind(self.host, self.port, reuse_port=self.mode == "reuseport")
        self.port = first.getsockname()[1]  # port 0: the one the kernel chose, for every slot
        self.socks[0] = first
        if self.mode == "shared":
            self.socks = [first] * len(self.socks)

    def for_slot(self, index: int) -> socket.socket | None:
        """The socket a new member of slot ``index`` inherits (None: it binds its own)."""
        if self.mode == "reuseport" and self.socks[index] is None:
            self.socks[index] = bind(self.host, self.port, reuse_port=True)
        return self.socks[index]

    def release(self, index: int) -> None:
        """No member serves slot ``index`` now: its connections go to the other slots."""
        if self.mode == "reuseport" and self.socks[index] is not None:
            self.socks[index].close()
            self.socks[index] = None

    def close(self) -> None:
        for sock in {id(s): s for s in self.socks if s is not None}.values():
            sock.close()
        self.socks = [None] * len(self.socks)


def bind(host: str, port: int, reuse_port: bool) -> socket.socket:
    """A listening socket that members inherit."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.listen(BACKLOG)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock
