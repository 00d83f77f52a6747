"""Linux CPU topology discovery from sysfs and procfs: the reader, ``read_topology``.

This file is the one implementation of topology parsing in rtfleet, with the two modules
under it: cpulist.py (CPU sets in the kernel's text forms, :class:`TopologyError`) and
hostfacts.py (the safe file reader, and the kernel, isolation, power and virtualization
facts). Here: the CPU layout (CPUs, cores, packages, dies, clusters, L3 groups, NUMA nodes
and their distances), read in named steps and joined with the host facts. All three are
stdlib-only and run on Python >= 3.9 because they ship to managed hosts: this is the
rtfleet.fleet collection's ``module_utils/topology.py`` (the modules and filters import it
from there), the ``rtfleet`` CLI's ``rtfleet.topology``, the shminfer wheel's
``shminfer.topology`` and the host role's ``rtfleet_node.topology`` (symlinks to these
files in the repository).

Everything is read under a root directory that holds ``sys/`` and ``proc/`` like a real
root, so captured trees from other machines can be read exactly like the live host.

CPU sets are sorted lists of ints inside; kernel cpulist strings ("0-3,8") only at the
edges (cpulist.py).
"""

from __future__ import annotations

import os
import re

from .cpulist import NUMBER, TopologyError, format_cpulist, parse_cpulist, shown
from .hostfacts import (
    CPU_DIR,
    Reader,
    deception_verdict,
    read_cpu_model,
    read_isolation,
    read_kernel,
    read_power,
    read_smt,
    read_virtualization,
)

SCHEMA_VERSION = 1

_NODE = "sys/devices/system/node"


def _online_cpus(reader):
    text = reader.read_opt(CPU_DIR + "/online")
    if text is not None:
        return parse_cpulist(text, reader.path(CPU_DIR + "/online"))
    # Very old or stripped trees: a CPU is online when its topology directory exists.
    cpu_dirs = reader.numbered(CPU_DIR, "cpu")
    if not cpu_dirs:
        raise TopologyError(reader.path(CPU_DIR), "no CPUs found (is this a Linux root?)")
    online = []
    for cpu in sorted(cpu_dirs):
        state = reader.read("%s/cpu%d/online" % (CPU_DIR, cpu), default="1")
        if state == "1" and reader.exists("%s/cpu%d/topology" % (CPU_DIR, cpu)):
            online.append(cpu)
    return online


def _read_cpus(reader, online):
    """Per online CPU: package, die, cluster, core id and SMT siblings."""
    cpus = {}
    online_set = set(online)
    for cpu in online:
        base = "%s/cpu%d/topology/" % (CPU_DIR, cpu)
        package = reader.read_int_opt(base + "physical_package_id")
        if package is None:
            if not reader.exists(base):
                raise TopologyError(
                    reader.path(base),
                    "CPU %d is listed online but has no topology directory" % cpu,
                )
            package = 0
        siblings = (
            reader.read_cpus(base + "core_cpus_list", base + "core_cpus", default=[])
            or reader.read_cpus(base + "thread_siblings_list", base + "thread_siblings", default=[])
            or [cpu]
        )
        cpus[cpu] = {
            "package": package,
            "die": reader.read_int_opt(base + "die_id"),
            "cluster": reader.read_int_opt(base + "cluster_id"),
            "core_id": reader.read_int(base + "core_id", default=cpu),
            "siblings": sorted(set(siblings) & online_set) or [cpu],
        }
    return cpus


def _read_l3(reader, cpu, online_set):
    """The L3 (last level, unified) cache this CPU sees: {cpus, id, size}, or None."""
    base = "%s/cpu%d/cache/" % (CPU_DIR, cpu)
    # index3 is the L3 on every x86 and most arm64 kernels; scan the rest only if not.
    names = ["index3"] + [n for n in reader.numbered(base, "index").values() if n != "index3"]
    for name in names:
        rel = base + name + "/"
        level = reader.read_int_opt(rel + "level")
        if level != 3:
            if name == "index3" and level is None and not reader.exists(base):
                return None
            continue
        if reader.read(rel + "type", default="Unified") == "Instruction":
            continue
        shared = reader.read_cpus(rel + "shared_cpu_list", rel + "shared_cpu_map", default=[cpu])
        return {
            "cpus": sorted(set(shared) & online_set) or [cpu],
            "id": reader.read_int_opt(rel + "id"),
            "size": reader.read(rel + "size", default="") or None,
        }
    return None


