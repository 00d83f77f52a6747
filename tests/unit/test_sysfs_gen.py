"""Consistency tests for tests/sysfs_gen.py (the fake sysfs/procfs tree generator).

The decoders here are deliberately independent of the generator's own helpers.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import sysfs_gen  # tests/ is on sys.path (conftest.py)

TESTS = Path(__file__).resolve().parents[1]

REQUIRED = [
    "epyc-7702p-nps1",
    "epyc-7702p-nps4",
    "epyc-9634-2s",
    "xeon-2s-smt",
    "vmware-88",
    "vmware-88-nonode",
    "hybrid-i9-13900k",
    "arm64-altra-q80",
    "robustness-mix",
    "threadripper-l3-as-numa",
]
CPU = "sys/devices/system/cpu"
NODE = "sys/devices/system/node"


# ----------------------------------------------------------- independent decoders
def dec_mask(text: str) -> set[int]:
    value = 0
    for chunk in text.rstrip("\n").rstrip("\x00").split(","):
        value = value << 32 | int(chunk, 16)
    return {i for i in range(value.bit_length()) if value >> i & 1}


def dec_list(text: str) -> set[int]:
    out: set[int] = set()
    for item in filter(None, text.rstrip("\n").rstrip("\x00").split(",")):
        lo, _, hi = item.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def mask_shape_ok(text: str, nbits: int) -> bool:
    chunks = text.rstrip("\n").rstrip("\x00").split(",")
    lead = (nbits % 32 or 32) + 3
    return (
        len(chunks) == (nbits + 31) // 32
        and len(chunks[0]) == lead // 4
        and all(len(c) == 8 for c in chunks[1:])
    )


def rd(root: Path, rel: str) -> str:
    return (root / rel).read_text().rstrip("\n").rstrip("\x00")


# ------------------------------------------------------------------- encodings
@pytest.mark.parametrize(
    ("cpus", "nbits", "want"),
    [
        (set(), 2, "0"),
        ({0, 1}, 2, "3"),
        (set(range(88)), 88, "ffffff,ffffffff,ffffffff"),
        (set(range(8)), 128, "00000000,00000000,00000000,000000ff"),
        ({0, 64}, 128, "00000000,00000001,00000000,00000001"),
        ({79}, 80, "8000,00000000,00000000"),
        ({31}, 32, "80000000"),
    ],
)
def test_cpumask_matches_kernel_examples(cpus, nbits, want):
    assert sysfs_gen.cpumask(cpus, nbits) == want


@pytest.mark.parametrize(
    ("cpus", "want"),
    [
        ([], ""),
        ([5], "5"),
        ([0, 1], "0-1"),
        ([0, 2, 3, 4, 8], "0,2-4,8"),
        ([3, 8, 9, 10, 11, 12, 13, 14, 15, 19], "3,8-15,19"),
    ],
)
def test_cpulist_format(cpus, want):
    assert sysfs_gen.cpulist(cpus) == want


def test_mask_and_list_roundtrip_random():
    rng = random.Random(1234)
    for _ in range(300):
        nbits = rng.randint(1, 520)
        cpus = {c for c in range(nbits) if rng.random() < 0.3}
        text = sysfs_gen.cpumask(cpus, nbits)
        assert dec_mask(text) == cpus
        assert mask_shape_ok(text, nbits), (text, nbits)
        assert dec_list(sysfs_gen.cpulist(cpus)) == cpus
        assert sysfs_gen.parse_cpulist(sysfs_gen.cpulist(cpus)) == cpus


# --------------------------------------------------------- generic consistency
def test_required_shapes_exist_with_source():
    names = sysfs_gen.shape_names()
    for name in REQUIRED:
        assert name in names
        assert len(sysfs_gen.load_shape(name)["source"]) > 40


@pytest.mark.parametrize("name", sysfs_gen.shape_names())
def test_tree_is_self_consistent(trees, name):
    root = trees(name)
    arm = sysfs_gen.load_shape(name).get("arch") == "aarch64"
    online, possible = dec_list(rd(root, f"{CPU}/online")), dec_list(rd(root, f"{CPU}/possible"))
    present = dec_list(rd(root, f"{CPU}/present"))
    nbits = max(possible) + 1
    assert online <= present <= possible
    assert dec_list(rd(root, f"{CPU}/offline")) == possible - online
    dirs = {int(p.name[3:]) for p in (root / CPU).glob("cpu[0-9]*")}
    assert dirs == present

    threads, l3s = {}, set()
    for c in sorted(present):
        d = root / CPU / f"cpu{c}"
        assert (d / "topology").is_dir() == (c in online)
        assert (d / "online").exists() == (arm or c != 0)
        if c not in online:
            assert not (d / "cache").exists()
            continue
        topo = {}
        for f in (d / "topology").iterdir():
            if f.name.endswith(("_cpus", "_siblings")):
                text = f.read_text()
                assert mask_shape_ok(text, nbits), (f, text)
                topo[f.name] = dec_mask(text)
                assert c in topo[f.name] and topo[f.name] <= online
                lst = f.with_name(f.name + "_list")
                if lst.exists():
                    assert dec_list(lst.read_text()) == topo[f.name], lst
        threads[c] = topo["thread_siblings"]
        assert topo["thread_siblings"] <= topo.get("cluster_cpus", topo["thread_siblings"])
        assert topo.get("cluster_cpus", set()) <= topo["core_siblings"]
        assert topo.get("package_cpus", topo["core_siblings"]) == topo["core_siblings"]
        assert (d / "topology/die_id").exists() == (not arm and "package_cpus" in topo)
        if "die_cpus" in topo:
            assert topo["die_cpus"] == topo["core_siblings"]
        prev = set()
        for i, idx in enumerate(sorted((d / "cache").glob("index*"))):
            shared = dec_mask(rd(idx, "shared_cpu_map"))
            assert c in shared and shared <= online
            if (idx / "shared_cpu_list").exists():
                assert dec_list(rd(idx, "shared_cpu_list")) == shared
            level, ctype = int(rd(idx, "level")), rd(idx, "type")
            assert (level, ctype) == [
                (1, "Data"),
                (1, "Instruction"),
                (2, "Unified"),
                (3, "Unified"),
            ][i]
            assert prev <= shared
            prev = shared
            size = int(rd(idx, "size")[:-1]) * 1024
            assert size == (
                int(rd(idx, "number_of_sets"))
                * int(rd(idx, "ways_of_associativity"))
                * int(rd(idx, "coherency_line_size"))
            )
            if level == 3:
                l3s.add(frozenset(shared))
    for sib in threads.values():  # SMT sibling sets partition the online CPUs
        assert all(threads[s] == sib for s in sib)
    smt_active = any(len(s) > 1 for s in threads.values())
    assert rd(root, f"{CPU}/smt/active") == ("1" if smt_active else "0")
    assert sum(len(s) for s in l3s) == (len(online) if l3s else 0)  # L3s partition too

    if (root / NODE).exists():
        nodes = sorted(int(p.name[4:]) for p in (root / NODE).glob("node[0-9]*"))
        assert dec_list(rd(root, f"{NODE}/online")) == set(nodes)
        seen: list[int] = []
        for n in nodes:
            cpus = dec_mask(rd(root, f"{NODE}/node{n}/cpumap"))
            if (root / NODE / f"node{n}/cpulist").exists():
                assert dec_list(rd(root, f"{NODE}/node{n}/cpulist")) == cpus
            seen += sorted(cpus)
            dist = rd(root, f"{NODE}/node{n}/distance").split()
            assert len(dist) == len(nodes) and dist[nodes.index(n)] == "10"
            assert (root / NODE / f"node{n}/meminfo").read_text().startswith(f"Node {n} MemTotal:")
            for c in cpus:
                assert (root / CPU / f"cpu{c}/node{n}").is_symlink()
                assert (root / CPU / f"cpu{c}/node{n}").resolve() == (root / NODE / f"node{n}")
        # Every online CPU in exactly one node; an offline (memoryless) node's CPUs are
        # named only by their cpuN/nodeM link, which points at no directory.
        possible_nodes = dec_list(rd(root, f"{NODE}/possible"))
        for n in sorted(possible_nodes - set(nodes)):
            assert not (root / NODE / f"node{n}").exists()
            linked = {c for c in online if (root / CPU / f"cpu{c}/node{n}").is_symlink()}
            assert linked and not (root / CPU / f"cpu{next(iter(linked))}/node{n}").exists()
            seen += sorted(linked)
        assert sorted(seen) == sorted(online)
    else:
        assert not list((root / CPU).glob("cpu*/node*"))

    info = (root / "proc/cpuinfo").read_text()
    blocks = [b for b in info.split("\n\n") if b.strip()]
    procs = [int(b.split("\n")[0].split(":")[1]) for b in blocks]
    assert procs == sorted(online)
    for b in blocks:
        kv = {k.strip(): v.strip() for k, _, v in (ln.partition(":") for ln in b.split("\n"))}
        c = int(kv["processor"])
        if arm:
            assert kv["CPU part"].startswith("0x") and "flags" not in b
        else:
            phys = rd(root, f"{CPU}/cpu{c}/topology/physical_package_id")
            assert kv["physical id"] == phys
            assert kv["core id"] == rd(root, f"{CPU}/cpu{c}/topology/core_id")
            assert int(kv["siblings"]) == len(
                dec_mask(rd(root, f"{CPU}/cpu{c}/topology/core_siblings"))
            )
    for f in ("proc/version", "proc/cmdline", "proc/sys/kernel/osrelease"):
        assert (root / f).read_text().endswith("\n")


# ----------------------------------------------------------- shape specifics
def groups(root: Path, rel: str) -> set[frozenset]:
    online = dec_list(rd(root, f"{CPU}/online"))
    return {frozenset(dec_list(rd(root, f"{CPU}/cpu{c}/{rel}"))) for c in online}


def test_epyc_7702p_nps1(trees):
    root = trees("epyc-7702p-nps1")
    assert rd(root, f"{CPU}/online") == "0-127"
    assert rd(root, f"{CPU}/cpu5/topology/thread_siblings_list") == "5,69"
    l3 = groups(root, "cache/index3/shared_cpu_list")
    assert len(l3) == 16 and {len(g) for g in l3} == {8}
    assert rd(root, f"{CPU}/cpu0/cache/index3/shared_cpu_list") == "0-3,64-67"
    assert rd(root, f"{CPU}/cpu127/topology/cluster_id") == "65535"
    assert rd(root, f"{CPU}/cpu127/topology/die_id") == "0"
    assert rd(root, f"{NODE}/node0/cpulist") == "0-127"
    assert not (root / NODE / "node1").exists()


def test_epyc_7702p_nps4(trees):
    root = trees("epyc-7702p-nps4")
    lists = [rd(root, f"{NODE}/node{n}/cpulist") for n in range(4)]
    assert lists == ["0-15,64-79", "16-31,80-95", "32-47,96-111", "48-63,112-127"]
    assert rd(root, f"{NODE}/node0/distance") == "10 12 12 12"
    l3 = groups(root, "cache/index3/shared_cpu_list")
    for n in range(4):  # each node is exactly four CCX
        node = dec_list(lists[n])
        assert len([g for g in l3 if g <= node]) == 4


def test_epyc_9634_2s_smt_off_in_bios(trees):
    root = trees("epyc-9634-2s")
    assert rd(root, f"{CPU}/online") == rd(root, f"{CPU}/possible") == "0-167"
    assert rd(root, f"{CPU}/smt/control") == "notsupported"
    l3 = groups(root, "cache/index3/shared_cpu_list")
    assert len(l3) == 24 and {len(g) for g in l3} == {7}
    assert rd(root, f"{NODE}/node1/cpulist") == "84-167"
    assert rd(root, f"{CPU}/cpu84/topology/physical_package_id") == "1"
    assert rd(root, f"{CPU}/cpu7/topology/core_id") == "8"  # 7 of 8 cores per CCD enabled
    assert rd(root, "sys/kernel/realtime") == "1"
    assert "PREEMPT_RT" in rd(root, "proc/version")
    assert rd(root, f"{CPU}/isolated") == rd(root, f"{CPU}/nohz_full") == "4-83,88-167"


def test_epyc_9634_smt_off_at_runtime(trees):
    root = trees("epyc-9634-2s-smtoff-runtime")
    assert rd(root, f"{CPU}/present") == "0-335"
    assert rd(root, f"{CPU}/offline") == "168-335"
    assert rd(root, f"{CPU}/smt/control") == "off"
    assert rd(root, f"{CPU}/cpu200/online") == "0"
    assert not (root / CPU / "cpu200/topology").exists()
    assert rd(root, f"{CPU}/cpu0/topology/thread_siblings_list") == "0"


def test_xeon_2s_intel_numbering(trees):
    root = trees("xeon-2s-smt")
    assert rd(root, f"{CPU}/cpu0/topology/thread_siblings_list") == "0,80"
    assert rd(root, f"{CPU}/cpu40/topology/thread_siblings_list") == "40,120"
    assert rd(root, f"{CPU}/cpu40/topology/physical_package_id") == "1"
    assert rd(root, f"{CPU}/cpu0/cache/index3/shared_cpu_list") == "0-39,80-119"
    assert rd(root, f"{NODE}/node1/cpulist") == "40-79,120-159"
    assert rd(root, f"{NODE}/node0/distance") == "10 20"
    assert "hypervisor" not in rd(root, "proc/cpuinfo").split()


def test_vmware_88(trees):
    root = trees("vmware-88")
    pkgs = {rd(root, f"{CPU}/cpu{c}/topology/physical_package_id") for c in range(88)}
    assert len(pkgs) == 88
    assert groups(root, "cache/index3/shared_cpu_list") == {frozenset([c]) for c in range(88)}
    assert rd(root, f"{NODE}/node0/cpulist") == "0-87"
    assert rd(root, f"{NODE}/node0/cpumap") == "ffffff,ffffffff,ffffffff"
    assert rd(root, "sys/class/dmi/id/sys_vendor") == "VMware, Inc."
    assert rd(root, "sys/class/dmi/id/product_name") == "VMware Virtual Platform"
    assert " hypervisor " in rd(root, "proc/cpuinfo")
    assert rd(root, f"{CPU}/smt/control") == "notsupported"


def test_vmware_88_nonode(trees):
    root = trees("vmware-88-nonode")
    assert not (root / NODE).exists()
    assert rd(root, f"{CPU}/online") == "0-87"


def test_hybrid_i9_13900k(trees):
    root = trees("hybrid-i9-13900k")
    assert rd(root, "sys/devices/cpu_core/cpus") == "0-15"
    assert rd(root, "sys/devices/cpu_atom/cpus") == "16-31"
    assert rd(root, f"{CPU}/cpu0/topology/thread_siblings_list") == "0-1"
    assert rd(root, f"{CPU}/cpu16/topology/cluster_cpus_list") == "16-19"
    assert rd(root, f"{CPU}/cpu16/cache/index2/shared_cpu_list") == "16-19"
    assert rd(root, f"{CPU}/cpu2/cache/index2/shared_cpu_list") == "2-3"
    assert groups(root, "cache/index3/shared_cpu_list") == {frozenset(range(32))}
    assert rd(root, f"{CPU}/cpu16/topology/core_id") == "32"


def test_arm64_altra(trees):
    root = trees("arm64-altra-q80")
    assert rd(root, f"{CPU}/online") == "0-79"
    assert not (root / CPU / "cpu0/topology/die_id").exists()
    assert not (root / CPU / "cpu0/cache/index3").exists()
    assert not (root / CPU / "cpu0/cache/index0/id").exists()
    assert rd(root, f"{CPU}/cpu0/online") == "1"
    assert rd(root, f"{CPU}/cpu3/topology/cluster_cpus_list") == "2-3"
    assert rd(root, f"{CPU}/smt/control") == "notimplemented"
    info = rd(root, "proc/cpuinfo")
    assert "CPU implementer\t: 0x41" in info and "CPU part\t: 0xd0c" in info


def test_robustness_mix(trees):
    root = trees("robustness-mix")
    assert rd(root, f"{CPU}/present") == "0-7,16-23"
    assert rd(root, f"{CPU}/offline") == "3,8-15,19,24-31"
    assert (root / CPU / "online").read_bytes().endswith(b"\x00\n")
    assert (root / NODE / "node0/cpumap").read_bytes().endswith(b"\x00\n")
    assert not (root / NODE / "node0/cpulist").exists()
    assert not (root / CPU / "cpu5/cache").exists() and (root / CPU / "cpu5/topology").exists()
    assert not (root / CPU / "cpu3/topology").exists()
    assert rd(root, f"{CPU}/cpu7/topology/thread_siblings_list") == "7"
    assert not (root / CPU / "cpu0/topology/die_id").exists()
    assert not (root / CPU / "cpu0/topology/cluster_cpus").exists()
    assert not (root / CPU / "nohz_full").exists()
    assert dec_mask(rd(root, f"{NODE}/node1/cpumap")) == {16, 17, 18, 20, 21, 22, 23}


def test_threadripper_l3_as_numa(trees):
    root = trees("threadripper-l3-as-numa")
    nodes = {frozenset(dec_list(rd(root, f"{NODE}/node{n}/cpulist"))) for n in range(4)}
    assert nodes == groups(root, "cache/index3/shared_cpu_list")
    assert rd(root, f"{NODE}/node0/cpulist") == "0-7,32-39"


def test_memoryless_and_cxl_nodes(trees):
    root = trees("xeon-2s-memoryless-node0")
    assert rd(root, f"{NODE}/online") == "1" and rd(root, f"{NODE}/possible") == "0-1"
    assert rd(root, f"{NODE}/has_memory") == "1"
    assert not (root / NODE / "node0").exists()
    assert os.readlink(root / CPU / "cpu4/node0") == "../../node/node0"
    cxl = trees("epyc-9354-2s-nps4-cxl")
    assert rd(cxl, f"{NODE}/online") == "0-9" and rd(cxl, f"{NODE}/has_cpu") == "0-7"
    assert rd(cxl, f"{NODE}/node8/cpulist") == ""
    assert rd(cxl, f"{NODE}/node9/cpumap") == ",".join(["00000000"] * 4)
    assert rd(cxl, f"{NODE}/node0/distance").split()[-2:] == ["50", "50"]
    assert "MemTotal:       268435456 kB" in rd(cxl, f"{NODE}/node9/meminfo")


def test_shape_dict_masks_only_xen_and_cli(tmp_path):
    shape = {
        **sysfs_gen.load_shape("robustness-mix"),
        "list_files": False,
        "hypervisor_type": "xen",
    }
    assert sysfs_gen.build_tree(shape, tmp_path / "a") == tmp_path / "a"
    assert not list((tmp_path / "a").rglob("*_list"))
    assert (tmp_path / "a" / CPU / "cpu0/topology/thread_siblings").exists()
    assert rd(tmp_path / "a", "sys/hypervisor/type") == "xen"
    proc = subprocess.run(
        [sys.executable, str(TESTS / "sysfs_gen.py"), "robustness-mix", str(tmp_path / "b")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert rd(tmp_path / "b", f"{CPU}/present") == "0-7,16-23"


# --------------------------------------------------------------- host captures
HOSTS = sorted((TESTS / "fixtures" / "sysfs").glob("host-*.tar.gz"))


@pytest.mark.parametrize("tarball", HOSTS, ids=[p.name for p in HOSTS])
def test_host_capture_tarball(tarball):
    with tarfile.open(tarball) as tar:
        members = tar.getmembers()
        names = {m.name for m in members}
        assert all(m.isfile() and not m.name.startswith("/") for m in members)
        for need in (f"{CPU}/online", f"{CPU}/possible", "proc/cpuinfo", "proc/version"):
            assert need in names
        online = dec_list(tar.extractfile(f"{CPU}/online").read().decode())
        for c in online:
            f = tar.extractfile(f"{CPU}/cpu{c}/topology/thread_siblings_list")
            assert c in dec_list(f.read().decode())
