"""Linux CPU topology discovery from sysfs and procfs.

This file is the one implementation of topology parsing in rtfleet. It is stdlib-only and
runs on Python >= 3.9 because it ships to managed hosts: it is the rtfleet.fleet
collection's ``module_utils/topology.py`` (the modules and filters import it from there), the
``rtfleet`` CLI's ``rtfleet.topology``, the shminfer wheel's ``shminfer.topology`` and the
host role's ``rtfleet_node.topology`` (symlinks to this file in the repository).

Everything is read under a root directory that holds ``sys/`` and ``proc/`` like a real
root, so captured trees from other machines can be read exactly like the live host.

CPU sets are sorted lists of ints inside; kernel cpulist strings ("0-3,8") only at the
edges (:func:`parse_cpulist`, :func:`format_cpulist`).
"""

from __future__ import annotations

import os
import re
import stat

SCHEMA_VERSION = 1

# DMI vendors / products that identify a hypervisor even when cpuinfo hides the flag.
_DMI_HYPERVISORS = (
    ("vmware", "vmware"),
    ("qemu", "kvm"),
    ("kvm", "kvm"),
    ("microsoft corporation", "hyperv"),  # only with product "Virtual Machine", see below
    ("xen", "xen"),
    ("innotek", "virtualbox"),
    ("oracle corporation", "virtualbox"),
    ("amazon ec2", "kvm"),
    ("google", "kvm"),
    ("openstack", "kvm"),
    ("nutanix", "kvm"),
    ("parallels", "parallels"),
    ("bhyve", "bhyve"),
)


class TopologyError(Exception):
    """Unreadable or malformed topology input; the message names the file."""

    def __init__(self, path, message):
        self.path = path
        Exception.__init__(self, f"{path}: {message}")


# --------------------------------------------------------------------------- cpulists


# The largest CPU id accepted anywhere: Linux's NR_CPUS tops out at 8192 (x86 MAXSMP, ppc64,
# arm64 4096), so 65536 leaves room and still bounds what a hostile "0-99999999" can cost.
MAX_CPUS = 65536
# What is read from any one sysfs/procfs file; a real file of interest is far smaller.
MAX_READ_BYTES = 1 << 20
_NUMBER = re.compile(r"^[0-9]+$")  # ASCII digits only (str.isdigit() also takes "\u00b2")
_INTEGER = re.compile(r"^-?[0-9]{1,19}$")


def _shown(text, limit=40):
    """repr() of text, cut to ``limit`` characters so an error stays one short line."""
    if len(text) <= limit:
        return repr(text)
    return "%r... (%d characters)" % (text[:limit], len(text))


def _cpu_id(token, path, text):
    if not _NUMBER.match(token):
        return None
    if len(token) > len(str(MAX_CPUS)) or int(token) >= MAX_CPUS:
        raise TopologyError(
            path,
            "CPU id %s in cpulist %s is above the %d-CPU limit"
            % (_shown(token, 12), _shown(text), MAX_CPUS),
        )
    return int(token)


