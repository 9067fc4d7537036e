"""How much CPU a worker process may use, and what the workers of one machine may use together.

A worker's CPU set (`os.sched_getaffinity`) is not the whole story: a container started with `docker run
--cpus 2`, a Kubernetes pod with a CPU limit, or a systemd slice with `CPUQuota` sees every core of its host
in its CPU set and gets CPU time for only some of them, through its cgroup's quota (the CFS bandwidth
limit: `cpu.max` under cgroup v2, `cpu.cfs_quota_us` and `cpu.cfs_period_us` under v1). `cpu_share` reads
both in the worker (the controller runs it there through `client.run`), and which machine it runs on;
`machines` tells which workers share a machine, and `machine_cores` adds up the workers of each. Workers
in one cgroup share its quota; cgroups of their own (a container each) add theirs up, each within its
enclosing cgroups' quotas and its workers' CPU sets; no machine has more than the union of its workers'
CPU sets.

Torch-free, as everything in this package: a worker unpickles `cpu_share` on its event loop, maybe before
it has imported torch.
"""

from __future__ import annotations

import itertools
import math
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import NamedTuple

PROC_CGROUP = Path("/proc/self/cgroup")
PROC_MOUNTINFO = Path("/proc/self/mountinfo")
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


class CpuShare(NamedTuple):
    """What one worker process may use: its CPU set, and each cgroup with a CPU quota that holds it, from its
    own up (`quotas`: the cgroup's identity, the device and inode of its directory, the same for every
    process in it, and its quota in cores). `machine`: its kernel's boot id, the same in every container and
    network namespace of one machine ("" where it cannot be read)."""

    cpus: frozenset[int]
    quotas: tuple[tuple[str, float], ...] = ()
    machine: str = ""

    @property
    def quota(self) -> float | None:
        """The CPU time it may use at most, in cores: its tightest quota (None: no quota)."""
        return min((cores for _, cores in self.quotas), default=None)


class CpuMount(NamedTuple):
    """A mounted cgroup hierarchy that has the cpu controller: where it is mounted (`point`), which cgroup
    of the hierarchy is its top there (`root`: "/" on a host, the container's own cgroup in a container
    that sees no cgroup namespace), and whether it is cgroup v2 (`unified`)."""

    point: Path
    root: str
    unified: bool


def cpu_share() -> CpuShare:
    """This process's `CpuShare` (run in a worker by the controller). A cgroup that cannot be read (not
    Linux, an unusual mount) counts as no quota: the CPU set alone then decides, as it did before."""
    cpus = frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else frozenset()
    try:
        machine = BOOT_ID.read_text().strip()
    except OSError:
        machine = ""
    try:
        cgroups = PROC_CGROUP.read_text()
        mounts = PROC_MOUNTINFO.read_text()
    except OSError:
        return CpuShare(cpus, machine=machine)
    for mount in cpu_mounts(mounts):
        path = cgroup_path(cgroups, mount.unified)
        directory = None if path is None else cgroup_directory(mount, path)
        if directory is None:
            continue
        quotas = []
        for where, cores in quotas_up(directory, mount.point, mount.unified):
            try:
                stat = where.stat()
            except OSError:  # (removed meanwhile: a cgroup of no process any more)
                continue
            quotas.append((f"{stat.st_dev}:{stat.st_ino}", cores))
        return CpuShare(cpus, tuple(quotas), machine)
    return CpuShare(cpus, machine=machine)


def machines(shares: Mapping[str, CpuShare], hosts: Mapping[str, str]) -> dict[str, str]:
    """Each worker's machine (by worker, for every worker of `hosts`): its kernel's boot id where it read
    one, so that workers in containers or network namespaces of one machine, each with an address of its
    own, count as the one machine whose cores they share; else its host address (`hosts`)."""
    return {
        worker: f"boot {shares[worker].machine}" if worker in shares and shares[worker].machine else host
        for worker, host in hosts.items()
    }


def cpu_mounts(mountinfo: str, controllers: Callable[[Path], list[str]] | None = None) -> list[CpuMount]:
    """The cgroup hierarchies with the cpu controller in a `/proc/self/mountinfo` (v1 ones first: on a
    hybrid host the v2 hierarchy has no cpu controller). Each line: `id parent dev root point options
    [optional fields] - fstype source super-options`. `controllers`: a v2 hierarchy's controllers, by its
    mount point (its `cgroup.controllers`)."""
    listed = controllers or _controllers
    found: list[CpuMount] = []
    for line in mountinfo.splitlines():
        fields = line.split()
        if "-" not in fields:
            continue
        dash = fields.index("-")
        if dash < 6 or len(fields) < dash + 2:
            continue
        fstype = fields[dash + 1]
        options = fields[dash + 3].split(",") if len(fields) > dash + 3 else []
        root, point = _unescaped(fields[3]), Path(_unescaped(fields[4]))
        if fstype == "cgroup" and "cpu" in options:
            found.insert(0, CpuMount(point, root, unified=False))
        elif fstype == "cgroup2" and "cpu" in listed(point):
            found.append(CpuMount(point, root, unified=True))
    return found


