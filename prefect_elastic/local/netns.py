"""Network namespaces for partition tests: a worker whose link can be cut and healed, with no netem.

    from prefect_elastic.local.netns import HostNetwork

    with HostNetwork() as net, LocalElasticCluster(host=net.address) as cluster:
        ns = net.namespace()
        name = cluster.add_worker(netns=ns, supervise=True)
        ns.cut()    # every packet in and out of the namespace is dropped: the worker is alive, unreachable
        ns.heal()

`HostNetwork` is a Linux bridge in this (the root) network namespace with the address ``10.77.X.1/24``, on a
``/24`` that no other address of this machine uses; the scheduler and every worker outside a namespace
listen there (`LocalElasticCluster(host=...)`). Each `NetworkNamespace` is joined to the bridge by a veth
pair and has ``10.77.X.k``, so its processes reach the host side, processes in other namespaces, and are
reached from them. `NetworkNamespace.cut` drops every packet on the namespace's end of its link (iptables
``DROP`` on ``INPUT`` and ``OUTPUT``, silent, as a pulled cable or a dead switch looks: no RST, no ICMP; or,
with ``how="link"``, the host end of the link down); traffic inside the namespace (a nanny and its worker)
still flows. `heal` undoes it.

Needs root and the ``ip`` and ``iptables`` commands (``apt-get install iproute2 iptables``); says so
otherwise (`NetworkSetupError`). Names carry this process's id (``prefect-elastic-<pid>-<n>``, links
``pe<pid>...``), so two test runs on one machine never collide, and what a run killed before its clean-up
left behind is removed by the next one (`remove_stale`). Everything made is removed on `close` (also when
making it failed half-way).
"""

from __future__ import annotations

import fcntl
import ipaddress
import itertools
import logging
import os
import re
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from types import TracebackType
from typing import Literal, Self

__all__ = ["CutMode", "HostNetwork", "NetworkNamespace", "NetworkSetupError", "remove_stale"]

log = logging.getLogger(__name__)

CutMode = Literal["drop", "link"]

_NS_PREFIX = "prefect-elastic-"
_LINK_PREFIX = "pe"
_SUPERNET = ipaddress.IPv4Network("10.77.0.0/16")
_LOCK = Path(tempfile.gettempdir()) / "prefect-elastic-netns.lock"
_COMMAND_TIMEOUT_S = 15.0
_serial = itertools.count()
_serial_lock = threading.Lock()


class NetworkSetupError(RuntimeError):
    """The machine cannot make network namespaces (not root, a command missing) or a command failed."""


def _next_serial() -> int:
    with _serial_lock:
        return next(_serial)


def require_tools() -> None:
    """Raise `NetworkSetupError` naming what is missing: root, ``ip``, ``iptables``."""
    missing = [tool for tool in ("ip", "iptables") if shutil.which(tool) is None]
    if missing:
        raise NetworkSetupError(
            f"network namespaces need the commands {missing}, which are not installed: "
            "`apt-get install iproute2 iptables`"
        )
    if os.geteuid() != 0:
        raise NetworkSetupError(
            "network namespaces need root (CAP_NET_ADMIN): run as root, or in a container with "
            "`--cap-add NET_ADMIN`"
        )