def parse_cpulist(text, path="<cpulist>", strict=False):
    """Parse a kernel cpulist ("0-3,8,10-15:2", "0-63:2/8") into a sorted list of ints.

    CPU ids are capped at :data:`MAX_CPUS`. ``strict=True`` is kubelet's cpuset syntax
    (k8s.io/utils/cpuset Parse): "" is the empty set, otherwise comma-separated ``N`` or
    ``N-M`` items with no spaces, no empty items, no strides, no NUL or newline.
    """
    text = str(text)
    if strict:
        if text == "":
            return []
        bad = [c for c in (" ", "\t", "\n", "\x00", ":", "/") if c in text]
        if bad:
            raise TopologyError(
                path,
                "%s holds %s, which kubelet's cpuset syntax does not allow" % (_shown(text), bad),
            )
    else:
        text = _clean(text)
        if not text or text == "(null)":
            return []
    cpus = set()
    for item in text.split(","):
        part, _sep, step = (item if strict else item.strip()).partition(":")
        if not part:
            if strict:
                raise TopologyError(
                    path, '%s has an empty item (kubelet refuses "0-3,")' % _shown(text)
                )
            continue
        stride, used = 1, None
        if step:
            # "a-b:used/group" (kernel command line: used CPUs of every group) or "a-b:stride"
            used_text, slash, group_text = step.partition("/")
            if not _NUMBER.match(used_text) or len(used_text) > 6 or int(used_text) == 0:
                raise TopologyError(
                    path, f"bad cpulist stride {_shown(step, 12)} in {_shown(text)}"
                )
            if slash:
                if not _NUMBER.match(group_text) or len(group_text) > 6 or int(group_text) == 0:
                    raise TopologyError(
                        path, f"bad cpulist group {_shown(step, 12)} in {_shown(text)}"
                    )
                used, stride = int(used_text), int(group_text)
            else:
                stride = int(used_text)
        if "-" in part:
            lo_text, _sep, hi_text = part.partition("-")
            lo = _cpu_id(lo_text, path, text)
            hi = _cpu_id(hi_text, path, text)
            if lo is None or hi is None or lo > hi:
                raise TopologyError(path, f"bad cpulist range {_shown(part, 24)} in {_shown(text)}")
            if used is None:
                cpus.update(range(lo, hi + 1, stride))
            else:
                for start in range(lo, hi + 1, stride):
                    cpus.update(range(start, min(start + used, hi + 1)))
        else:
            cpu = _cpu_id(part, path, text)
            if cpu is None or step:
                raise TopologyError(path, f"bad cpulist entry {_shown(part, 24)} in {_shown(text)}")
            cpus.add(cpu)
    return sorted(cpus)


def format_cpulist(cpus):
    """Format CPU ids as a kernel cpulist string ("0-3,8"); empty set gives ""."""
    ids = sorted({int(c) for c in cpus})
    ranges = []
    start = prev = None
    for cpu in ids:
        if start is None:
            start = prev = cpu
        elif cpu == prev + 1:
            prev = cpu
        else:
            ranges.append((start, prev))
            start = prev = cpu
    if start is not None:
        ranges.append((start, prev))
    return ",".join(str(a) if a == b else "%d-%d" % (a, b) for a, b in ranges)


def parse_cpumask(text, path="<cpumask>"):
    """Parse a kernel hex cpumask ("00000000,000000ff") into a sorted list of ints."""
    text = _clean(text).replace(",", "")
    if text.startswith(("0x", "0X")):
        text = text[2:]
    if not text:
        return []
    if len(text) * 4 > MAX_CPUS:
        raise TopologyError(
            path, "cpumask of %d hex digits is above the %d-CPU limit" % (len(text), MAX_CPUS)
        )
    if not re.match(r"^[0-9a-fA-F]+$", text):
        raise TopologyError(path, f"not a hex cpumask: {_shown(text)}")
    value = int(text, 16)
    cpus = []
    bit = 0
    while value:
        if value & 1:
            cpus.append(bit)
        value >>= 1
        bit += 1
    return cpus


def format_cpumask(cpus):
    """Format CPU ids as a kernel hex mask with 32-bit comma groups ("ff,00000000")."""
    value = 0
    for cpu in cpus:
        value |= 1 << int(cpu)
    text = f"{value:x}"
    groups = []
    while text:
        groups.insert(0, text[-8:])
        text = text[:-8]
    if not groups:
        return "0"
    return ",".join([groups[0]] + [g.zfill(8) for g in groups[1:]])


# --------------------------------------------------------------------------- reading


def _clean(text):
    return text.replace("\x00", "").strip()


