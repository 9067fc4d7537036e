"""What a worker may use of its machine's CPU (`cluster.cpu_share`), read from the formats Linux writes,
and a machine's workers added up (`machines`, `machine_cores`), without a cluster."""

from __future__ import annotations

from pathlib import Path

import pytest

from prefect_elastic.cluster import CpuShare, cpu_share, machine_cores, machines
from prefect_elastic.cluster import cores as cores_module
from prefect_elastic.cluster.cores import CpuMount, cgroup_directory, cgroup_path, cpu_mounts, quotas_up

# A host of cgroup v1 with the cpu controller on a hierarchy of its own and v2 beside it (this machine's);
# a container of Docker on such a host, its own cgroup mounted as the hierarchy's top; a host of cgroup v2.
HOST_V1 = """\
25 24 0:22 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
27 25 0:24 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
28 25 0:25 / /sys/fs/cgroup/cpuacct rw,relatime - cgroup cgroup rw,cpuacct
35 25 0:32 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""
CONTAINER_V1 = """\
700 690 0:24 /docker/4f2a /sys/fs/cgroup/cpu,cpuacct ro,nosuid - cgroup cgroup rw,cpu,cpuacct
701 690 0:25 /docker/4f2a /sys/fs/cgroup/memory ro,nosuid - cgroup cgroup rw,memory
"""
HOST_V2 = """\
29 23 0:26 / /sys/fs/cgroup rw,nosuid shared:4 - cgroup2 cgroup2 rw,nsdelegate
30 23 0:27 /a\\040b /mnt/with\\040space rw shared:5 - cgroup cgroup rw,cpu
"""
CGROUPS_V1 = "4:memory:/docker/4f2a\n1:cpu,cpuacct:/docker/4f2a\n0::/\n"
CGROUPS_V2 = "0::/system.slice/worker.service\n"


def test_the_cpu_controllers_hierarchy_is_found_in_mountinfo() -> None:
    no_v2_cpu = {Path("/sys/fs/cgroup/unified"): ["memory", "pids"]}
    assert cpu_mounts(HOST_V1, lambda point: no_v2_cpu.get(point, [])) == [
        CpuMount(Path("/sys/fs/cgroup/cpu"), "/", unified=False)
    ]
    assert cpu_mounts(CONTAINER_V1) == [CpuMount(Path("/sys/fs/cgroup/cpu,cpuacct"), "/docker/4f2a", False)]
    # v2 where its hierarchy has the cpu controller, after any v1 one; mountinfo's escapes undone.
    assert cpu_mounts(HOST_V2, lambda point: ["cpuset", "cpu", "io"]) == [
        CpuMount(Path("/mnt/with space"), "/a b", unified=False),
        CpuMount(Path("/sys/fs/cgroup"), "/", unified=True),
    ]
    assert cpu_mounts(HOST_V2, lambda point: ["memory"]) == [CpuMount(Path("/mnt/with space"), "/a b", False)]
    assert cpu_mounts("") == []


def test_a_processs_cgroup_is_read_for_its_hierarchy() -> None:
    assert cgroup_path(CGROUPS_V1, unified=False) == "/docker/4f2a"
    assert cgroup_path(CGROUPS_V1, unified=True) == "/"
    assert cgroup_path(CGROUPS_V2, unified=True) == "/system.slice/worker.service"
    assert cgroup_path(CGROUPS_V2, unified=False) is None


def test_a_cgroup_lies_below_its_mount_or_is_the_mounts_top_in_a_container(tmp_path: Path) -> None:
    (tmp_path / "system.slice" / "worker.service").mkdir(parents=True)
    host = CpuMount(tmp_path, "/", unified=True)
    assert cgroup_directory(host, "/system.slice/worker.service") == tmp_path / "system.slice/worker.service"
    # A container sees its own cgroup as the top of the mount (its path names the host's tree).
    container = CpuMount(tmp_path, "/docker/4f2a", unified=False)
    assert cgroup_directory(container, "/docker/4f2a") == tmp_path
    # Neither a cgroup that is not there nor one whose name only begins like the top's is read elsewhere.
    assert cgroup_directory(host, "/gone") is None
    assert cgroup_directory(container, "/docker/4f2ab") is None


def test_every_quota_up_the_tree_is_read_from_the_workers_own_cgroup_up(tmp_path: Path) -> None:
    leaf = tmp_path / "kubepods" / "pod1"
    leaf.mkdir(parents=True)
    (tmp_path / "cpu.max").write_text("max 100000\n")
    (tmp_path / "kubepods" / "cpu.max").write_text("150000 100000\n")
    (leaf / "cpu.max").write_text("max 100000\n")
    assert quotas_up(leaf, tmp_path, unified=True) == [(tmp_path / "kubepods", 1.5)]
    (leaf / "cpu.max").write_text("50000 100000\n")
    assert quotas_up(leaf, tmp_path, unified=True) == [(leaf, 0.5), (tmp_path / "kubepods", 1.5)]
    # v1: -1 is no quota.
    (leaf / "cpu.cfs_quota_us").write_text("-1\n")
    (leaf / "cpu.cfs_period_us").write_text("100000\n")
    assert quotas_up(leaf, tmp_path, unified=False) == []
    (leaf / "cpu.cfs_quota_us").write_text("200000\n")
    assert quotas_up(leaf, tmp_path, unified=False) == [(leaf, 2.0)]


def test_a_worker_on_cgroup_v2_reads_its_quotas_and_its_machine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`cpu_share` from end to end on a cgroup v2 tree written as the kernel shows one."""
    top = tmp_path / "cgroup"
    service = top / "system.slice" / "worker.service"
    service.mkdir(parents=True)
    (top / "cgroup.controllers").write_text("cpuset cpu io memory\n")
    (top / "system.slice" / "cpu.max").write_text("300000 100000\n")
    (service / "cpu.max").write_text("max 100000\n")
    (tmp_path / "mountinfo").write_text(f"29 23 0:26 / {top} rw,nosuid shared:4 - cgroup2 cgroup2 rw\n")
    (tmp_path / "self-cgroup").write_text(CGROUPS_V2)
    (tmp_path / "boot_id").write_text("0f6c-boot\n")
    monkeypatch.setattr(cores_module, "PROC_MOUNTINFO", tmp_path / "mountinfo")
    monkeypatch.setattr(cores_module, "PROC_CGROUP", tmp_path / "self-cgroup")
    monkeypatch.setattr(cores_module, "BOOT_ID", tmp_path / "boot_id")
    share = cpu_share()
    stat = (top / "system.slice").stat()
    assert share.quotas == ((f"{stat.st_dev}:{stat.st_ino}", 3.0),) and share.quota == 3.0
    assert share.machine == "0f6c-boot" and share.cpus
    # A cgroup that is not under the mount (another namespace's path): no quota read from elsewhere.
    (tmp_path / "self-cgroup").write_text("0::/elsewhere\n")
    assert cpu_share().quotas == ()


