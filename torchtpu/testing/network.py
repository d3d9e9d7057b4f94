"""Which addresses a started server listens on, for tests that servers stay on localhost.

``other_addresses()`` lists this machine's addresses that are not loopback (from the routing
table, so also where the host name resolves only to 127.0.0.1). ``exposed(port)`` returns the
TCP sockets that the processes serving ``port``, and the processes below them, listen on at an
address other than loopback (Linux: read from ``/proc``); ``sockets_of(descendants(pid))`` lists
those of a server known by its process. ``refused(address, port)`` says whether a connection
there fails. A server that stays local exposes no socket and refuses every other address.
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
from pathlib import Path

_LISTEN = "0A"  # the TCP state LISTEN in /proc/net/tcp*


def other_addresses() -> list[str]:
    """This machine's IPv4 addresses that are not loopback (none: an empty list)."""
    found = set()
    trie = Path("/proc/net/fib_trie")
    if trie.exists():  # the kernel's local routes: every address of every interface
        lines = trie.read_text().splitlines()
        for above, line in zip(lines, lines[1:]):
            if "/32 host LOCAL" in line:
                found.add(above.split()[-1])
    try:
        found.update(info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None,
                                                                 socket.AF_INET))
    except OSError:
        pass
    return sorted(a for a in found if not ipaddress.ip_address(a).is_loopback)


def _sockets() -> dict[str, tuple[str, int]]:
    """inode -> (address, port) of every listening TCP socket of this machine."""
    out = {}
    for name in ("tcp", "tcp6"):
        path = Path("/proc/net") / name
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != _LISTEN:
                continue
            hex_address, hex_port = fields[1].split(":")
            raw = bytes.fromhex(hex_address)
            # The kernel writes each 32-bit word in host (little-endian) order.
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            address = ipaddress.ip_address(raw)
            if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped:
                address = address.ipv4_mapped
            out[fields[9]] = (str(address), int(hex_port, 16))
    return out


def _inodes(pid: int) -> set[str]:
    inodes = set()
    try:
        for fd in os.scandir(f"/proc/{pid}/fd"):
            target = os.readlink(fd.path)
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    except OSError:  # gone, or not ours to read
        pass
    return inodes


def _children() -> dict[int, list[int]]:
    below: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:
            continue
        parent = int(re.sub(r"^.*\) ", "", stat, flags=re.S).split()[1])
        below.setdefault(parent, []).append(int(entry.name))
    return below


def descendants(pid: int) -> set[int]:
    """pid and every process below it."""
    below = _children()
    tree, todo = set(), [pid]
    while todo:
        p = todo.pop()
        if p not in tree:
            tree.add(p)
            todo.extend(below.get(p, []))
    return tree


def sockets_of(pids: set[int]) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket these processes listen on."""
    if not Path("/proc/net/tcp").exists():
        raise RuntimeError("torchtpu.unsupported: listening sockets are read from Linux's /proc")
    sockets = _sockets()
    held = set().union(*(_inodes(pid) for pid in pids))
    return sorted({sockets[i] for i in held if i in sockets})


def listening(port: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket listened on by the processes that listen on port
    and by the processes below them."""
    serving = {inode for inode, (_, p) in _sockets().items() if p == port}
    roots = [int(e.name) for e in os.scandir("/proc")
             if e.name.isdigit() and _inodes(int(e.name)) & serving]
    return sockets_of(set().union(*(descendants(pid) for pid in roots)))


def exposed(port: int) -> list[tuple[str, int]]:
    """The sockets of ``listening(port)`` on an address other than loopback."""
    found = listening(port)
    if not any(p == port for _, p in found):
        raise RuntimeError(f"torchtpu.argument: no process of this machine listens on port {port}")
    return [(a, p) for a, p in found if not ipaddress.ip_address(a).is_loopback]


def refused(address: str, port: int, timeout: float = 2.0) -> bool:
    """Whether a TCP connection to address:port fails (refused or unanswered)."""
    try:
        with socket.create_connection((address, port), timeout=timeout):
            return False
    except OSError:
        return True
