"""CPU sets in the kernel's text forms: cpulists ("0-3,8") and hex cpumasks ("ff,00000000").

The ground floor of rtfleet's Python: the topology reader, the planner, kubelet's
validation, the post-check, the boot record and the host-side tuner and drift guard all
parse and format CPU sets here, and raise :class:`TopologyError` for input they refuse.
Stdlib-only and Python >= 3.9, because it ships to managed hosts beside topology.py: it is
the collection's ``module_utils/cpulist.py``, the CLI's ``rtfleet.cpulist``, the shminfer
wheel's ``shminfer.cpulist`` and the host role's ``rtfleet_node.cpulist`` (symlinks to this
file in the repository).

CPU sets are sorted lists of ints inside; these strings only at the edges.
"""

from __future__ import annotations

import re


class TopologyError(Exception):
    """Unreadable or malformed topology input; the message names the file."""

    def __init__(self, path, message):
        self.path = path
        Exception.__init__(self, f"{path}: {message}")


# The largest CPU id accepted anywhere: Linux's NR_CPUS tops out at 8192 (x86 MAXSMP, ppc64,
# arm64 4096), so 65536 leaves room and still bounds what a hostile "0-99999999" can cost.
MAX_CPUS = 65536
NUMBER = re.compile(r"^[0-9]+$")  # ASCII digits only (str.isdigit() also takes "\u00b2")


def shown(text, limit=40):
    """repr() of text, cut to ``limit`` characters so an error stays one short line."""
    if len(text) <= limit:
        return repr(text)
    return "%r... (%d characters)" % (text[:limit], len(text))


def clean(text):
    """``text`` without NULs (sysfs files may end in one) and outer white space."""
    return text.replace("\x00", "").strip()


def _cpu_id(token, path, text):
    if not NUMBER.match(token):
        return None
    if len(token) > len(str(MAX_CPUS)) or int(token) >= MAX_CPUS:
        raise TopologyError(
            path,
            "CPU id %s in cpulist %s is above the %d-CPU limit"
            % (shown(token, 12), shown(text), MAX_CPUS),
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
                "%s holds %s, which kubelet's cpuset syntax does not allow" % (shown(text), bad),
            )
    else:
        text = clean(text)
        if not text or text == "(null)":
            return []
    cpus = set()
    for item in text.split(","):
        part, _sep, step = (item if strict else item.strip()).partition(":")
        if not part:
            if strict:
                raise TopologyError(
                    path, '%s has an empty item (kubelet refuses "0-3,")' % shown(text)
                )
            continue
        stride, used = 1, None
        if step:
            # "a-b:used/group" (kernel command line: used CPUs of every group) or "a-b:stride"
            used_text, slash, group_text = step.partition("/")
            if not NUMBER.match(used_text) or len(used_text) > 6 or int(used_text) == 0:
                raise TopologyError(path, f"bad cpulist stride {shown(step, 12)} in {shown(text)}")
            if slash:
                if not NUMBER.match(group_text) or len(group_text) > 6 or int(group_text) == 0:
                    raise TopologyError(
                        path, f"bad cpulist group {shown(step, 12)} in {shown(text)}"
                    )
                used, stride = int(used_text), int(group_text)
            else:
                stride = int(used_text)
        if "-" in part:
            lo_text, _sep, hi_text = part.partition("-")
            lo = _cpu_id(lo_text, path, text)
            hi = _cpu_id(hi_text, path, text)
            if lo is None or hi is None or lo > hi:
                raise TopologyError(path, f"bad cpulist range {shown(part, 24)} in {shown(text)}")
            if used is None:
                cpus.update(range(lo, hi + 1, stride))
            else:
                for start in range(lo, hi + 1, stride):
                    cpus.update(range(start, min(start + used, hi + 1)))
        else:
            cpu = _cpu_id(part, path, text)
            if cpu is None or step:
                raise TopologyError(path, f"bad cpulist entry {shown(part, 24)} in {shown(text)}")
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
    text = clean(text).replace(",", "")
    if text.startswith(("0x", "0X")):
        text = text[2:]
    if not text:
        return []
    if len(text) * 4 > MAX_CPUS:
        raise TopologyError(
            path, "cpumask of %d hex digits is above the %d-CPU limit" % (len(text), MAX_CPUS)
        )
    if not re.match(r"^[0-9a-fA-F]+$", text):
        raise TopologyError(path, f"not a hex cpumask: {shown(text)}")
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