def _run(*args: str, check: bool = True) -> str:
    try:
        done = subprocess.run(
            list(args), capture_output=True, text=True, timeout=_COMMAND_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NetworkSetupError(f"`{' '.join(args)}` failed: {exc}") from exc
    if check and done.returncode != 0:
        said = done.stderr.strip() or done.stdout.strip()
        raise NetworkSetupError(f"`{' '.join(args)}` failed with code {done.returncode}: {said}")
    return done.stdout


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale() -> list[str]:
    """Remove the namespaces and links that a process of this module left behind when it was killed
    before its clean-up (its pid, in their names, is gone); return their names. Those of live processes
    (another test run) are left alone."""
    removed: list[str] = []
    for line in _run("ip", "netns", "list").splitlines():
        name = line.split()[0] if line.split() else ""
        found = re.fullmatch(rf"{_NS_PREFIX}(\d+)-\d+", name)
        if found and not _pid_alive(int(found.group(1))):
            _run("ip", "netns", "del", name, check=False)
            removed.append(name)
    for line in _run("ip", "-o", "link", "show").splitlines():
        # "12: pe4242b0: <...>" or "13: pe4242h1@if12: <...>"
        parts = line.split(":")
        link = parts[1].strip().split("@")[0] if len(parts) > 1 else ""
        found = re.fullmatch(rf"{_LINK_PREFIX}(\d+)[bh]\d+", link)
        if found and not _pid_alive(int(found.group(1))):
            _run("ip", "link", "del", link, check=False)
            removed.append(link)
    if removed:
        log.info("removed network namespaces and links left by dead processes: %s", removed)
    return removed


def _used_networks() -> list[ipaddress.IPv4Network]:
    used = []
    for line in _run("ip", "-o", "-4", "addr", "show").splitlines():
        fields = line.split()
        if "inet" in fields:
            used.append(ipaddress.IPv4Interface(fields[fields.index("inet") + 1]).network)
    return used


class _Closed:
    """``with`` closes it (`close()`), whatever happened inside."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class HostNetwork(_Closed):
    """A bridge in the root network namespace on a ``/24`` of ``10.77.0.0/16`` that this machine does
    not use yet, with the host's address ``.1`` (`address`), and the namespaces joined to it."""

    def __init__(self) -> None:
        require_tools()
        self.pid = os.getpid()
        self.bridge = f"{_LINK_PREFIX}{self.pid}b{_next_serial()}"
        self.network: ipaddress.IPv4Network | None = None
        self.namespaces: list[NetworkNamespace] = []
        self._hosts = itertools.count(2)
        self._lock = threading.Lock()
        self._closed = False
        try:
            remove_stale()
            # Choosing a free /24 and taking it is one step for every process on this machine.
            with open(_LOCK, "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                used = _used_networks()
                self.network = next(
                    (n for n in _SUPERNET.subnets(new_prefix=24) if not any(n.overlaps(u) for u in used)),
                    None,
                )
                if self.network is None:
                    raise NetworkSetupError(f"every /24 of {_SUPERNET} is in use on this machine")
                _run("ip", "link", "add", self.bridge, "type", "bridge")
                _run("ip", "addr", "add", f"{self.address}/24", "dev", self.bridge)
                _run("ip", "link", "set", self.bridge, "up")
        except BaseException:
            self.close()
            raise

    @property
    def address(self) -> str:
        """The host side's address: where the scheduler and the workers outside a namespace listen."""
        if self.network is None:
            raise NetworkSetupError("this HostNetwork has no network (its setup failed)")
        return str(self.network.network_address + 1)

    def namespace(self) -> NetworkNamespace:
        """A new network namespace joined to this bridge, with the next free address."""
        if self._closed:
            raise NetworkSetupError("this HostNetwork is closed")
        with self._lock:
            host = next(self._hosts)
        if host > 254:
            raise NetworkSetupError(f"no address left on {self.network} for another namespace")
        ns = NetworkNamespace(self, host)
        with self._lock:
            self.namespaces.append(ns)
        return ns

    def close(self) -> None:
        """Remove every namespace of this network, then the bridge. Idempotent."""
        with self._lock:
            if self._closed and not self.namespaces:
                return
            self._closed = True
            namespaces, self.namespaces = self.namespaces, []
        for ns in namespaces:
            ns.close()
        _run("ip", "link", "del", self.bridge, check=False)

    def __repr__(self) -> str:
        return f"<HostNetwork {self.bridge} {self.network}, {len(self.namespaces)} namespaces>"


class NetworkNamespace(_Closed):
    """One network namespace joined to a `HostNetwork` by a veth pair; made by `HostNetwork.namespace`.

    `exec_prefix` runs a command inside it; `cut` and `heal` partition it from every other process."""

    def __init__(self, network: HostNetwork, host: int) -> None:
        serial = _next_serial()
        self.network = network
        self.name = f"{_NS_PREFIX}{network.pid}-{serial}"
        self.host_link = f"{_LINK_PREFIX}{network.pid}h{serial}"  # in the root namespace, on the bridge
        self.link = f"{_LINK_PREFIX}{network.pid}n{serial}"  # inside the namespace
        assert network.network is not None
        self.address = str(network.network.network_address + host)
        self.cut_mode: CutMode | None = None
        self._closed = False
        try:
            _run("ip", "netns", "add", self.name)
            _run("ip", "link", "add", self.host_link, "type", "veth", "peer", "name", self.link)
            _run("ip", "link", "set", self.link, "netns", self.name)
            _run("ip", "link", "set", self.host_link, "master", network.bridge)
            _run("ip", "link", "set", self.host_link, "up")
            self._in("ip", "addr", "add", f"{self.address}/24", "dev", self.link)
            self._in("ip", "link", "set", self.link, "up")
            self._in("ip", "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise

    def exec_prefix(self) -> list[str]:
        """What to put before a command to run it in this namespace (``ip netns exec NAME``)."""
        return ["ip", "netns", "exec", self.name]

    def _in(self, *args: str, check: bool = True) -> str:
        return _run(*self.exec_prefix(), *args, check=check)

    def _drop_rules(self) -> list[list[str]]:
        # Only the link: traffic inside the namespace (a nanny and its worker, on its own address) goes on.
        return [["INPUT", "-i", self.link, "-j", "DROP"], ["OUTPUT", "-o", self.link, "-j", "DROP"]]

    @property
    def is_cut(self) -> bool:
        return self.cut_mode is not None

    def cut(self, how: CutMode = "drop") -> None:
        """Partition the namespace: ``"drop"`` (iptables DROP of every packet in and out of its link,
        silently: peers see nothing, as with a dead switch) or ``"link"`` (the host end of its link
        down). Cutting what is cut already does nothing."""
        if self._closed:
            raise NetworkSetupError(f"namespace {self.name} is closed")
        if self.cut_mode is not None:
            return
        if how == "drop":
            for rule in self._drop_rules():
                self._in("iptables", "-I", *rule)
        elif how == "link":
            _run("ip", "link", "set", self.host_link, "down")
        else:
            raise ValueError(f"how={how!r}: give 'drop' or 'link'")
        self.cut_mode = how
        log.info("network namespace %s (%s) cut (%s)", self.name, self.address, how)

    def heal(self) -> None:
        """Undo `cut`; healing what is not cut does nothing."""
        mode, self.cut_mode = self.cut_mode, None
        if mode is None or self._closed:
            return
        if mode == "drop":
            for rule in self._drop_rules():
                self._in("iptables", "-D", *rule, check=False)
        else:
            _run("ip", "link", "set", self.host_link, "up")
        log.info("network namespace %s (%s) healed", self.name, self.address)

    def close(self) -> None:
        """Delete the namespace and its link. Processes still in it keep running, unreachable (stop them
        first). Idempotent."""
        if self._closed:
            return
        self._closed = True
        _run("ip", "netns", "del", self.name, check=False)
        # Deleting the namespace deletes its end of the pair, and with it the host end; if the link was
        # never moved in, delete it here.
        _run("ip", "link", "del", self.host_link, check=False)

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("cut" if self.is_cut else "connected")
        return f"<NetworkNamespace {self.name} {self.address} {state}>"
