"""Imported at interpreter start when this folder is on PYTHONPATH (tests/test_offline.py): every name lookup and
connection to anything but this machine fails, and is recorded, one line each, in the file $YOLO5L_NETBLOCK_LOG.

Loopback stays open: DDP's gloo rendezvous and DataLoader workers talk over it (and Unix sockets).
"""

from __future__ import annotations

import errno
import ipaddress
import os
import socket

_LOG = os.environ.get("YOLO5L_NETBLOCK_LOG")
_LOCAL_NAMES = {"localhost", "localhost.localdomain", "ip6-localhost", ""}


def _is_local(host: object) -> bool:
    if host is None:
        return True
    name = host.decode() if isinstance(host, bytes) else str(host)
    if name.lower() in _LOCAL_NAMES or name == socket.gethostname():
        return True
    try:
        address = ipaddress.ip_address(name.split("%", 1)[0])
    except ValueError:
        return False
    return address.is_loopback or address.is_unspecified


def _record(what: str) -> None:
    if _LOG:
        with open(_LOG, "a") as f:
            f.write(f"{os.getpid()} {what}\n")


_getaddrinfo = socket.getaddrinfo
_connect = socket.socket.connect
_connect_ex = socket.socket.connect_ex


def _blocked_getaddrinfo(host, *args, **kwargs):  # type: ignore[no-untyped-def]
    if not _is_local(host):
        _record(f"getaddrinfo {host}")
        raise socket.gaierror(socket.EAI_NONAME, "network blocked by tests/_netblock")
    return _getaddrinfo(host, *args, **kwargs)


def _remote(sock: socket.socket, address: object) -> bool:
    if sock.family not in (socket.AF_INET, socket.AF_INET6):
        return False  # Unix sockets and the like stay on this machine
    host = address[0] if isinstance(address, tuple) and address else address
    return not _is_local(host)


def _blocked_connect(self, address):  # type: ignore[no-untyped-def]
    if _remote(self, address):
        _record(f"connect {address}")
        raise OSError(errno.ENETUNREACH, "network blocked by tests/_netblock")
    return _connect(self, address)


def _blocked_connect_ex(self, address):  # type: ignore[no-untyped-def]
    if _remote(self, address):
        _record(f"connect_ex {address}")
        return errno.ENETUNREACH
    return _connect_ex(self, address)


socket.getaddrinfo = _blocked_getaddrinfo
socket.socket.connect = _blocked_connect  # type: ignore[method-assign]
socket.socket.connect_ex = _blocked_connect_ex  # type: ignore[method-assign]
