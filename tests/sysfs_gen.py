#!/usr/bin/env python3
"""Write fake-but-faithful Linux CPU topology trees (``DIR/sys``, ``DIR/proc``) for tests.

Stdlib only.  Layout and value formats follow Linux 6.x (drivers/base/{cpu,topology,node,
cacheinfo}.c, lib/vsprintf.c ``%*pb``/``%*pbl``, arch/x86/kernel/cpu/{proc,topology*,
cacheinfo}.c, arch/arm64/kernel/cpuinfo.c, drivers/base/arch_topology.c + ACPI PPTT).

Usage::

    from sysfs_gen import build_tree          # tests/ on sys.path, or load by file path
    root = build_tree("epyc-7702p-nps1", tmp_path)   # shape name, or a shape dict

    python tests/sysfs_gen.py SHAPE_NAME DIR
    python tests/sysfs_gen.py --list
    python tests/sysfs_gen.py --capture-host OUT.tar.gz   # snapshot this machine

Shapes are JSON files in tests/fixtures/shapes/ (keys documented in README.md there).
Kernel rules encoded here (6.x):
- masks: 32-bit hex chunks, most significant first, joined by ","; every chunk is 8 digits
  except the leading one, which is ceil((nr_cpu_ids % 32) / 4) digits (nr_cpu_ids = highest
  possible CPU + 1).  So 2 CPUs -> ``3``, 88 CPUs -> ``ffffff,ffffffff,ffffffff``.
- topology/ and cache/ exist only for online CPUs; masks only contain online CPUs.
- x86: die_id == physical_package_id (no die level enumerated); Intel cluster_id is the first
  APIC ID sharing the L2; AMD never sets it, so cluster_id is 65535 and cluster_cpus falls back
  to the SMT siblings; cache ``id`` = APIC ID >> order(APIC IDs sharing that cache).
- arm64: no die_* files; ids come from the PPTT (ACPI UID for cores, table offset for
  containers without a valid UID); cache ``id`` is absent without PPTT rev 3 cache IDs.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import sys
import tarfile
from collections import defaultdict
from pathlib import Path

SHAPES_DIR = Path(__file__).resolve().parent / "fixtures" / "shapes"
AMD_CLUSTER_ID = 65535  # BAD_APICID: x86 l2c_id is only computed on Intel


# ---------------------------------------------------------------- kernel value formats
def cpulist(cpus) -> str:
    """``%*pbl``: ``0-3,8-11``; empty set -> ``""``."""
    out, run = [], []
    for c in sorted(set(cpus)):
        if run and c == run[-1] + 1:
            run.append(c)
            continue
        if run:
            out.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
        run = [c]
    if run:
        out.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
    return ",".join(out)


def cpumask(cpus, nbits: int) -> str:
    """``%*pb`` with field width nbits (nr_cpu_ids), exactly as lib/vsprintf.c bitmap_string."""
    value = sum(1 << c for c in set(cpus))
    nchunks = max(1, (nbits + 31) // 32)
    chunks = []
    for i in reversed(range(nchunks)):
        width = 8 if (i < nchunks - 1 or nbits % 32 == 0) else (nbits % 32 + 3) // 4
        chunks.append(f"{(value >> (32 * i)) & 0xFFFFFFFF:0{width}x}")
    return ",".join(chunks)


def parse_cpulist(text: str) -> set[int]:
    out: set[int] = set()
    for part in text.strip("\x00\n ").split(","):
        if part:
            lo, _, hi = part.partition("-")
            out.update(range(int(lo), int(hi or lo) + 1))
    return out


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _order(n: int) -> int:  # get_count_order()
    return max(0, n - 1).bit_length()


# ---------------------------------------------------------------------------- shapes
def shape_names() -> list[str]:
    return sorted(p.stem for p in SHAPES_DIR.glob("*.json"))


def load_shape(name: str) -> dict:
    shape = json.loads((SHAPES_DIR / f"{name}.json").read_text())
    base = shape.pop("extends", None)
    if base:  # shallow overlay on another shape
        merged = load_shape(base)
        merged.update(shape)
        return merged
    return shape


# ------------------------------------------------------------------ model of the machine
def enumerate_cpus(shape: dict) -> list[dict]:
    """One record per present logical CPU, in Linux CPU-number order."""
    arm = shape.get("arch", "x86_64") == "aarch64"
    amd = shape.get("cpuinfo", {}).get("vendor_id") == "AuthenticAMD"
    l3_cores = (shape.get("l3") or {}).get("cores") or sum(t["cores"] for t in shape["core_types"])
    maxthr = max(t.get("threads", 1) for t in shape["core_types"])
    smt_bits = shape.get("apic_smt_bits", 1 if maxthr > 1 else 0)
    numa = shape.get("numa", {})
    ncores = sum(t["cores"] for t in shape["core_types"])
    per_node = numa.get("cores_per_node") or ncores
    nodes_per_pkg = -(-ncores // per_node)

    cores = []  # package-relative core descriptions (identical for every package)
    idx = 0
    for ti, t in enumerate(shape["core_types"]):
        for k in range(t["cores"]):
            if "apic_base" in t:
                rel = t["apic_base"] + k * t["apic_stride"]
            else:  # each L3 domain owns a power-of-two block of APIC core slots
                rel = (idx // l3_cores * _pow2(l3_cores) + idx % l3_cores) << smt_bits
            cl = k // t.get("cluster_cores", t.get("l2_cores", 1))
            cores.append({"type": t, "ti": ti, "idx": idx, "k": k, "rel": rel, "cl": cl})
            idx += 1
    pkg_shift = max(c["rel"] + (1 << smt_bits) - 1 for c in cores).bit_length()

    order = []
    mode = shape.get("numbering", "smt-last")
    npkg = shape.get("sockets", 1)
    if mode == "smt-last":  # AMD/Intel servers: all first threads, then all siblings
        order = [
            (p, c, th)
            for th in range(maxthr)
            for p in range(npkg)
            for c in cores
            if th < c["type"].get("threads", 1)
        ]
    elif mode == "smt-adjacent":  # client parts: siblings numbered next to each other
        order = [
            (p, c, th)
            for p in range(npkg)
            for c in cores
            for th in range(c["type"].get("threads", 1))
        ]
    elif mode == "socket-major":
        order = [
            (p, c, th)
            for p in range(npkg)
            for th in range(maxthr)
            for c in cores
            if th < c["type"].get("threads", 1)
        ]
    else:
        raise ValueError(f"unknown numbering {mode!r}")
    ids = shape.get("cpu_ids") or list(range(len(order)))
    assert len(ids) == len(order), "cpu_ids must list one id per logical CPU"

    offline = set(shape.get("offline_cpus", []))
    out = []
    for cpu, (p, c, th) in zip(ids, order):
        t = c["type"]
        apic = (p << pkg_shift) | c["rel"] | th
        l2 = t.get("l2_cores", 1)
        rec = {
            "cpu": cpu,
            "pkg": p,
            "thread": th,
            "type": t.get("type", "core"),
            "online": cpu not in offline and not (th > 0 and shape.get("smt") == "off"),
            "node": p // numa.get("sockets_per_node", 1) * nodes_per_pkg + c["idx"] // per_node,
            "core_key": (p, c["idx"]),
            "l2_key": (p, c["ti"], c["k"] // l2),
            "l3_key": (p, c["idx"] // l3_cores),
            "cluster_key": (p, c["ti"], c["cl"]),
            "apicid": apic,
        }
        if arm:
            ids_cfg = shape["pptt"]
            ncl = t.get("cluster_cores", 1)
            rec.update(
                package_id=ids_cfg["package_id"] + p * ids_cfg.get("package_stride", 0),
                core_id=(c["idx"] // ncl) << 8 | c["idx"] % ncl,
                cluster_id=ids_cfg["cluster_base"]
                + (c["idx"] // ncl + p * len(cores) // ncl) * ids_cfg["cluster_stride"],
            )
        else:
            l1_span = 1 << smt_bits if t.get("threads", 1) > 1 else 1
            l2_span = _pow2(t.get("apic_stride", 1 << smt_bits) * l2) if l2 > 1 else l1_span
            l3_span = _pow2(l3_cores) << smt_bits if "apic_base" not in t else 1 << pkg_shift
            rec.update(
                package_id=apic >> pkg_shift,
                core_id=(apic & ((1 << pkg_shift) - 1)) >> smt_bits,
                cluster_id=AMD_CLUSTER_ID if amd else apic & ~(l2_span - 1),
                cache_ids=(
                    apic >> _order(l1_span),
                    apic >> _order(l2_span),
                    apic >> _order(l3_span),
                ),
            )
        rec["die_id"] = rec["package_id"]
        out.append(rec)
    return out


def _caches(shape: dict, rec: dict) -> list[dict]:
    t = next(t for t in shape["core_types"] if t.get("type", "core") == rec["type"])
    arm = shape.get("arch", "x86_64") == "aarch64"
    rows = [
        ("l1d", 1, "Data", "core_key"),
        ("l1i", 1, "Instruction", "core_key"),
        ("l2", 2, "Unified", "l2_key"),
    ]
    specs = [(t[k], lvl, typ, key) for k, lvl, typ, key in rows]
    if shape.get("l3"):
        specs.append((shape["l3"], 3, "Unified", "l3_key"))
    out = []
    for spec, lvl, typ, key in specs:
        ways, line = spec.get("ways", 8), spec.get("line", 64)
        out.append(
            {
                "level": lvl,
                "type": typ,
                "size_kb": spec["size_kb"],
                "ways": ways,
                "line": line,
                "sets": spec["size_kb"] * 1024 // (ways * line),
                "key": key,
                "id": None if arm else rec["cache_ids"][lvl - 1],
            }
        )
    return out


# ------------------------------------------------------------------------------ writer
class _Writer:
    def __init__(self, root: Path):
        self.root = root
        self.dirs: set[str] = set()

    def _dir(self, rel: str) -> str:
        path = os.path.join(self.root, rel)
        parent = os.path.dirname(path)
        if parent not in self.dirs:
            os.makedirs(parent, exist_ok=True)
            self.dirs.add(parent)
        return path

    def put(self, rel: str, text: str) -> None:
        with open(self._dir(rel), "w") as fh:
            fh.write(text)

    def link(self, rel: str, target: str) -> None:
        path = self._dir(rel)
        if not os.path.islink(path):
            os.symlink(target, path)


_MEMINFO = [
    ("MemTotal", 1.0),
    ("MemFree", 0.93),
    ("MemUsed", 0),
    ("SwapCached", 0),
    ("Active", 0.021),
    ("Inactive", 0.034),
    ("Active(anon)", 0.004),
    ("Inactive(anon)", 0.011),
    ("Active(file)", 0.017),
    ("Inactive(file)", 0.023),
    ("Unevictable", 0.0002),
    ("Mlocked", 0.0001),
    ("Dirty", 0.00001),
    ("Writeback", 0),
    ("FilePages", 0.041),
    ("Mapped", 0.004),
    ("AnonPages", 0.014),
    ("Shmem", 0.001),
    ("KernelStack", 0.0003),
    ("PageTables", 0.0004),
    ("SecPageTables", 0),
    ("NFS_Unstable", 0),
    ("Bounce", 0),
    ("WritebackTmp", 0),
    ("KReclaimable", 0.004),
    ("Slab", 0.007),
    ("SReclaimable", 0.004),
    ("SUnreclaim", 0.003),
    ("AnonHugePages", 0.006),
    ("ShmemHugePages", 0),
    ("ShmemPmdMapped", 0),
    ("FileHugePages", 0),
    ("FilePmdMapped", 0),
]


def _meminfo(node: int, total_kb: int, hp: int) -> str:
    vals = {k: int(total_kb * f) for k, f in _MEMINFO}
    vals["MemUsed"] = total_kb - vals["MemFree"]
    lines = [f"Node {node} {k + ':':<16}{vals[k]:>8} kB" for k, _ in _MEMINFO]
    lines += [
        f"Node {node} {'HugePages_' + k + ':':<16} {v:>5}"
        for k, v in (("Total", hp), ("Free", hp), ("Surp", 0))
    ]
    return "\n".join(lines) + "\n"


def _x86_cpuinfo(shape: dict, recs: list[dict], online: list[dict]) -> str:
    ci = shape["cpuinfo"]
    amd = ci["vendor_id"] == "AuthenticAMD"
    t0 = shape["core_types"][0]
    cache_kb = t0["l2"]["size_kb"] if amd or not shape.get("l3") else shape["l3"]["size_kb"]
    blocks = []
    for r in online:
        pkg = [o for o in online if o["pkg"] == r["pkg"]]
        fields = [
            ("processor", r["cpu"]),
            ("vendor_id", ci["vendor_id"]),
            ("cpu family", ci["family"]),
            ("model", ci["model"]),
            ("model name", ci["model_name"]),
            ("stepping", ci["stepping"]),
            ("microcode", ci.get("microcode", "0x1")),
            ("cpu MHz", f"{ci['mhz']:.3f}"),
            ("cache size", f"{cache_kb} KB"),
            ("physical id", r["package_id"]),
            ("siblings", len(pkg)),
            ("core id", r["core_id"]),
            ("cpu cores", len({o["core_key"] for o in pkg})),
            ("apicid", r["apicid"]),
            ("initial apicid", r["apicid"]),
            ("fpu", "yes"),
            ("fpu_exception", "yes"),
            ("cpuid level", ci.get("cpuid_level", 16)),
            ("wp", "yes"),
            ("flags", ci["flags"]),
            ("bugs", ci.get("bugs", "")),
            ("bogomips", f"{ci['mhz'] * 2:.2f}"),
        ]
        if amd:
            fields.append(("TLB size", "3072 4K pages"))
        fields += [
            ("clflush size", 64),
            ("cache_alignment", 64),
            ("address sizes", ci.get("address_sizes", "46 bits physical, 57 bits virtual")),
            ("power management", ci.get("power_management", "")),
        ]
        lines = []
        for k, v in fields:  # proc.c: "model\t\t: ", "flags\t\t:" + " flag"..., no tab for PM
            sep = "" if k == "power management" else "\t\t" if len(k) < 8 else "\t"
            lines.append(f"{k}{sep}:" + (f" {v}" if str(v) else ""))
        blocks.append("\n".join(lines) + "\n")
    return "\n".join(blocks) + "\n"


def _arm_cpuinfo(shape: dict, online: list[dict]) -> str:
    ci = shape["cpuinfo"]
    return "".join(
        f"processor\t: {r['cpu']}\nBogoMIPS\t: {ci['bogomips']}\nFeatures\t: {ci['features']}\n"
        f"CPU implementer\t: {ci['implementer']}\nCPU architecture: 8\n"
        f"CPU variant\t: {ci['variant']}\nCPU part\t: {ci['part']}\n"
        f"CPU revision\t: {ci['revision']}\n\n"
        for r in online
    )


def _write_power(w, power: dict | None, online: list[int]) -> None:
    """cpufreq / cpuidle / boost files (drivers/cpufreq, drivers/cpuidle/sysfs.c)."""
    if not power:
        return
    cpu = "sys/devices/system/cpu"
    if power.get("boost") is not None:  # acpi-cpufreq and amd-pstate (passive) global knob
        w.put(f"{cpu}/cpufreq/boost", f"{power['boost']}\n")
    if power.get("amd_pstate_status"):
        w.put(f"{cpu}/amd_pstate/status", power["amd_pstate_status"] + "\n")
    if power.get("intel_no_turbo") is not None:
        w.put(f"{cpu}/intel_pstate/no_turbo", f"{power['intel_no_turbo']}\n")
    if power.get("cpuidle_driver"):
        w.put(f"{cpu}/cpuidle/current_driver", power["cpuidle_driver"] + "\n")
    for c in online:
        if power.get("driver"):
            w.put(f"{cpu}/cpu{c}/cpufreq/scaling_driver", power["driver"] + "\n")
            w.put(
                f"{cpu}/cpu{c}/cpufreq/scaling_governor", power.get("governor", "schedutil") + "\n"
            )
        for k, state in enumerate(power.get("cstates", [])):
            base = f"{cpu}/cpu{c}/cpuidle/state{k}"
            w.put(f"{base}/name", state["name"] + "\n")
            w.put(f"{base}/latency", f"{state['latency']}\n")
            w.put(f"{base}/disable", f"{state.get('disable', 0)}\n")


def build_tree(shape: dict | str, root: Path) -> Path:
    """Write ``root/sys`` and ``root/proc`` for ``shape`` (a dict or a shape name)."""
    if isinstance(shape, str):
        shape = load_shape(shape)
    root = Path(root)
    w = _Writer(root)
    arm = shape.get("arch", "x86_64") == "aarch64"
    recs = enumerate_cpus(shape)
    online = [r for r in recs if r["online"]]
    on_ids = {r["cpu"] for r in online}
    present = {r["cpu"] for r in recs}
    possible = parse_cpulist(shape["possible"]) if "possible" in shape else present
    nbits = max(possible) + 1
    lists = shape.get("list_files", True)
    legacy = shape.get("legacy_topology", False)  # pre-5.x: no die/cluster/core_cpus/pkg_cpus

    cpu = "sys/devices/system/cpu"
    for name, val in (
        ("online", cpulist(on_ids)),
        ("possible", cpulist(possible)),
        ("present", cpulist(present)),
        ("offline", cpulist(possible - on_ids)),
        ("kernel_max", str(shape.get("kernel_max", 4095 if arm else 8191))),
        ("isolated", shape.get("isolated", "")),
    ):
        w.put(f"{cpu}/{name}", val + "\n")
    nohz = shape.get("nohz_full", "(null)")  # CONFIG_NO_HZ_FULL + OFFSTACK mask, not set
    if nohz is not None:
        w.put(f"{cpu}/nohz_full", nohz + "\n")
    smt = shape.get("smt_control")  # BIOS-disabled SMT looks like no SMT: notsupported
    if not smt:
        smt = (
            "off"
            if shape.get("smt") == "off"
            else ("on" if max(r["thread"] for r in recs) else "notsupported")
        )
    w.put(f"{cpu}/smt/control", smt + "\n")
    w.put(f"{cpu}/smt/active", "1\n" if any(r["thread"] and r["online"] for r in recs) else "0\n")
    _write_power(w, shape.get("power"), sorted(on_ids))

    groups: dict = defaultdict(set)
    for r in online:
        for key in ("core_key", "l2_key", "l3_key", "cluster_key", "pkg", "node"):
            groups[key, r[key]].add(r["cpu"])

    no_cache = set(shape.get("no_cache_cpus", []))
    has_nodes = not shape.get("no_node_dir", False)
    offline_nodes = _offline_nodes(shape)
    for r in recs:
        d = f"{cpu}/cpu{r['cpu']}"
        if arm or r["cpu"] != 0:  # x86 can't offline the boot CPU: no cpu0/online
            w.put(f"{d}/online", "1\n" if r["online"] else "0\n")
        if has_nodes:
            if shape.get("memoryless_cpu_links", True) or r["node"] not in offline_nodes:
                w.link(f"{d}/node{r['node']}", f"../../node/node{r['node']}")
            if r["node"] not in offline_nodes:  # an offline node has no nodeN/ at all
                w.link(
                    f"sys/devices/system/node/node{r['node']}/cpu{r['cpu']}",
                    f"../../cpu/cpu{r['cpu']}",
                )
        if not r["online"]:
            continue
        thr = groups["core_key", r["core_key"]]
        pkg = groups["pkg", r["pkg"]]
        clu = (
            thr
            if r.get("cluster_id") == AMD_CLUSTER_ID
            else groups["cluster_key", r["cluster_key"]]
        )
        masks = {"thread_siblings": thr, "core_siblings": pkg}
        ids = {"physical_package_id": r["package_id"], "core_id": r["core_id"]}
        if not legacy:
            masks.update(core_cpus=thr, package_cpus=pkg, cluster_cpus=clu)
            ids["cluster_id"] = r["cluster_id"]
            if not arm:  # TOPOLOGY_DIE_SYSFS is x86/s390 only
                masks["die_cpus"] = pkg
                ids["die_id"] = r["die_id"]
        for name, val in ids.items():
            w.put(f"{d}/topology/{name}", f"{val}\n")
        for name, cpus in masks.items():
            w.put(f"{d}/topology/{name}", cpumask(cpus, nbits) + "\n")
            if lists:
                w.put(f"{d}/topology/{name}_list", cpulist(cpus) + "\n")
        if r["cpu"] in no_cache:
            continue
        for i, c in enumerate(_caches(shape, r)):
            shared = groups[c["key"], r[c["key"]]]
            base = f"{d}/cache/index{i}"
            vals = {
                "level": c["level"],
                "type": c["type"],
                "size": f"{c['size_kb']}K",
                "shared_cpu_map": cpumask(shared, nbits),
                "coherency_line_size": c["line"],
                "ways_of_associativity": c["ways"],
                "number_of_sets": c["sets"],
            }
            if lists:
                vals["shared_cpu_list"] = cpulist(shared)
            if c["id"] is not None:
                vals["id"] = c["id"]
            if not arm:
                vals["physical_line_partition"] = 1
            for name, val in vals.items():
                w.put(f"{base}/{name}", f"{val}\n")

    if has_nodes:
        _write_nodes(w, shape, recs, groups, nbits)
    _write_misc(w, shape, recs, online)
    for pattern in shape.get("nul_paths", []):  # "mask\x00\n": what some readers hit
        for path in sorted(root.glob(pattern)):
            data = path.read_bytes()
            path.write_bytes(data.rstrip(b"\n") + b"\x00\n")
    return root


def _offline_nodes(shape: dict) -> set[int]:
    """Memoryless nodes the kernel leaves offline (no nodeN/, not in node/online)."""
    if shape.get("memoryless_style", "offline") != "offline":
        return set()
    return set(shape.get("memoryless_nodes", []))


def _write_nodes(w: _Writer, shape: dict, recs, groups, nbits: int) -> None:
    """node/ as drivers/base/node.c writes it.

    ``memoryless_nodes`` have CPUs but no memory: with ``memoryless_style`` "offline" (what
    a two-socket Xeon with an empty socket 0 showed) the node is absent from node/online
    and has no nodeN/ directory while cpuN/nodeN links still name it (unless
    ``memoryless_cpu_links`` is false); with "online" nodeN/ exists with MemTotal 0 and
    has_memory leaves it out. ``cpuless_nodes`` (a list of ``{mem_kb, distance}``) are
    memory-only nodes (CXL Type 3 expanders) numbered after the CPU nodes.
    """
    numa = shape.get("numa", {})
    cpu_nodes = sorted({r["node"] for r in recs})
    node_pkg = {r["node"]: r["pkg"] for r in recs}
    memoryless = set(shape.get("memoryless_nodes", []))
    offline = _offline_nodes(shape)
    cxl = {cpu_nodes[-1] + 1 + i: spec for i, spec in enumerate(shape.get("cpuless_nodes", []))}
    possible = cpu_nodes + sorted(cxl)
    online = [n for n in possible if n not in offline]
    base = "sys/devices/system/node"
    w.put(f"{base}/possible", cpulist(possible) + "\n")
    w.put(f"{base}/online", cpulist(online) + "\n")
    with_memory = cpulist(n for n in online if n not in memoryless) + "\n"
    w.put(f"{base}/has_memory", with_memory)
    w.put(f"{base}/has_normal_memory", with_memory)
    w.put(f"{base}/has_cpu", cpulist(n for n in online if groups.get(("node", n))) + "\n")

    def distance(n: int, m: int) -> int:
        if m == n:
            return 10
        if n in cxl or m in cxl:
            return (cxl.get(n) or cxl.get(m)).get("distance", 60)
        return numa.get("near", 12) if node_pkg[m] == node_pkg[n] else numa.get("far", 32)

    for n in online:
        cpus = groups.get(("node", n), set())
        d = f"{base}/node{n}"
        w.put(f"{d}/cpumap", cpumask(cpus, nbits) + "\n")
        if shape.get("node_cpulist", True):
            w.put(f"{d}/cpulist", cpulist(cpus) + "\n")
        w.put(f"{d}/distance", " ".join(str(distance(n, m)) for m in online) + "\n")
        hp = 0 if n in memoryless else numa.get("hugepages_2m_per_node", 0)
        mem_kb = (
            0
            if n in memoryless
            else cxl[n]["mem_kb"]
            if n in cxl
            else numa.get("mem_kb_per_node", 65843892)
        )
        w.put(f"{d}/meminfo", _meminfo(n, mem_kb, hp))
        for size, nr in (("2048kB", hp), ("1048576kB", 0)):
            for f in ("nr_hugepages", "free_hugepages", "surplus_hugepages"):
                w.put(
                    f"{d}/hugepages/hugepages-{size}/{f}",
                    f"{0 if f == 'surplus_hugepages' else nr}\n",
                )


def _write_misc(w: _Writer, shape: dict, recs, online) -> None:
    arm = shape.get("arch", "x86_64") == "aarch64"
    (w.root / "sys/hypervisor").mkdir(parents=True, exist_ok=True)
    if shape.get("hypervisor_type"):
        w.put("sys/hypervisor/type", shape["hypervisor_type"] + "\n")
    if shape.get("realtime"):
        w.put("sys/kernel/realtime", "1\n")
    if shape.get("dmi"):
        for k, v in shape["dmi"].items():
            w.put(f"sys/devices/virtual/dmi/id/{k}", v + "\n")
        w.link("sys/class/dmi/id", "../../devices/virtual/dmi/id")
    for pmu, cpus in (shape.get("hybrid_pmus") or {}).items():
        w.put(f"sys/devices/{pmu}/cpus", cpus + "\n")
    # The unified cgroup hierarchy (systemd's default since v247); a shape may say "v1".
    if shape.get("cgroup", "v2") == "v2":
        w.put("sys/fs/cgroup/cgroup.controllers", "cpuset cpu io memory hugetlb pids rdma misc\n")
    k = shape["kernel"]
    w.put("proc/version", k["version"] + "\n")
    w.put("proc/sys/kernel/osrelease", k["release"] + "\n")
    w.put("proc/cmdline", k["cmdline"] + "\n")
    w.put("proc/cpuinfo", _arm_cpuinfo(shape, online) if arm else _x86_cpuinfo(shape, recs, online))


# -------------------------------------------------------------------- host capture
def _host_files() -> list[str]:
    cpu, node = "/sys/devices/system/cpu", "/sys/devices/system/node"
    pats = [
        f"{cpu}/{n}"
        for n in (
            "online",
            "possible",
            "present",
            "offline",
            "isolated",
            "nohz_full",
            "kernel_max",
            "smt/control",
            "smt/active",
        )
    ]
    pats += [f"{cpu}/cpu*/online", f"{cpu}/cpu*/topology/*"]
    pats += [
        f"{cpu}/cpu*/cache/index*/{n}"
        for n in (
            "level",
            "type",
            "shared_cpu_list",
            "shared_cpu_map",
            "id",
            "size",
            "coherency_line_size",
            "ways_of_associativity",
            "number_of_sets",
        )
    ]
    pats += [
        f"{node}/{n}" for n in ("online", "possible", "has_cpu", "has_memory", "has_normal_memory")
    ]
    pats += [f"{node}/node*/{n}" for n in ("cpulist", "cpumap", "meminfo", "distance")]
    pats += [
        f"{node}/node*/hugepages/hugepages-*/nr_hugepages",
        "/sys/kernel/realtime",
        "/sys/hypervisor/type",
        "/sys/devices/cpu_core/cpus",
        "/sys/devices/cpu_atom/cpus",
    ]
    pats += [
        f"/sys/class/dmi/id/{n}"
        for n in ("sys_vendor", "product_name", "board_vendor", "bios_vendor")
    ]
    pats += ["/proc/cpuinfo", "/proc/cmdline", "/proc/version", "/proc/sys/kernel/osrelease"]
    return sorted({str(p) for pat in pats for p in Path("/").glob(pat.lstrip("/"))})


def capture_host(out: Path) -> list[str]:
    """Tar (gzip, deterministic) the real files of this host, read by content."""
    names = []
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in _host_files():
            try:
                data = Path(path).read_bytes()
            except OSError:
                continue  # unreadable (permissions, EIO on some sysfs attrs)
            info = tarfile.TarInfo(path.lstrip("/"))
            info.size, info.mode, info.mtime = len(data), 0o444, 0
            tar.addfile(info, io.BytesIO(data))
            names.append(info.name)
    with open(out, "wb") as fh, gzip.GzipFile(fileobj=fh, mode="wb", mtime=0) as gz:
        gz.write(buf.getvalue())
    return names


def main(argv: list[str]) -> int:
    if argv[:1] == ["--list"]:
        print("\n".join(shape_names()))
        return 0
    if len(argv) == 2 and argv[0] == "--capture-host":
        print(f"{len(capture_host(Path(argv[1])))} files -> {argv[1]}")
        return 0
    if len(argv) != 2:
        print(__doc__.split("Usage::")[1].split("Shapes are")[0], file=sys.stderr)
        return 2
    root = build_tree(argv[0], Path(argv[1]))
    print(os.fspath(root))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
