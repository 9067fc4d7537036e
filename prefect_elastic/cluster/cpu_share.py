"""How much CPU a worker process may use, and what the workers of one machine may use together.

A worker's CPU set (`os.sched_getaffinity`) is not the whole story: a container started with `docker run
--cpus 2`, a Kubernetes pod with a CPU limit, or a systemd slice with `CPUQuota` sees every core of its host
in its CPU set and gets CPU time for only some of them, through its cgroup's quota (the CFS bandwidth
limit: `cpu.max` under cgroup v2, `cpu.cfs_quota_us` and `cpu.cfs_period_us` under v1). `cpu_share` reads
both in the worker (the controller runs it there through `client.run`), and which machine it runs on;
`machines` tells which workers share a machine, and `machine_cores` adds up the workers of each. Workers
in one cgroup share its quota; workers in cgroups of their own (a container each) add theirs up; no
machine has more than the union of its workers' CPU sets.

Torch-free, as everything in this package: a worker unpickles `cpu_share` on its event loop, maybe before
it has imported torch.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import NamedTuple

PROC_CGROUP = Path("/proc/self/cgroup")
PROC_MOUNTINFO = Path("/proc/self/mountinfo")
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


class CpuShare(NamedTuple):
    """What one worker process may use: its CPU set, and the CPU time its cgroup's quota allows, in cores
    (`quota`; None: no quota) together with that cgroup's identity (`group`: device and inode of its
    directory, the same for every process in it, "" where there is no quota). `machine`: its kernel's boot
    id, the same in every container and network namespace of one machine ("" where it cannot be read)."""

    cpus: frozenset[int]
    quota: float | None = None
    group: str = ""
    machine: str = ""


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
        if path is None:
            continue
        found = tightest_quota(cgroup_directory(mount, path), mount.point, mount.unified)
        if found is not None:
            quota, where = found
            stat = where.stat()
            return CpuShare(cpus, quota, f"{stat.st_dev}:{stat.st_ino}", machine)
    return CpuShare(cpus, machine=machine)


def machines(shares: Mapping[str, CpuShare], hosts: Mapping[str, str]) -> dict[str, str]:
    """Each worker's machine (by worker, for every worker of `hosts`): its kernel's boot id where it read
    one, so that workers in containers or network namespaces of one machine, each with an address of its
    own, count as the one machine whose cores they share; else its host address (`hosts`)."""
    return {
        worker: f"boot {shares[worker].machine}" if worker in shares and shares[worker].machine else host
        for worker, host in hosts.items()
    }


def cpu_mounts(mountinfo: str) -> list[CpuMount]:
    """The cgroup hierarchies with the cpu controller in a `/proc/self/mountinfo` (v1 ones first: on a
    hybrid host the v2 hierarchy has no cpu controller). Each line: `id parent dev root point options
    [optional fields] - fstype source super-options`."""
    found: list[CpuMount] = []
    for line in mountinfo.splitlines():
        fields = line.split()
        if "-" not in fields:
            continue
        dash = fields.index("-")
        if len(fields) < dash + 2 or dash < 5:
            continue
        fstype = fields[dash + 1]
        options = fields[dash + 3].split(",") if len(fields) > dash + 3 else []
        point = Path(fields[4].replace("\\040", " "))
        if fstype == "cgroup" and "cpu" in options:
            found.insert(0, CpuMount(point, fields[3], unified=False))
        elif fstype == "cgroup2" and "cpu" in _controllers(point):
            found.append(CpuMount(point, fields[3], unified=True))
    return found


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


def cgroup_directory(mount: CpuMount, path: str) -> Path:
    """The directory of cgroup `path` under `mount`: the path below the mount's own top where it lies
    below it, else the path itself; the mount point where that is not a directory (a container's view
    of a host's path)."""
    relative = path[len(mount.root) :] if mount.root != "/" and path.startswith(mount.root) else path
    directory = mount.point / relative.lstrip("/")
    return directory if directory.is_dir() else mount.point


def tightest_quota(directory: Path, top: Path, unified: bool) -> tuple[float, Path] | None:
    """The smallest quota, in cores, of `directory` and its ancestors up to `top` (a cgroup gets no more
    than any of its ancestors), and the directory that sets it; None where none has a quota."""
    best: tuple[float, Path] | None = None
    here = directory
    while True:
        quota = read_quota(here, unified)
        if quota is not None and (best is None or quota < best[0]):
            best = (quota, here)
        if here == top or here.parent == here or top not in here.parents:
            return best
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


def machine_cores(shares: Mapping[str, CpuShare], hosts: Mapping[str, str]) -> dict[str, float]:
    """The cores each machine's workers may use together, from each worker's `CpuShare` (`shares`, by
    worker) and machine (`hosts`, by worker): the union of their CPU sets, or, where quotas allow less,
    the sum over their cgroups of each one's quota (a cgroup's workers share it: counted once) and of the
    CPU sets of the workers without a quota."""
    cpus: dict[str, set[int]] = {}
    grouped: dict[str, dict[str, float]] = {}
    for worker, share in shares.items():
        if not share.cpus:
            continue  # (a CPU set not known: a platform without one; the machine is not counted)
        host = hosts[worker]
        cpus.setdefault(host, set()).update(share.cpus)
        # (A cgroup's quota once however many of its workers report it; a worker without one, its CPU set.)
        key = share.group if share.quota is not None else f"worker {worker}"
        grouped.setdefault(host, {})[key] = share.quota if share.quota is not None else len(share.cpus)
    return {host: min(float(len(ids)), sum(grouped[host].values())) for host, ids in cpus.items()}