def _node_list(reader, name):
    """node/<name> (online, possible, has_cpu, has_memory) as a list, None when absent."""
    rel = "%s/%s" % (_NODE, name)
    text = reader.read_opt(rel)
    return None if text is None else parse_cpulist(text, reader.path(rel))


def _distances(reader, node_id, online_ids):
    """nodeN/distance as [[node, distance], ...]; the row follows node/online's order."""
    rel = "%s/node%d/distance" % (_NODE, node_id)
    text = reader.read_opt(rel)
    if not text:
        return []
    values = text.split()
    if len(values) != len(online_ids) or not all(NUMBER.match(v) and len(v) < 6 for v in values):
        raise TopologyError(
            reader.path(rel),
            "expected %d distances (one per online node %s), got %s"
            % (len(online_ids), format_cpulist(online_ids), shown(text)),
        )
    return [[node, int(value)] for node, value in zip(online_ids, values)]


def _by_distance(node, others, packages_of):
    """``others`` (node dicts), nearest to ``node`` first, each with its distance or None.

    By ``node``'s SLIT row; a node without one (offline, or a tree that omits it) takes the
    others' rows toward it (SLIT is symmetric). Then nodes on the same package first, then
    the lowest id. ``packages_of(node)`` gives a node's packages.
    """
    row = dict(node["distances"])
    mine = packages_of(node)

    def distance(other):
        if other["id"] in row:
            return row[other["id"]]
        return dict(other["distances"]).get(node["id"])

    def rank(other):
        found = distance(other)
        return (1 << 20 if found is None else found, not (mine & packages_of(other)), other["id"])

    return [(other, distance(other)) for other in sorted(others, key=rank)]


def nearest_nodes(topology, node_id, candidates):
    """Node ids ``candidates`` as ``[(id, distance or None)]``, nearest to ``node_id``
    first (its SLIT distance, else the same package, then the lowest id): where to go when
    ``node_id`` itself has no memory, no unit, no room."""
    nodes = {n["id"]: n for n in topology["numa_nodes"]}
    if node_id not in nodes:
        raise ValueError("NUMA node %s is not in this topology" % node_id)
    others = [nodes[c] for c in candidates if c in nodes]
    ranked = _by_distance(nodes[node_id], others, lambda n: set(n.get("packages", ())))
    return [(n["id"], d) for n, d in ranked]


def _nearest_memory_node(node, nodes, package_of):
    """The node whose memory serves ``node``'s CPUs: itself, else the nearest with memory."""
    if node["has_memory"]:
        return node["id"]
    with_memory = [n for n in nodes if n["has_memory"]]
    if not with_memory:
        return None
    ranked = _by_distance(
        node, with_memory, lambda n: {package_of[c] for c in n["cpus"] if c in package_of}
    )
    return ranked[0][0]["id"]


def _read_nodes(reader, online, package_of):
    """NUMA nodes as [{id, cpus, memory_kb, has_memory, online, distances, memory_node}].

    No node/ directory at all means node 0 has everything. A node with CPUs but no memory
    is kept: the kernel may list it online with MemTotal 0 (has_memory leaves it out), or
    leave it offline with no nodeN/ directory while cpuN/nodeN links still name it. Nodes
    with memory and no CPUs (CXL expanders, HBM) are kept too, with an empty CPU list.
    """
    node_dirs = reader.numbered(_NODE, "node")
    if not node_dirs:
        return [
            {
                "id": 0,
                "cpus": list(online),
                "memory_kb": None,
                "has_memory": True,
                "online": True,
                "distances": [],
                "memory_node": 0,
            }
        ], False
    nodes = _listed_nodes(reader, node_dirs, set(online))
    placed = _placed_cpus(reader, nodes)
    missing = sorted(set(online) - placed)
    if missing:
        nodes.extend(_unlisted_nodes(reader, missing, node_dirs))
        nodes.sort(key=lambda n: n["id"])
    for node in nodes:
        node["memory_node"] = _nearest_memory_node(node, nodes, package_of)
    return nodes, True