class _Reader:
    """Reads files under a root; every error names the file.

    Reads try the file and treat "missing" as an answer rather than asking exists() first:
    a 256-CPU host has thousands of these files and the round trips add up.
    """

    def __init__(self, root):
        self.root = root.rstrip("/") or ""

    def path(self, rel):
        return self.root + "/" + rel.lstrip("/")

    def exists(self, rel):
        return os.path.exists(self.path(rel))

    def read_opt(self, rel, limit=MAX_READ_BYTES, truncate=False):
        """The cleaned content, or None when the file does not exist.

        Opened without blocking and checked to be a regular file before anything is read, so
        a FIFO or a device in place of a sysfs file is an error instead of a hang; at most
        ``limit`` bytes are read (more is an error unless ``truncate``).
        """
        path = self.path(rel)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        except (FileNotFoundError, NotADirectoryError):
            return None
        except IsADirectoryError:
            raise TopologyError(path, "expected a file, found a directory") from None
        except OSError as exc:
            raise TopologyError(path, f"unreadable ({exc.strerror})") from None
        try:
            mode = os.fstat(fd).st_mode
            if stat.S_ISDIR(mode):
                raise TopologyError(path, "expected a file, found a directory")
            if not stat.S_ISREG(mode):
                kind = "a FIFO" if stat.S_ISFIFO(mode) else "a socket or device"
                raise TopologyError(path, f"expected a regular file, found {kind}")
            chunks = []
            size = 0
            while size <= limit:
                chunk = os.read(fd, min(65536, limit + 1 - size))
                if not chunk:
                    break
                chunks.append(chunk)
                size += len(chunk)
        except OSError as exc:
            raise TopologyError(path, f"unreadable ({exc.strerror})") from None
        finally:
            os.close(fd)
        data = b"".join(chunks)
        if size > limit:
            if not truncate:
                raise TopologyError(path, "larger than %d bytes: not a kernel attribute" % limit)
            data = data[:limit]
        return _clean(data.decode("utf-8", "replace"))

    def read(self, rel, default=None):
        text = self.read_opt(rel)
        if text is None:
            if default is not None:
                return default
            raise TopologyError(self.path(rel), "missing")
        return text

    def read_int(self, rel, default=None):
        text = self.read_opt(rel)
        if text is None or (text == "" and default is not None):
            if default is not None:
                return default
            raise TopologyError(self.path(rel), "missing")
        return self._int(rel, text)

    def _int(self, rel, text):
        if not _INTEGER.match(text):
            raise TopologyError(self.path(rel), f"expected an integer, got {_shown(text)}")
        return int(text)

    def read_int_opt(self, rel):
        text = self.read_opt(rel)
        if text is None:
            return None
        return self._int(rel, text)

    def read_cpus(self, list_rel, mask_rel=None, default=None):
        """Read a cpulist file, falling back to its hex-mask twin."""
        text = self.read_opt(list_rel)
        if text is not None:
            return parse_cpulist(text, self.path(list_rel))
        text = self.read_opt(mask_rel) if mask_rel else None
        if text is not None:
            return parse_cpumask(text, self.path(mask_rel))
        if default is not None:
            return default
        raise TopologyError(self.path(list_rel), "missing (and no mask file beside it)")

    def listdir(self, rel):
        try:
            return sorted(os.listdir(self.path(rel)))
        except (FileNotFoundError, NotADirectoryError):
            return []
        except OSError as exc:
            raise TopologyError(self.path(rel), f"unreadable ({exc.strerror})") from None


def _numbered(names, prefix):
    """{N: name} for entries named prefixN (cpu12, node3, index2)."""
    found = {}
    for name in names:
        if name.startswith(prefix) and _NUMBER.match(name[len(prefix) :]):
            found[int(name[len(prefix) :])] = name
    return found


_CPU = "sys/devices/system/cpu"
_NODE = "sys/devices/system/node"


def _online_cpus(reader):
    text = reader.read_opt(_CPU + "/online")
    if text is not None:
        return parse_cpulist(text, reader.path(_CPU + "/online"))
    # Very old or stripped trees: a CPU is online when its topology directory exists.
    cpu_dirs = _numbered(reader.listdir(_CPU), "cpu")
    if not cpu_dirs:
        raise TopologyError(reader.path(_CPU), "no CPUs found (is this a Linux root?)")
    online = []
    for cpu in sorted(cpu_dirs):
        state = reader.read("%s/cpu%d/online" % (_CPU, cpu), default="1")
        if state == "1" and reader.exists("%s/cpu%d/topology" % (_CPU, cpu)):
            online.append(cpu)
    return online


