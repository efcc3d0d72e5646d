"""The world's TCP connections, so that leaving a world in place closes them at once.

gloo closes a pair's socket only when its group is freed, and an async collective still in
flight keeps the group alive in gloo's threads until its timeout; a peer blocked on such a
pair waits that long. `meshrun.parallel.elastic` therefore shuts the world's connections down
itself when it changes world (``shutdown(2)``: the peer reads EOF at once, the work in flight
fails). The world's connections are those that appeared while ``init_process_group`` ran
(`meshrun.parallel.init`, `meshrun.parallel.context.rejoin`) and while the script's
``build()`` made its groups: `note_world_sockets` records them around those calls, nothing
else of the script's is touched. A descriptor closed and reused since is recognised by its
addresses and left alone.
"""

from __future__ import annotations

import os
import socket

#: (descriptor, local address, remote address) of each of the world's connections.
_world: set[tuple] = set()


def tcp_connections() -> set[tuple]:
    """This process's connected TCP sockets, as (descriptor, local address, remote address)."""
    import psutil

    try:
        found = psutil.Process().net_connections("tcp")
    except psutil.Error:
        return set()
    return {(c.fd, tuple(c.laddr), tuple(c.raddr)) for c in found if c.fd >= 0 and c.raddr}


def note_world_sockets(before: set[tuple]) -> None:
    """Record the connections made since ``before`` (a `tcp_connections` result) as the
    world's."""
    _world.update(tcp_connections() - before)


def shut_down_world_sockets() -> None:
    """``shutdown(SHUT_RDWR)`` each recorded connection still open as recorded, and forget
    them all."""
    for fd, _local, _remote in _world & tcp_connections():
        try:
            with socket.socket(fileno=os.dup(fd)) as s:
                s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # closed meanwhile
    _world.clear()
