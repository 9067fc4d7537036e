"""Sealed memfds that a process makes and its peer on the same machine maps: the shared memory under the
step path's inboxes (`inbox.py`, the peer writes) and published parameters (`published.py`, the peer
reads). One way to make them and one way to open a peer's, so that the checks are the same for both.

Why so strict on the opening side: any process of the machine may connect to a shard's Unix socket and
name a descriptor in a header. A memfd is opened only where it is the peer's own (the pid the kernel gives
for the other end of the socket), by the expected name, sealed at the size named (a peer that could shrink
it would kill the reader with SIGBUS), and begins with the random token named with it.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import secrets

# Set to 0 in the workers' environment to copy every body and every answer through the socket (to
# compare, or to rule shared memory out).
ENV = "PREFECT_ELASTIC_SHARED_MEMORY"
TOKEN_BYTES = 16  # the random token at the start of every such memfd
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


def create(name: str, size: int) -> tuple[int, mmap.mmap, bytes]:
    """A new memfd named `name` of `size` bytes, sealed at that size, mapped, with a fresh token written at
    its start: its descriptor, the mapping and the token. Raises OSError where memfds cannot be made (a
    sandbox, the descriptors or the memory used up)."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS | fcntl.F_SEAL_SEAL)
        memory = mmap.mmap(fd, size)
    except BaseException:
        os.close(fd)
        raise
    token = secrets.token_bytes(TOKEN_BYTES)
    memory[:TOKEN_BYTES] = token
    return fd, memory, token


def open_peers(pid: int, fd: int, name: str, size: int, token: bytes, peer: int) -> mmap.mmap | None:
    """The memfd `fd` of process `pid`, mapped (read and write), or None unless it is `peer`'s own (the
    pid at the other end of the socket; 0 when the kernel cannot tell), named `name`, sealed at `size`
    bytes, and begins with `token`."""
    if pid != peer or pid <= 0 or len(token) != TOKEN_BYTES or size < TOKEN_BYTES:
        return None
    path = f"/proc/{pid}/fd/{fd}"
    try:
        if not os.readlink(path).startswith(f"/memfd:{name} "):
            return None
        handle = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except (OSError, ValueError):
        return None
    try:
        sealed = fcntl.fcntl(handle, fcntl.F_GET_SEALS) & _SEALS == _SEALS
        if not sealed or os.fstat(handle).st_size != size:
            return None
        memory = mmap.mmap(handle, size)
    except (OSError, ValueError):
        return None
    finally:
        os.close(handle)
    if memory[:TOKEN_BYTES] != token:  # (another memfd of the peer's, of an earlier connection)
        memory.close()
        return None
    return memory