def _read_cpus(reader, online):
    """Per online CPU: package, die, cluster, core id and SMT siblings."""
    cpus = {}
    online_set = set(online)
    for cpu in online:
        base = "%s/cpu%d/topology/" % (_CPU, cpu)
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
    base = "%s/cpu%d/cache/" % (_CPU, cpu)
    # index3 is the L3 on every x86 and most arm64 kernels; scan the rest only if not.
    names = ["index3"] + [
        n for n in _numbered(reader.listdir(base), "index").values() if n != "index3"
    ]
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
    if len(values) != len(online_ids) or not all(_NUMBER.match(v) and len(v) < 6 for v in values):
        raise TopologyError(
            reader.path(rel),
            "expected %d distances (one per online node %s), got %s"
            % (len(online_ids), format_cpulist(online_ids), _shown(text)),
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
    node_dirs = _numbered(reader.listdir(_NODE), "node")
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
    online_set = set(online)
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
    placed = {}
    for node in nodes:
        overlap = set(placed) & set(node["cpus"])
        if overlap:
            raise TopologyError(
                reader.path("%s/node%d/cpulist" % (_NODE, node["id"])),
                f"CPUs {format_cpulist(overlap)} appear in more than one NUMA node",
            )
        placed.update(dict.fromkeys(node["cpus"], node["id"]))
    missing = sorted(online_set - set(placed))
    if missing:
        # CPUs of a node without a directory (offline, memoryless): their cpuN/nodeM link
        # names it, or node/possible + has_cpu leave exactly one candidate.
        extra = {}
        unlinked = []
        for cpu in missing:
            links = _numbered(reader.listdir("%s/cpu%d" % (_CPU, cpu)), "node")
            if len(links) > 1:
                raise TopologyError(
                    reader.path("%s/cpu%d" % (_CPU, cpu)),
                    "CPU %d links to NUMA nodes %s" % (cpu, format_cpulist(links)),
                )
            if links:
                extra.setdefault(next(iter(links)), []).append(cpu)
            else:
                unlinked.append(cpu)
        if unlinked:
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
                        "no candidate"
                        if not candidates
                        else "candidates %s" % format_cpulist(candidates),
                    ),
                )
            extra.setdefault(next(iter(candidates)), []).extend(unlinked)
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
        nodes.sort(key=lambda n: n["id"])
    for node in nodes:
        node["memory_node"] = _nearest_memory_node(node, nodes, package_of)
    return nodes, True


def _parse_cpuinfo(text):
    """The first `key: value` blocks, plus the architecture they imply.

    Only the first two blocks are parsed: every field used is the same on all CPUs, and a
    256-CPU cpuinfo is half a megabyte.
    """
    blocks = []
    current = {}
    for line in "\n\n".join(text.split("\n\n", 2)[:2]).splitlines():
        if not line.strip():
            if current:
                blocks.append(current)
                current = {}
            continue
        key, sep, value = line.partition(":")
        if sep:
            current[key.strip().lower()] = value.strip()
    if current:
        blocks.append(current)
    first = blocks[0] if blocks else {}
    if first.get("vendor_id", "").startswith("IBM/S390"):
        arch = "s390x"
    elif "vendor_id" in first:
        arch = "x86_64"
    elif "cpu implementer" in first or any("cpu implementer" in b for b in blocks):
        arch = "aarch64"
    elif "isa" in first:
        arch = "riscv64"
    elif first.get("cpu", "").upper().startswith("POWER"):
        arch = "ppc64le"
    else:
        arch = "unknown"
    return blocks, arch


def _kernel_info(reader):
    cmdline = reader.read("proc/cmdline", default="")
    version = reader.read("proc/version", default="")
    release = reader.read("proc/sys/kernel/osrelease", default="")
    if not release:
        match = re.search(r"Linux version (\S+)", version)
        release = match.group(1) if match else ""
    realtime = reader.read("sys/kernel/realtime", default="0") == "1"
    if not realtime and "PREEMPT_RT" in version:
        realtime = True
    if realtime:
        preempt = "PREEMPT_RT"
    elif "PREEMPT_DYNAMIC" in version:
        preempt = "PREEMPT_DYNAMIC"
    elif re.search(r"\bPREEMPT\b", version):
        preempt = "PREEMPT"
    else:
        preempt = "none" if version else "unknown"
    args = _split_cmdline(cmdline)
    return {
        "release": release,
        "version": version,
        "flavour": "rt" if realtime else "stock",
        "preempt": preempt,
        "realtime": realtime,
        "cmdline": cmdline,
        "cmdline_args": args,
    }


def _split_cmdline(cmdline):
    """Kernel arguments as {name: value-or-None}; later repeats win, like the kernel.

    Everything after a lone "--" belongs to init, not the kernel.
    """
    args = {}
    for token in re.findall(r'(?:[^\s"]+|"[^"]*")+', cmdline):
        if token == "--":
            break
        key, sep, value = token.partition("=")
        args[key] = value.strip('"') if sep else None
    return args