def _listed_nodes(reader, node_dirs, online_set):
    """The nodes with a nodeN/ directory: their online CPUs, memory and distances."""
    has_memory = _node_list(reader, "has_memory")
    online_list = _node_list(reader, "online")
    online_ids = sorted(node_dirs) if online_list is None else online_list
    nodes = []
    for node_id in sorted(node_dirs):
        rel = "%s/node%d/" % (_NODE, node_id)
        cpus = reader.read_cpus(rel + "cpulist", rel + "cpumap", default=[])
        memory_kb = None
        meminfo = reader.read(rel + "meminfo", default="")
        match = re.search(r"MemTotal:\s*([0-9]{1,15})\s*kB", meminfo)
        if match:
            memory_kb = int(match.group(1))
        if has_memory is not None:
            memory = node_id in has_memory
        else:
            memory = memory_kb is None or memory_kb > 0
        nodes.append(
            {
                "id": node_id,
                "cpus": sorted(set(cpus) & online_set),
                "memory_kb": memory_kb if memory or memory_kb is not None else 0,
                "has_memory": memory,
                "online": node_id in online_ids,
                "distances": _distances(reader, node_id, online_ids)
                if node_id in online_ids
                else [],
            }
        )
    return nodes


def _placed_cpus(reader, nodes):
    """The CPUs the nodes list; a CPU in two nodes is an error."""
    placed = {}
    for node in nodes:
        overlap = set(placed) & set(node["cpus"])
        if overlap:
            raise TopologyError(
                reader.path("%s/node%d/cpulist" % (_NODE, node["id"])),
                f"CPUs {format_cpulist(overlap)} appear in more than one NUMA node",
            )
        placed.update(dict.fromkeys(node["cpus"], node["id"]))
    return set(placed)


def _unlisted_nodes(reader, missing, node_dirs):
    """Nodes for the ``missing`` online CPUs, which no nodeN/ directory lists (an offline
    or memoryless node): their cpuN/nodeM link names it, or node/possible + has_cpu leave
    exactly one candidate."""
    extra = {}
    unlinked = []
    for cpu in missing:
        links = reader.numbered("%s/cpu%d" % (CPU_DIR, cpu), "node")
        if len(links) > 1:
            raise TopologyError(
                reader.path("%s/cpu%d" % (CPU_DIR, cpu)),
                "CPU %d links to NUMA nodes %s" % (cpu, format_cpulist(links)),
            )
        if links:
            extra.setdefault(next(iter(links)), []).append(cpu)
        else:
            unlinked.append(cpu)
    if unlinked:
        extra.setdefault(_only_candidate(reader, node_dirs, unlinked), []).extend(unlinked)
    nodes = []
    for node_id, cpus in sorted(extra.items()):
        if node_id in node_dirs:
            raise TopologyError(
                reader.path("%s/node%d/cpulist" % (_NODE, node_id)),
                "CPUs %s link to node %d, but its cpulist leaves them out"
                % (format_cpulist(cpus), node_id),
            )
        nodes.append(
            {
                "id": node_id,
                "cpus": sorted(cpus),
                "memory_kb": 0,
                "has_memory": False,
                "online": False,
                "distances": [],
            }
        )
    return nodes


def _only_candidate(reader, node_dirs, unlinked):
    """The one node without a directory that node/possible or has_cpu name, for CPUs no
    link places."""
    candidates = set(_node_list(reader, "possible") or []) | set(
        _node_list(reader, "has_cpu") or []
    )
    candidates -= set(node_dirs)
    if len(candidates) != 1:
        raise TopologyError(
            reader.path(_NODE),
            "online CPUs %s belong to no NUMA node (no nodeN/ lists them, no "
            "cpuN/nodeM link names one, and node/possible leaves %s)"
            % (
                format_cpulist(unlinked),
                "no candidate" if not candidates else "candidates %s" % format_cpulist(candidates),
            ),
        )
    return next(iter(candidates))