def _unescaped(field: str) -> str:
    # (mountinfo writes a space, tab, newline and backslash in a path as an octal escape: `\040`.)
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _controllers(point: Path) -> list[str]:
    try:
        return (point / "cgroup.controllers").read_text().split()
    except OSError:
        return []


def cgroup_path(cgroups: str, unified: bool) -> str | None:
    """This process's cgroup in the hierarchy with the cpu controller, from `/proc/self/cgroup`
    (`id:controllers:path` lines; v2's is `0::path`); None where it has none."""
    for line in cgroups.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if (unified and parts[0] == "0" and controllers == "") or (
            not unified and "cpu" in controllers.split(",")
        ):
            return path
    return None


def cgroup_directory(mount: CpuMount, path: str) -> Path | None:
    """The directory of cgroup `path` under `mount`, or None where it is not there. A mount whose top is a
    cgroup below the hierarchy's (a container's own, seen without a cgroup namespace) holds `path` below
    that top; else `path` lies below the mount point as it is."""
    root = mount.root.rstrip("/")
    if root and (path == root or path.startswith(root + "/")):
        path = path[len(root) :]
    directory = mount.point / path.lstrip("/")
    return directory if directory.is_dir() else None


def quotas_up(directory: Path, top: Path, unified: bool) -> list[tuple[Path, float]]:
    """Each cgroup with a quota among `directory` and its ancestors up to `top`, from `directory` up, with
    its quota in cores: a cgroup gets no more than any of its ancestors allows all of their processes."""
    found: list[tuple[Path, float]] = []
    here = directory
    while True:
        quota = read_quota(here, unified)
        if quota is not None:
            found.append((here, quota))
        if here == top or top not in here.parents:
            return found
        here = here.parent


def read_quota(directory: Path, unified: bool) -> float | None:
    """The quota of the cgroup at `directory`, in cores (quota over period); None where it has none or its
    files cannot be read."""
    try:
        if unified:
            quota, period = (directory / "cpu.max").read_text().split()
            if quota == "max":
                return None
            return int(quota) / int(period)
        quota_us = int((directory / "cpu.cfs_quota_us").read_text())
        if quota_us < 0:
            return None
        return quota_us / int((directory / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None


def machine_cores(shares: Mapping[str, CpuShare], machines: Mapping[str, str]) -> dict[str, float]:
    """The cores each machine's workers may use together, from each worker's `CpuShare` (`shares`, by
    worker) and machine (`machines`, by worker): what its cgroups' quotas allow them, within the union of
    their CPU sets (`_cores`)."""
    grouped: dict[str, list[CpuShare]] = {}
    for worker, share in shares.items():
        # (A CPU set not known, on a platform without one, would read as no core at all: such a worker is
        # left out, and a machine of only such workers is not counted.)
        if share.cpus:
            grouped.setdefault(machines[worker], []).append(share)
    return {machine: _cores(group) for machine, group in grouped.items()}


def _cores(shares: list[CpuShare]) -> float:
    """The cores of one machine's workers: the cgroups with quotas that hold them make a tree (a worker's
    `quotas` go from its own cgroup up); each cgroup gets the least of its quota, the CPU sets of the
    workers under it, and what its child cgroups and its own workers take; the machine, what its top
    cgroups and its workers outside any take, within all of their CPU sets."""
    quota = {group: cores for share in shares for group, cores in share.quotas}
    parent: dict[str, str] = {}
    for share in shares:
        chain = [group for group, _ in share.quotas]
        parent.update(itertools.pairwise(chain))

    def cpus_of(held: list[CpuShare]) -> int:
        return len(frozenset().union(*(share.cpus for share in held)))

    def takes(node: str | None) -> float:
        under = [s for s in shares if node is None or any(group == node for group, _ in s.quotas)]
        own = [s for s in under if (s.quotas[0][0] if s.quotas else None) == node]
        children = [group for group in quota if parent.get(group) == node]
        inner = cpus_of(own) + sum(takes(child) for child in children)
        return min(float(cpus_of(under)), inner, quota[node] if node is not None else math.inf)

    return takes(None)