def _isolation(reader, kernel, online):
    isolated_rel = _CPU + "/isolated"
    nohz_rel = _CPU + "/nohz_full"
    isolated = (
        parse_cpulist(reader.read(isolated_rel), reader.path(isolated_rel))
        if reader.exists(isolated_rel)
        else []
    )
    nohz = (
        parse_cpulist(reader.read(nohz_rel), reader.path(nohz_rel))
        if reader.exists(nohz_rel)
        else []
    )
    args = kernel["cmdline_args"]
    rcu_nocbs = []
    if args.get("rcu_nocbs"):
        rcu_nocbs = parse_cpulist(args["rcu_nocbs"], "/proc/cmdline rcu_nocbs=")
    isolcpus_flags = []
    if args.get("isolcpus"):
        parts = args["isolcpus"].split(",")
        isolcpus_flags = [p for p in parts if p and not p[0].isdigit()]
    return {
        "isolated": isolated,
        "nohz_full": nohz,
        "rcu_nocbs": rcu_nocbs,
        "isolcpus_flags": isolcpus_flags,
        "irqaffinity": args.get("irqaffinity"),
        "housekeeping_guess": sorted(set(online) - set(isolated) - set(nohz)),
    }


def _smt(reader, cores):
    control = reader.read(_CPU + "/smt/control", default="")
    active = reader.read(_CPU + "/smt/active", default="")
    threads = max((len(core["cpus"]) for core in cores), default=1)
    return {
        "control": control or None,
        "active": (active == "1") if active else threads > 1,
        "threads_per_core": threads,
    }


def _power(reader, online):
    """Frequency driver/governor, boost and idle states, as the first online CPU sees them."""
    first = online[0]
    base = "%s/cpu%d/" % (_CPU, first)
    boost = None
    text = reader.read_opt(_CPU + "/cpufreq/boost")
    if text in ("0", "1"):
        boost = text == "1"
    no_turbo = reader.read_opt(_CPU + "/intel_pstate/no_turbo")
    if no_turbo in ("0", "1"):
        boost = no_turbo == "0"
    states = []
    for _index, name in sorted(_numbered(reader.listdir(base + "cpuidle"), "state").items()):
        rel = base + "cpuidle/" + name + "/"
        states.append(
            {
                "name": reader.read(rel + "name", default="?"),
                "latency_us": reader.read_int(rel + "latency", default=-1),
                "disabled": reader.read(rel + "disable", default="0") == "1",
            }
        )
    return {
        "frequency_driver": reader.read_opt(base + "cpufreq/scaling_driver"),
        "governor": reader.read_opt(base + "cpufreq/scaling_governor"),
        "amd_pstate": reader.read_opt(_CPU + "/amd_pstate/status"),
        "boost": boost,
        "idle_driver": reader.read_opt(_CPU + "/cpuidle/current_driver"),
        "idle_states": states,
    }


def _virtualization(reader, cpuinfo_blocks, arch):
    flags = set(cpuinfo_blocks[0].get("flags", "").split()) if cpuinfo_blocks else set()
    dmi = {}
    for key in ("sys_vendor", "product_name", "board_vendor", "bios_vendor", "product_version"):
        value = reader.read("sys/class/dmi/id/" + key, default="")
        dmi[key] = value or None
    hypervisor = None
    evidence = []
    if "hypervisor" in flags:
        evidence.append("/proc/cpuinfo flags include 'hypervisor'")
    xen_type = reader.read("sys/hypervisor/type", default="")
    if xen_type:
        hypervisor = xen_type
        evidence.append(f"/sys/hypervisor/type is {xen_type!r}")
    vendor = (dmi["sys_vendor"] or "").lower()
    product = (dmi["product_name"] or "").lower()
    for needle, name in _DMI_HYPERVISORS:
        if needle in vendor or needle in product:
            if name == "hyperv" and "virtual" not in product:
                continue
            hypervisor = hypervisor or name
            evidence.append(
                "DMI says {!r} / {!r}".format(dmi["sys_vendor"] or "", dmi["product_name"] or "")
            )
            break
    is_virtual = bool(evidence)
    if is_virtual and hypervisor is None:
        hypervisor = "unknown"
    return {
        "is_virtual": is_virtual,
        "hypervisor": hypervisor,
        "evidence": evidence,
        "dmi_vendor": dmi["sys_vendor"],
        "dmi_product": dmi["product_name"],
        "dmi": dmi,
        "arch": arch,
    }