def _core_types(reader):
    """Intel hybrid: {cpu: 'performance'|'efficiency'} from the PMU device lists."""
    types = {}
    for pmu, kind in (("cpu_core", "performance"), ("cpu_atom", "efficiency")):
        rel = f"sys/devices/{pmu}/cpus"
        if reader.exists(rel):
            for cpu in parse_cpulist(reader.read(rel), reader.path(rel)):
                types[cpu] = kind
    return types


def _group(cpus, key_of):
    groups = {}
    for cpu in sorted(cpus):
        groups.setdefault(key_of(cpu), []).append(cpu)
    return groups


def read_topology(root="/"):
    """Read the CPU topology of the Linux root at ``root`` and return a plain dict.

    Raises TopologyError (naming the file) for unreadable or malformed input.
    """
    if not os.path.isdir(root):
        raise TopologyError(root, "not a directory")
    reader = Reader(root)
    if not reader.exists(CPU_DIR):
        raise TopologyError(reader.path(CPU_DIR), "missing: ROOT must hold sys/ and proc/ like /")
    online = _online_cpus(reader)
    if not online:
        raise TopologyError(reader.path(CPU_DIR + "/online"), "no online CPUs")
    per_cpu = _read_cpus(reader, online)
    sibling_sets = _sibling_sets(reader, online, per_cpu)
    core_types = _core_types(reader)

    packages = [  # in the kernel's own ids
        {"id": pkg, "cpus": cpus}
        for pkg, cpus in sorted(_group(online, lambda c: per_cpu[c]["package"]).items())
    ]
    package_of = {cpu: per_cpu[cpu]["package"] for cpu in online}
    nodes, has_numa_dir = _read_nodes(reader, online, package_of)
    node_of = {cpu: node["id"] for node in nodes for cpu in node["cpus"]}

    cache_of, uncovered = _l3_sharing(reader, online)
    l3_source = "package+numa" if not cache_of else ("cache+package+numa" if uncovered else "cache")
    l3_groups = _l3_groups(cache_of, uncovered, package_of, node_of)
    cores = _cores(
        sibling_sets,
        per_cpu,
        package_of=package_of,
        node_of=node_of,
        core_types=core_types,
        l3_groups=l3_groups,
    )
    l3_of = {cpu: g["id"] for g in l3_groups for cpu in g["cpus"]}
    for node in nodes:
        node["l3_groups"] = sorted({l3_of[c] for c in node["cpus"]})
        node["packages"] = sorted({package_of[c] for c in node["cpus"]})

    cpuinfo_blocks, arch, vendor, model_name = read_cpu_model(reader)
    kernel = read_kernel(reader)
    virt = read_virtualization(reader, cpuinfo_blocks, arch)
    virt["deception"] = deception_verdict(
        virt, online, packages, nodes, l3_groups, l3_source=l3_source
    )
    smt = read_smt(reader, cores)
    present = _present_cpus(reader, online)

    return {
        "schema": SCHEMA_VERSION,
        "root": root,
        "arch": arch,
        "vendor": vendor,
        "model_name": model_name,
        "cpus": online,
        "present_cpus": present,
        "offline_cpus": sorted(set(present) - set(online)),
        "packages": packages,
        "dies": _grouped_by(online, per_cpu, "die"),
        "clusters": _grouped_by(online, per_cpu, "cluster"),
        "numa_nodes": nodes,
        "numa_source": "sysfs" if has_numa_dir else "assumed (no node/ directory)",
        # Nodes with CPUs but no memory (a socket without DIMMs), and nodes with memory but
        # no CPUs (CXL, HBM); both are in numa_nodes too.
        "memoryless_nodes": [n["id"] for n in nodes if n["cpus"] and not n["has_memory"]],
        "cpuless_nodes": [n["id"] for n in nodes if not n["cpus"]],
        "l3_groups": l3_groups,
        "l3_source": l3_source,
        "cores": cores,
        "smt": smt,
        "hybrid": bool(core_types),
        "kernel": kernel,
        "isolation": read_isolation(reader, kernel, online),
        "power": read_power(reader, online),
        "virtualization": virt,
    }


def _present_cpus(reader, online):
    """cpu/present, or the online CPUs when the tree has no such file."""
    rel = CPU_DIR + "/present"
    return parse_cpulist(reader.read(rel), reader.path(rel)) if reader.exists(rel) else list(online)