def test_a_machines_cores_are_its_cpu_sets_or_less_where_cgroup_quotas_allow_less() -> None:
    sixteen = frozenset(range(16))
    at = {"loop": "gpu-box", "shard-0": "gpu-box", "shard-1": "gpu-box", "far": "other"}
    # No quota: the union of the CPU sets (workers pinned to cores of their own add up).
    pinned = {
        "loop": CpuShare(frozenset({0, 1})), "shard-0": CpuShare(frozenset({2})), "far": CpuShare(sixteen)
    }  # fmt: skip
    assert machine_cores(pinned, at) == {"gpu-box": 3.0, "other": 16.0}
    # One container of 2 CPUs' quota holds all three: they share it.
    shared = {w: CpuShare(sixteen, (("0:77", 2.0),)) for w in ("loop", "shard-0", "shard-1")}
    assert machine_cores(shared, at) == {"gpu-box": 2.0}
    # A container each, 1.5 CPUs each: they add up.
    apart = {w: CpuShare(sixteen, ((f"0:{i}", 1.5),)) for i, w in enumerate(("loop", "shard-0", "shard-1"))}
    assert machine_cores(apart, at) == {"gpu-box": 4.5}
    # Containers within a slice of 2 CPUs: the slice bounds them all, one with a quota or not.
    nested = {
        "loop": CpuShare(sixteen, (("0:a", 1.5), ("0:slice", 2.0))),
        "shard-0": CpuShare(sixteen, (("0:slice", 2.0),)),
    }
    assert machine_cores(nested, at) == {"gpu-box": 2.0}
    # A quota over its workers' CPU sets counts no more than their CPU sets.
    capped = {
        "loop": CpuShare(frozenset({0, 1}), (("0:1", 8.0),)),
        "shard-0": CpuShare(frozenset({2, 3}), (("0:2", 0.5),)),
        "shard-1": CpuShare(frozenset({4})),
    }
    assert machine_cores(capped, at) == {"gpu-box": 3.5}
    # A CPU set not known (no such call on the platform): the machine is not counted.
    assert machine_cores({"loop": CpuShare(frozenset())}, at) == {}


def test_workers_of_one_kernel_are_one_machine_whatever_their_addresses() -> None:
    hosts = {"loop": "10.0.0.7", "shard": "10.0.0.8", "far": "10.0.1.9", "silent": "10.0.0.8"}
    shares = {
        "loop": CpuShare(frozenset({0}), machine="b00t"),
        "shard": CpuShare(frozenset({1}), machine="b00t"),
        "far": CpuShare(frozenset({0}), machine="other"),
    }
    found = machines(shares, hosts)
    assert found["loop"] == found["shard"] != found["far"]
    # A worker that did not answer, or read no boot id, is known by its address.
    assert found["silent"] == "10.0.0.8"
    assert machines({"loop": CpuShare(frozenset({0}))}, {"loop": "10.0.0.7"}) == {"loop": "10.0.0.7"}
    assert machine_cores(shares, found) == {found["loop"]: 2.0, found["far"]: 1.0}