def _deception(virt, cpus, packages, nodes, l3_groups, *, l3_source):
    """Does this VM hide its real topology? The verdict and the facts behind it."""
    evidence = []
    n_cpus = len(cpus)
    n_packages = len(packages)
    one_cpu_per_socket = n_packages > 1 and all(len(p["cpus"]) == 1 for p in packages)
    if one_cpu_per_socket:
        evidence.append(
            "%d CPUs are presented as %d sockets of 1 core each; no real server has "
            "more than a handful of sockets" % (n_cpus, n_packages)
        )
    elif n_packages > 8:
        evidence.append("%d sockets presented; real servers have at most 8" % n_packages)
    numa_hidden = len(nodes) == 1 and n_packages > 1
    if numa_hidden:
        evidence.append(
            "%d sockets but a single NUMA node: memory locality is hidden from the guest"
            % n_packages
        )
    if n_cpus > 1 and l3_source == "cache" and all(len(g["cpus"]) == 1 for g in l3_groups):
        evidence.append("every CPU reports a private L3: cache sharing (CCX) is hidden")
    elif l3_source == "package+numa" and n_cpus > 1:
        evidence.append("no L3 cache topology is exposed")
    deceptive = bool(virt["is_virtual"] and (one_cpu_per_socket or numa_hidden or n_packages > 8))
    if deceptive:
        evidence = list(virt["evidence"]) + evidence
    return {
        "deceptive": deceptive,
        "evidence": evidence if (deceptive or virt["is_virtual"]) else [],
        "summary": (
            "virtual machine hides its CPU topology: pinning to L3 groups or NUMA nodes "
            "is meaningless here"
            if deceptive
            else (
                "virtual machine with a plausible topology" if virt["is_virtual"] else "bare metal"
            )
        ),
    }


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
    reader = _Reader(root)
    if not reader.exists(_CPU):
        raise TopologyError(reader.path(_CPU), "missing: ROOT must hold sys/ and proc/ like /")
    online = _online_cpus(reader)
    if not online:
        raise TopologyError(reader.path(_CPU + "/online"), "no online CPUs")
    online_set = set(online)
    per_cpu = _read_cpus(reader, online)

    # Cores: sibling groups (the kernel's core_cpus), never split.
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
                    reader.path("%s/cpu%d/topology/core_cpus_list" % (_CPU, cpu)),
                    "CPU %d is in two different sibling sets" % cpu,
                )
            seen[cpu] = siblings
    core_types = _core_types(reader)

    # Packages, in the kernel's own ids.
    packages = [
        {"id": pkg, "cpus": cpus}
        for pkg, cpus in sorted(_group(online, lambda c: per_cpu[c]["package"]).items())
    ]
    package_of = {cpu: per_cpu[cpu]["package"] for cpu in online}

    nodes, has_numa_dir = _read_nodes(reader, online, package_of)
    node_of = {}
    for node in nodes:
        for cpu in node["cpus"]:
            node_of[cpu] = node["id"]

    # Dies and clusters when the kernel reports them.
    dies = []
    if all(per_cpu[c]["die"] is not None for c in online):
        for (pkg, die), cpus in sorted(
            _group(online, lambda c: (per_cpu[c]["package"], per_cpu[c]["die"])).items()
        ):
            dies.append({"id": die, "package": pkg, "cpus": cpus})
    clusters = []
    if all(per_cpu[c]["cluster"] is not None for c in online):
        for (pkg, cluster), cpus in sorted(
            _group(online, lambda c: (per_cpu[c]["package"], per_cpu[c]["cluster"])).items()
        ):
            clusters.append({"id": cluster, "package": pkg, "cpus": cpus})

    # L3 groups: CPUs sharing one last-level cache. A CPU already seen in another CPU's
    # sharing set is not read again (the kernel reports the same set for each member); a
    # CPU without cache data joins the set another CPU reports it in. CPUs nobody reports
    # fall back to the smallest thing known to share memory locality (package x node).
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
                    reader.path("%s/cpu%d/cache" % (_CPU, cpu)),
                    "CPU %d is in two different L3 sharing sets (%s and %s)"
                    % (member, format_cpulist(members[member]), format_cpulist(shared)),
                )
        cache_of[shared] = l3
    uncovered = [cpu for cpu in online if cpu not in members]
    if not cache_of:
        l3_source = "package+numa"
    elif uncovered:
        l3_source = "cache+package+numa"
    else:
        l3_source = "cache"
    l3_groups = [
        {"cpus": list(shared), "cache_id": info["id"], "size": info["size"]}
        for shared, info in cache_of.items()
    ]
    for cpus in _group(uncovered, lambda c: (package_of[c], node_of[c])).values():
        l3_groups.append({"cpus": cpus, "cache_id": None, "size": None})
    l3_groups.sort(key=lambda g: g["cpus"][0])
    result_l3 = []
    for index, group in enumerate(l3_groups):
        group_nodes = sorted({node_of[c] for c in group["cpus"]})
        group_pkgs = sorted({package_of[c] for c in group["cpus"]})
        result_l3.append(
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

    cores = []
    for siblings in sorted(cores_by_first.values(), key=lambda s: s[0]):
        first = siblings[0]
        core = {
            "cpus": siblings,
            "core_id": per_cpu[first]["core_id"],
            "package": package_of[first],
            "numa_node": node_of[first],
        }
        if core_types:
            core["type"] = core_types.get(first, "unknown")
        cores.append(core)
    l3_of = {cpu: g["id"] for g in result_l3 for cpu in g["cpus"]}
    for core in cores:
        core["l3_group"] = l3_of[core["cpus"][0]]

    for node in nodes:
        node["l3_groups"] = sorted({l3_of[c] for c in node["cpus"]})
        node["packages"] = sorted({package_of[c] for c in node["cpus"]})

    # Only the first two blocks are used; a 1024-CPU cpuinfo is megabytes.
    cpuinfo_text = reader.read_opt("proc/cpuinfo", limit=1 << 18, truncate=True) or ""
    cpuinfo_blocks, arch = _parse_cpuinfo(cpuinfo_text)
    first = cpuinfo_blocks[0] if cpuinfo_blocks else {}
    vendor = first.get("vendor_id") or _arm_vendor(first.get("cpu implementer")) or None
    model_name = first.get("model name") or first.get("cpu") or None

    kernel = _kernel_info(reader)
    virt = _virtualization(reader, cpuinfo_blocks, arch)
    virt["deception"] = _deception(virt, online, packages, nodes, result_l3, l3_source=l3_source)
    smt = _smt(reader, cores)

    present_rel = _CPU + "/present"
    present = (
        parse_cpulist(reader.read(present_rel), reader.path(present_rel))
        if reader.exists(present_rel)
        else list(online)
    )

    return {
        "schema": SCHEMA_VERSION,
        "root": root,
        "arch": arch,
        "vendor": vendor,
        "model_name": model_name,
        "cpus": online,
        "present_cpus": present,
        "offline_cpus": sorted(set(present) - online_set),
        "packages": packages,
        "dies": dies,
        "clusters": clusters,
        "numa_nodes": nodes,
        "numa_source": "sysfs" if has_numa_dir else "assumed (no node/ directory)",
        # Nodes with CPUs but no memory (a socket without DIMMs), and nodes with memory but
        # no CPUs (CXL, HBM); both are in numa_nodes too.
        "memoryless_nodes": [n["id"] for n in nodes if n["cpus"] and not n["has_memory"]],
        "cpuless_nodes": [n["id"] for n in nodes if not n["cpus"]],
        "l3_groups": result_l3,
        "l3_source": l3_source,
        "cores": cores,
        "smt": smt,
        "hybrid": bool(core_types),
        "kernel": kernel,
        "isolation": _isolation(reader, kernel, online),
        "power": _power(reader, online),
        "virtualization": virt,
    }


_ARM_IMPLEMENTERS = {
    "0x41": "ARM",
    "0x42": "Broadcom",
    "0x43": "Cavium",
    "0x48": "HiSilicon",
    "0x4e": "NVIDIA",
    "0x50": "APM",
    "0x51": "Qualcomm",
    "0x61": "Apple",
    "0xc0": "Ampere",
}


def _arm_vendor(implementer):
    if not implementer:
        return None
    return _ARM_IMPLEMENTERS.get(implementer.lower(), "arm-" + implementer.lower())