def _sibling_sets(reader, online, per_cpu):
    """Cores as {first CPU: SMT siblings} (the kernel's core_cpus), never split."""
    cores_by_first = {}
    for cpu in online:
        siblings = per_cpu[cpu]["siblings"]
        if cpu not in siblings:
            siblings = sorted(set(siblings) | {cpu})
        cores_by_first.setdefault(siblings[0], siblings)
    seen = {}
    for siblings in cores_by_first.values():
        for cpu in siblings:
            if cpu in seen and seen[cpu] != siblings:
                raise TopologyError(
                    reader.path("%s/cpu%d/topology/core_cpus_list" % (CPU_DIR, cpu)),
                    "CPU %d is in two different sibling sets" % cpu,
                )
            seen[cpu] = siblings
    return cores_by_first


def _grouped_by(online, per_cpu, level):
    """Dies or clusters (``level``) per package, when the kernel reports them for all CPUs."""
    if not all(per_cpu[c][level] is not None for c in online):
        return []
    return [
        {"id": key, "package": pkg, "cpus": cpus}
        for (pkg, key), cpus in sorted(
            _group(online, lambda c: (per_cpu[c]["package"], per_cpu[c][level])).items()
        )
    ]


def _l3_sharing(reader, online):
    """({CPUs sharing one L3: its cache info}, online CPUs no cache data covers).

    A CPU already seen in another CPU's sharing set is not read again (the kernel reports
    the same set for each member); a CPU without cache data joins the set another CPU
    reports it in.
    """
    online_set = set(online)
    members = {}
    cache_of = {}
    for cpu in online:
        if cpu in members:
            continue
        l3 = _read_l3(reader, cpu, online_set)
        if l3 is None:
            continue
        shared = tuple(sorted(set(l3["cpus"]) | {cpu}))
        for member in shared:
            if members.setdefault(member, shared) != shared:
                raise TopologyError(
                    reader.path("%s/cpu%d/cache" % (CPU_DIR, cpu)),
                    "CPU %d is in two different L3 sharing sets (%s and %s)"
                    % (member, format_cpulist(members[member]), format_cpulist(shared)),
                )
        cache_of[shared] = l3
    return cache_of, [cpu for cpu in online if cpu not in members]


def _l3_groups(cache_of, uncovered, package_of, node_of):
    """L3 groups numbered by their first CPU. CPUs no cache covers fall back to the smallest
    thing known to share memory locality (package x NUMA node)."""
    groups = [
        {"cpus": list(shared), "cache_id": info["id"], "size": info["size"]}
        for shared, info in cache_of.items()
    ]
    for cpus in _group(uncovered, lambda c: (package_of[c], node_of[c])).values():
        groups.append({"cpus": cpus, "cache_id": None, "size": None})
    groups.sort(key=lambda g: g["cpus"][0])
    result = []
    for index, group in enumerate(groups):
        group_nodes = sorted({node_of[c] for c in group["cpus"]})
        group_pkgs = sorted({package_of[c] for c in group["cpus"]})
        result.append(
            {
                "id": index,
                "cpus": group["cpus"],
                "numa_node": group_nodes[0] if len(group_nodes) == 1 else None,
                "numa_nodes": group_nodes,
                "package": group_pkgs[0] if len(group_pkgs) == 1 else None,
                "cache_id": group["cache_id"],
                "size": group["size"],
            }
        )
    return result


def _cores(sibling_sets, per_cpu, *, package_of, node_of, core_types, l3_groups):
    """Cores by their first CPU: siblings, core id, package, node, type, L3 group."""
    l3_of = {cpu: g["id"] for g in l3_groups for cpu in g["cpus"]}
    cores = []
    for siblings in sorted(sibling_sets.values(), key=lambda s: s[0]):
        first = siblings[0]
        core = {
            "cpus": siblings,
            "core_id": per_cpu[first]["core_id"],
            "package": package_of[first],
            "numa_node": node_of[first],
        }
        if core_types:
            core["type"] = core_types.get(first, "unknown")
        core["l3_group"] = l3_of[first]
        cores.append(core)
    return cores
