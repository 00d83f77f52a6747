"""Topology discovery against generated trees of real machine shapes, captured real trees
(this machine, the lab VMs) and hand-broken trees."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
import sysfs_gen
from conftest import run_local_playbook

from rtfleet.cpulist import (
    TopologyError,
    format_cpulist,
    format_cpumask,
    parse_cpulist,
    parse_cpumask,
)
from rtfleet.planner import PlanError, check_invariants, plan_partition
from rtfleet.topology import read_topology

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent

CAPTURED = sorted((TESTS / "fixtures" / "sysfs").glob("*.tar.gz"))

# name -> (cpus, packages, numa nodes, l3 groups, cpus per l3, threads/core, deceptive)
SHAPES = {
    "epyc-7702p-nps1": (128, 1, 1, 16, 8, 2, False),
    "epyc-7702p-nps4": (128, 1, 4, 16, 8, 2, False),
    "epyc-9634-2s": (168, 2, 2, 24, 7, 1, False),
    "xeon-2s-smt": (160, 2, 2, 2, 80, 2, False),
    "vmware-88": (88, 88, 1, 88, 1, 1, True),
    "vmware-88-nonode": (88, 88, 1, 88, 1, 1, True),
    "hybrid-i9-13900k": (32, 1, 1, 1, 32, 2, False),
    "arm64-altra-q80": (80, 1, 1, 1, 80, 1, False),
    "robustness-mix": (14, 2, 2, 2, 7, 2, False),
    "threadripper-l3-as-numa": (64, 1, 4, 4, 16, 2, False),
    "epyc-7763-2s": (256, 2, 2, 16, 16, 2, False),
    "epyc-9354-2s-nps4-cxl": (128, 2, 10, 16, 8, 2, False),
    "xeon-2s-memoryless-node0": (160, 2, 2, 2, 80, 2, False),
}


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_shape_counts(trees, name):
    cpus, packages, nodes, l3, per_l3, threads, deceptive = SHAPES[name]
    topo = read_topology(str(trees(name)))
    assert len(topo["cpus"]) == cpus
    assert len(topo["packages"]) == packages
    assert len(topo["numa_nodes"]) == nodes
    assert len(topo["l3_groups"]) == l3
    assert {len(g["cpus"]) for g in topo["l3_groups"]} == {per_l3}
    assert topo["smt"]["threads_per_core"] == threads
    assert topo["virtualization"]["deception"]["deceptive"] is deceptive
    # Structural invariants of any topology.
    assert sorted(c for core in topo["cores"] for c in core["cpus"]) == topo["cpus"]
    assert sorted(c for n in topo["numa_nodes"] for c in n["cpus"]) == topo["cpus"]
    assert sorted(c for g in topo["l3_groups"] for c in g["cpus"]) == topo["cpus"]
    json.dumps(topo)  # plain data only


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_default_plan_holds_invariants_or_refuses_deceptive_vm(trees, name):
    topo = read_topology(str(trees(name)))
    if SHAPES[name][-1]:
        with pytest.raises(PlanError, match="hides its real CPU topology"):
            plan_partition(topo)
        return
    plan = plan_partition(topo)
    check_invariants(topo, plan)
    assert plan["runtime_groups"]


def test_epyc_nps4_l3_groups_sit_in_one_node_each(trees):
    topo = read_topology(str(trees("epyc-7702p-nps4")))
    for group in topo["l3_groups"]:
        assert group["numa_node"] is not None
        assert len(group["cpus"]) == 8
    # AMD numbering: CPU n and n + 64 are SMT siblings.
    assert topo["cores"][0]["cpus"] == [0, 64]
    assert topo["l3_groups"][0]["cpus"] == [0, 1, 2, 3, 64, 65, 66, 67]


def test_epyc_9634_whole_ccx_runtime_groups(trees):
    topo = read_topology(str(trees("epyc-9634-2s")))
    plan = plan_partition(topo, {"partial_l3_groups": "pod_pool"})
    assert len(plan["runtime_groups"]) == 22  # 24 CCX minus one per socket for housekeeping
    assert all(len(g["cpus"]) == 7 for g in plan["runtime_groups"])
    assert {g["numa_node"] for g in plan["runtime_groups"]} == {0, 1}


def test_xeon_intel_numbering_siblings(trees):
    topo = read_topology(str(trees("xeon-2s-smt")))
    assert topo["cores"][0]["cpus"] == [0, 80]
    plan = plan_partition(topo)
    assert plan["housekeeping"] == [0, 40, 80, 120]


def test_vmware_guest_verdict_and_evidence(trees):
    topo = read_topology(str(trees("vmware-88")))
    virt = topo["virtualization"]
    assert virt["is_virtual"]
    assert virt["hypervisor"] == "vmware"
    evidence = " ".join(virt["deception"]["evidence"])
    assert "88 CPUs are presented as 88 sockets" in evidence
    assert "single NUMA node" in evidence
    assert "VMware" in evidence


def test_vmware_without_node_directory_assumes_node0(trees):
    topo = read_topology(str(trees("vmware-88-nonode")))
    assert topo["numa_source"].startswith("assumed")
    assert topo["numa_nodes"][0]["cpus"] == list(range(88))


def test_hybrid_core_types(trees):
    topo = read_topology(str(trees("hybrid-i9-13900k")))
    assert topo["hybrid"]
    kinds = [core["type"] for core in topo["cores"]]
    assert kinds.count("performance") == 8
    assert kinds.count("efficiency") == 16


def test_arm64_without_l3_falls_back_to_package_and_node(trees):
    topo = read_topology(str(trees("arm64-altra-q80")))
    assert topo["arch"] == "aarch64"
    assert topo["vendor"] == "ARM"  # Altra's Neoverse N1 cores report implementer 0x41
    assert topo["l3_source"] == "package+numa"
    assert not topo["virtualization"]["is_virtual"]


def test_robustness_offline_sparse_nul_masks(trees):
    topo = read_topology(str(trees("robustness-mix")))
    # present 0-7,16-23; 3 and 19 offline; legacy 4.19 files; cpu5 has no cache/; NULs.
    assert topo["cpus"] == [0, 1, 2, 4, 5, 6, 7, 16, 17, 18, 20, 21, 22, 23]
    assert topo["offline_cpus"] == [3, 19]
    assert topo["l3_source"] == "cache"  # cpu5 joins the set its siblings report
    assert [g["cpus"] for g in topo["l3_groups"]] == [
        [0, 1, 2, 4, 5, 6, 7],
        [16, 17, 18, 20, 21, 22, 23],
    ]
    # The offline CPU's sibling is a core of one thread now; no core is split.
    assert [7] in [core["cpus"] for core in topo["cores"]]
    assert [n["cpus"] for n in topo["numa_nodes"]] == [g["cpus"] for g in topo["l3_groups"]]


def test_l3_as_numa_each_group_is_a_node(trees):
    topo = read_topology(str(trees("threadripper-l3-as-numa")))
    assert sorted(g["numa_node"] for g in topo["l3_groups"]) == [0, 1, 2, 3]
    plan = plan_partition(topo)
    assert all(g["partial_l3"] for g in plan["runtime_groups"])


# ---------------------------------------------------------------- captured real trees


@pytest.mark.parametrize("archive", CAPTURED, ids=[p.name for p in CAPTURED])
def test_captured_real_trees(tmp_path, archive):
    with tarfile.open(archive) as tar:
        tar.extractall(tmp_path, filter="data")
    topo = read_topology(str(tmp_path))
    assert topo["cpus"]
    if "vmware" in archive.name:
        assert topo["virtualization"]["deception"]["deceptive"]
        assert topo["virtualization"]["hypervisor"] == "vmware"
    if "epyc-2ccx" in archive.name:
        assert len(topo["l3_groups"]) == 2
        assert [g["numa_node"] for g in topo["l3_groups"]] == [0, 1]
        check_invariants(topo, plan_partition(topo))


def test_this_machine_reads_and_plans():
    topo = read_topology("/")
    assert topo["cpus"] == sorted(os.sched_getaffinity(0)) or len(topo["cpus"]) >= 1
    assert topo["kernel"]["release"] == os.uname().release


# ---------------------------------------------------------------- bad input


def _write(root, rel, text):
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _minimal(root, cpus=2):
    _write(root, "sys/devices/system/cpu/online", f"0-{cpus - 1}\n")
    for cpu in range(cpus):
        base = f"sys/devices/system/cpu/cpu{cpu}/topology/"
        _write(root, base + "physical_package_id", "0\n")
        _write(root, base + "core_id", f"{cpu}\n")
        _write(root, base + "core_cpus_list", f"{cpu}\n")
    return root


def test_minimal_tree_without_node_cache_proc(tmp_path):
    topo = read_topology(str(_minimal(tmp_path)))
    assert topo["numa_nodes"] == [
        {
            "id": 0,
            "cpus": [0, 1],
            "memory_kb": None,
            "has_memory": True,
            "online": True,
            "distances": [],
            "memory_node": 0,
            "l3_groups": [0],
            "packages": [0],
        }
    ]
    assert topo["memoryless_nodes"] == [] and topo["cpuless_nodes"] == []
    assert topo["l3_source"] == "package+numa"
    assert topo["kernel"]["flavour"] == "stock"


@pytest.mark.parametrize(
    ("rel", "text", "message"),
    [
        ("sys/devices/system/cpu/cpu1/topology/core_id", "one\n", "expected an integer"),
        ("sys/devices/system/cpu/cpu1/topology/core_cpus_list", "1-0\n", "bad cpulist range"),
        ("sys/devices/system/cpu/online", "0-2\n", "CPU 2 is listed online but has no topology"),
        ("sys/devices/system/node/node0/cpulist", "0-1\n", None),
    ],
)
def test_malformed_input_names_the_file(tmp_path, rel, text, message):
    _minimal(tmp_path)
    _write(tmp_path, rel, text)
    if message is None:
        _write(tmp_path, "sys/devices/system/node/node1/cpulist", "1\n")
        with pytest.raises(TopologyError, match="more than one NUMA node") as info:
            read_topology(str(tmp_path))
    else:
        with pytest.raises(TopologyError, match=message) as info:
            read_topology(str(tmp_path))
    assert str(tmp_path) in str(info.value)


def test_not_a_linux_root(tmp_path):
    with pytest.raises(TopologyError, match="must hold sys/ and proc/"):
        read_topology(str(tmp_path))
    with pytest.raises(TopologyError, match="not a directory"):
        read_topology(str(tmp_path / "nope"))


def test_cli_error_is_one_line_not_a_traceback(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "rtfleet.cli", "topology", "--root", str(tmp_path)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 2
    assert result.stderr.startswith("rtfleet: error: ")
    assert "Traceback" not in result.stderr


def test_mask_and_list_codecs():
    assert parse_cpumask("00000000,000000ff\x00\n") == list(range(8))
    assert parse_cpumask("ff,00000000") == list(range(32, 40))
    assert format_cpumask(range(32, 40)) == "ff,00000000"
    assert parse_cpulist("(null)\n") == []
    assert format_cpulist(parse_cpulist("0-3,8,10-11")) == "0-3,8,10-11"
    with pytest.raises(TopologyError, match="not a hex cpumask"):
        parse_cpumask("zz")


# ---------------------------------------------------------------- memoryless and CXL nodes


def _memoryless(tmp_path, **overrides):
    shape = sysfs_gen.load_shape("xeon-2s-memoryless-node0")
    shape.update(overrides)
    return read_topology(str(sysfs_gen.build_tree(shape, tmp_path)))


def _check_memoryless_node0(topo):
    node0, node1 = topo["numa_nodes"]
    socket0 = next(p["cpus"] for p in topo["packages"] if p["id"] == 0)
    assert node0["id"] == 0 and node0["cpus"] == socket0 and 4 in node0["cpus"]
    assert node0["has_memory"] is False and node0["memory_kb"] == 0
    assert node0["memory_node"] == 1 and node1["memory_node"] == 1
    assert topo["memoryless_nodes"] == [0] and topo["cpuless_nodes"] == []
    assert {c["numa_node"] for c in topo["cores"] if c["cpus"][0] in socket0} == {0}
    assert all(g["numa_nodes"] == [g["package"]] for g in topo["l3_groups"])


def test_memoryless_offline_node_is_read_from_cpu_links(tmp_path):
    """node/online "1", no node0/, cpuN/node0 still linked: was "belong to no NUMA node"."""
    topo = _memoryless(tmp_path)
    _check_memoryless_node0(topo)
    assert topo["numa_nodes"][0]["online"] is False and topo["numa_nodes"][1]["online"]
    plan = plan_partition(topo)
    check_invariants(topo, plan)


def test_memoryless_offline_node_without_cpu_links_uses_node_possible(tmp_path):
    _check_memoryless_node0(_memoryless(tmp_path, memoryless_cpu_links=False))


def test_memoryless_online_node_with_memtotal_zero(tmp_path):
    topo = _memoryless(tmp_path, memoryless_style="online")
    _check_memoryless_node0(topo)
    assert topo["numa_nodes"][0]["online"] is True
    assert topo["numa_nodes"][0]["distances"] == [[0, 10], [1, 20]]


def test_unplaceable_cpus_still_fail_with_the_reason(tmp_path):
    root = sysfs_gen.build_tree(
        dict(sysfs_gen.load_shape("xeon-2s-memoryless-node0"), memoryless_cpu_links=False),
        tmp_path,
    )
    (root / "sys/devices/system/node/possible").write_text("1\n")
    with pytest.raises(TopologyError, match=r"belong to no NUMA node .*no candidate"):
        read_topology(str(root))


def test_cxl_cpuless_nodes_are_kept(trees):
    topo = read_topology(str(trees("epyc-9354-2s-nps4-cxl")))
    assert topo["cpuless_nodes"] == [8, 9] and topo["memoryless_nodes"] == []
    cxl = [n for n in topo["numa_nodes"] if n["id"] >= 8]
    assert [(n["cpus"], n["memory_kb"], n["has_memory"]) for n in cxl] == [
        ([], 268435456, True),
        ([], 268435456, True),
    ]
    assert dict(topo["numa_nodes"][0]["distances"])[8] == 50
    assert all(n["memory_node"] == n["id"] for n in topo["numa_nodes"])


# ---------------------------------------------------------------- hostile files


def _hostile_tree(tmp_path, case):
    root = _minimal(tmp_path / "root")
    if case == "huge-range":
        _write(root, "sys/devices/system/cpu/online", "0-99999999\n")
        return root, "sys/devices/system/cpu/online"
    if case == "5000-digits":
        rel = "sys/devices/system/cpu/cpu1/topology/core_id"
        _write(root, rel, "9" * 5000 + "\n")
        return root, rel
    if case == "5000-digit-cpu":
        rel = "sys/devices/system/cpu/cpu1/topology/core_cpus_list"
        _write(root, rel, "1" * 5000 + "\n")
        return root, rel
    if case == "fifo":
        rel = "sys/devices/system/cpu/cpu1/topology/core_cpus_list"
        os.unlink(root / rel)
        os.mkfifo(root / rel)
        return root, rel
    if case == "fifo-meminfo":
        rel = "sys/devices/system/node/node0/meminfo"
        _write(root, "sys/devices/system/node/node0/cpulist", "0-1\n")
        os.mkfifo(root / rel)
        return root, rel
    if case == "huge-file":
        rel = "proc/cmdline"
        _write(root, rel, "quiet " * 400000)
        return root, rel
    raise AssertionError(case)


HOSTILE = ("huge-range", "5000-digits", "5000-digit-cpu", "fifo", "fifo-meminfo", "huge-file")


@pytest.mark.parametrize("case", HOSTILE)
def test_hostile_file_is_a_quick_topology_error_naming_it(tmp_path, case):
    root, rel = _hostile_tree(tmp_path, case)
    started = time.monotonic()
    with pytest.raises(TopologyError) as info:
        read_topology(str(root))
    assert time.monotonic() - started < 1.0
    message = str(info.value)
    assert message.startswith(str(root / rel) + ": ")
    assert "\n" not in message and len(message) < 300


@pytest.mark.parametrize("case", HOSTILE)
def test_hostile_file_cli_exits_2_with_one_line(tmp_path, case):
    root, rel = _hostile_tree(tmp_path, case)
    result = subprocess.run(
        [sys.executable, "-m", "rtfleet.cli", "topology", "--root", str(root)],
        capture_output=True,
        text=True,
        check=False,
        timeout=20,  # a FIFO read used to block forever
    )
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("rtfleet: error: " + str(root / rel) + ": ")
    assert "Traceback" not in result.stderr


def test_cpulist_limits_and_group_syntax():
    with pytest.raises(TopologyError, match="above the 65536-CPU limit"):
        parse_cpulist("0-99999999")
    with pytest.raises(TopologyError, match=r"above the 65536-CPU limit"):
        parse_cpulist("1" * 5000)
    with pytest.raises(TopologyError, match="bad cpulist entry"):
        parse_cpulist("\u00b2")  # str.isdigit() is true for a superscript two
    with pytest.raises(TopologyError, match="above the 65536-CPU limit"):
        parse_cpumask("f" * 20000)
    assert parse_cpulist("65535") == [65535]
    assert parse_cpulist("0-15:2/8") == [0, 1, 8, 9]  # kernel: 2 used of every group of 8
    assert parse_cpulist("0-9:3/4") == [0, 1, 2, 4, 5, 6, 8, 9]


@pytest.mark.parametrize(
    "text", ["0-3,", ",0-3", "0,,1", "0-3, 8", " 0-3", "0-3\n", "0-15:2", "0-1/2", "a", "3-1"]
)
def test_strict_cpulist_refuses_what_kubelet_refuses(text):
    with pytest.raises(TopologyError):
        parse_cpulist(text, "reservedSystemCPUs", strict=True)
    # The kernel's own (lenient) reading of the same file content is unchanged.
    if text not in ("a", "3-1", "0-1/2"):
        parse_cpulist(text)


def test_strict_cpulist_accepts_kubelet_syntax():
    assert parse_cpulist("", strict=True) == []
    assert parse_cpulist("0-1,64-65,7", strict=True) == [0, 1, 7, 64, 65]
    assert parse_cpulist("5-5", strict=True) == [5]


# ---------------------------------------------------------------- Ansible module == CLI


def test_ansible_module_returns_the_same_facts_as_the_cli(tmp_path, trees):
    root = trees("epyc-7702p-nps4")
    playbook = tmp_path / "facts.yml"
    out = tmp_path / "facts.json"
    playbook.write_text(
        "- hosts: localhost\n  gather_facts: false\n  tasks:\n"
        f"    - rtfleet.fleet.cpu_topology:\n        root: {root}\n"
        "    - ansible.builtin.copy:\n"
        f"        dest: {out}\n"
        "        content: '{{ rtfleet_topology | to_json }}'\n"
        "        mode: '0644'\n"
    )
    run = run_local_playbook(playbook)
    assert run.returncode == 0, run.stdout + run.stderr
    cli = subprocess.run(
        [sys.executable, "-m", "rtfleet.cli", "topology", "--root", str(root), "--format", "json"],
        check=True,
        capture_output=True,
        text=True,
    )
    assert json.loads(out.read_text()) == json.loads(cli.stdout)


def test_rt_kernel_and_isolation_in_effect(trees):
    topo = read_topology(str(trees("epyc-9634-2s")))
    assert topo["kernel"]["flavour"] == "rt"
    assert topo["kernel"]["realtime"]
    assert format_cpulist(topo["isolation"]["isolated"]) == "4-83,88-167"
    assert format_cpulist(topo["isolation"]["nohz_full"]) == "4-83,88-167"
    assert topo["smt"] == {"control": "notsupported", "active": False, "threads_per_core": 1}


def test_runtime_nosmt_offline_siblings(trees):
    topo = read_topology(str(trees("epyc-9634-2s-smtoff-runtime")))
    assert len(topo["cpus"]) == 168
    assert topo["offline_cpus"] == list(range(168, 336))
    assert topo["smt"]["control"] == "off"
    assert all(len(core["cpus"]) == 1 for core in topo["cores"])
