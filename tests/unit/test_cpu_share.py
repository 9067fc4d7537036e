"""What a worker may use of its machine's CPU (`cluster.cpu_share`), read from the formats Linux writes,
and a machine's workers added up (`machine_cores`), without a cluster."""

from __future__ import annotations

from pathlib import Path

from prefect_elastic.cluster import CpuShare, machine_cores, machines
from prefect_elastic.cluster.cpu_share import (
    CpuMount,
    cgroup_directory,
    cgroup_path,
    cpu_mounts,
    tightest_quota,
)

# A host of cgroup v1 with the cpu controller on a hierarchy of its own and v2 beside it (this machine's);
# then a container of Docker on such a host: its own cgroup mounted as the hierarchy's top.
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
CGROUPS_V1 = "4:memory:/docker/4f2a\n1:cpu,cpuacct:/docker/4f2a\n0::/\n"
CGROUPS_V2 = "0::/system.slice/worker.service\n"


def test_the_cpu_controllers_hierarchy_is_found_in_mountinfo() -> None:
    assert cpu_mounts(HOST_V1) == [CpuMount(Path("/sys/fs/cgroup/cpu"), "/", unified=False)]
    assert cpu_mounts(CONTAINER_V1) == [CpuMount(Path("/sys/fs/cgroup/cpu,cpuacct"), "/docker/4f2a", False)]
    assert cpu_mounts("") == []


def test_a_processs_cgroup_is_read_for_its_hierarchy() -> None:
    assert cgroup_path(CGROUPS_V1, unified=False) == "/docker/4f2a"
    assert cgroup_path(CGROUPS_V1, unified=True) == "/"
    assert cgroup_path(CGROUPS_V2, unified=True) == "/system.slice/worker.service"
    assert cgroup_path(CGROUPS_V2, unified=False) is None


def test_a_cgroup_lies_below_its_mount_or_is_the_mount_itself_in_a_container(tmp_path: Path) -> None:
    (tmp_path / "system.slice" / "worker.service").mkdir(parents=True)
    host = CpuMount(tmp_path, "/", unified=True)
    assert cgroup_directory(host, "/system.slice/worker.service") == tmp_path / "system.slice/worker.service"
    # A container sees its own cgroup as the top of the mount (its path names the host's tree).
    container = CpuMount(tmp_path, "/docker/4f2a", unified=False)
    assert cgroup_directory(container, "/docker/4f2a") == tmp_path
    assert cgroup_directory(host, "/gone") == tmp_path


def test_the_tightest_quota_up_the_tree_counts_and_names_its_cgroup(tmp_path: Path) -> None:
    leaf = tmp_path / "kubepods" / "pod1"
    leaf.mkdir(parents=True)
    (tmp_path / "cpu.max").write_text("max 100000\n")
    (tmp_path / "kubepods" / "cpu.max").write_text("150000 100000\n")
    (leaf / "cpu.max").write_text("max 100000\n")
    assert tightest_quota(leaf, tmp_path, unified=True) == (1.5, tmp_path / "kubepods")
    (leaf / "cpu.max").write_text("50000 100000\n")
    assert tightest_quota(leaf, tmp_path, unified=True) == (0.5, leaf)
    # v1: -1 is no quota.
    (leaf / "cpu.cfs_quota_us").write_text("-1\n")
    (leaf / "cpu.cfs_period_us").write_text("100000\n")
    assert tightest_quota(leaf, tmp_path, unified=False) is None
    (leaf / "cpu.cfs_quota_us").write_text("200000\n")
    assert tightest_quota(leaf, tmp_path, unified=False) == (2.0, leaf)


def test_a_machines_cores_are_its_cpu_sets_or_less_where_cgroup_quotas_allow_less() -> None:
    sixteen = frozenset(range(16))
    hosts = {"loop": "gpu-box", "shard-0": "gpu-box", "shard-1": "gpu-box", "far": "other"}
    # No quota: the union of the CPU sets (workers pinned to cores of their own add up).
    pinned = {
        "loop": CpuShare(frozenset({0, 1})),
        "shard-0": CpuShare(frozenset({2})),
        "far": CpuShare(sixteen),
    }
    assert machine_cores(pinned, hosts) == {"gpu-box": 3.0, "other": 16.0}
    # One container of 2 CPUs' quota holds all three: they share it.
    shared = {w: CpuShare(sixteen, 2.0, "0:77") for w in ("loop", "shard-0", "shard-1")}
    assert machine_cores(shared, hosts) == {"gpu-box": 2.0}
    # A container each, 1.5 CPUs each: they add up.
    apart = {w: CpuShare(sixteen, 1.5, f"0:{i}") for i, w in enumerate(("loop", "shard-0", "shard-1"))}
    assert machine_cores(apart, hosts) == {"gpu-box": 4.5}
    # A quota over the CPU set counts no more than the CPU set; a worker without a quota adds its CPU set.
    mixed = {"loop": CpuShare(frozenset({0, 1}), 8.0, "0:1"), "shard-0": CpuShare(frozenset({2}))}
    assert machine_cores(mixed, hosts) == {"gpu-box": 3.0}
    # A CPU set not known (no such call on the platform): the machine is not counted.
    assert machine_cores({"loop": CpuShare(frozenset())}, hosts) == {}


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
