# Copyright: rtfleet contributors
# Apache-2.0
"""Kernel command line and boot entries: what the host role wants, and what a host runs.

One implementation serves the controller (the ``rtfleet_kernel_args`` filter composes the
command line from the plan) and the host (the ``boot_state`` module reads the running
kernel, /proc/cmdline, the isolation sysfs files and GRUB's menu and environment block, and
compares them with what is wanted). Stdlib only, Python >= 3.9, so it runs on the nodes.
"""

from __future__ import annotations

import os
import re

from .cpulist import format_cpulist, parse_cpulist

# Keys the host owns outright: an operator's extra arguments must not set them, because the
# plan or a role variable already does (and a second value would silently win or lose).
_NEVER_EXTRA = ("BOOT_IMAGE", "root", "initrd")
_AMD = ("AuthenticAMD", "HygonGenuine")
_INTEL = ("GenuineIntel",)
# Hugepage sizes the role reserves, in KiB (also the sysfs directory names hugepages-<kB>kB).
HUGEPAGE_KB = {"2M": 2048, "1G": 1048576}
# Leave at least this share of each node's memory outside the hugepage pool.
HUGEPAGES_MAX_SHARE = 0.75
# Sizes reserved on the kernel command line. Gigantic (1G) pages need contiguous memory that
# only the boot allocator is sure to find. 2M pages are allocated per node through sysfs by
# rtfleet-host-tune at every boot, before kubelet starts, as OpenShift's Node Tuning
# Operator does for per-node pages: the command line's per-node form made the PREEMPT_RT
# kernel's hugetlb_init take 11 s to more than 12 min on the lab guests (docs/dev/runs.md),
# a count changes without a reboot, and a node that gets fewer pages is reported by name.
HUGEPAGES_AT_BOOT = ("1G",)


class BootConfigError(ValueError):
    """The wanted kernel command line cannot be built; the message says what to change."""


def split_cmdline(text):
    """Split a kernel command line like the kernel does: spaces, with "double quotes"."""
    return [m.group(0) for m in re.finditer(r'(?:[^\s"]+|"[^"]*")+', text or "")]


def arg_key(token):
    return token.split("=", 1)[0]


def _has_memory(node):
    return node.get("has_memory", True) and node.get("memory_kb") != 0


def hugepage_counts(topology, size, per_node):
    """{node id: pages} the host reserves, validated against the topology ({} for none).

    ``per_node`` is a count for every node with CPUs and memory, or a dict node -> count.
    """
    if isinstance(per_node, str) and per_node.strip().isdigit():
        per_node = int(per_node)
    if not per_node:
        return {}
    if size not in HUGEPAGE_KB:
        raise BootConfigError(
            "hugepages size %r is not supported: use one of %s"
            % (size, ", ".join(sorted(HUGEPAGE_KB)))
        )
    nodes = {n["id"]: n for n in topology.get("numa_nodes") or []}
    if isinstance(per_node, dict):
        counts = {}
        for key, count in per_node.items():
            try:
                node = int(key)
            except (TypeError, ValueError):
                raise BootConfigError(
                    "hugepages per node: %r is not a NUMA node id" % (key,)
                ) from None
            if node not in nodes:
                raise BootConfigError(
                    "hugepages per node: NUMA node %d does not exist on this host (nodes: %s)"
                    % (node, ", ".join(str(n) for n in sorted(nodes)) or "none")
                )
            counts[node] = count
    else:
        # Every node that has CPUs and memory: a memoryless node (a socket without DIMMs)
        # has nothing to reserve, and a CPU-less node (CXL) is far memory nobody runs on.
        counts = dict.fromkeys(
            (n for n, node in nodes.items() if node.get("cpus", True) and _has_memory(node)),
            per_node,
        )
    for node in sorted(counts):
        count = counts[node]
        if isinstance(count, str) and count.strip().isdigit():  # -e / INI inventory values
            count = counts[node] = int(count)
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise BootConfigError(
                "hugepages per node: node %d count %r is not a whole number >= 0" % (node, count)
            )
        memory_kb = nodes[node].get("memory_kb") or 0
        want_kb = count * HUGEPAGE_KB[size]
        if count and not _has_memory(nodes[node]):
            raise BootConfigError(
                "hugepages per node: NUMA node %d has no memory (memoryless: no DIMMs on its "
                "socket); reserve its pages on node %s instead"
                % (node, nodes[node].get("memory_node"))
            )
        if memory_kb and want_kb > HUGEPAGES_MAX_SHARE * memory_kb:
            raise BootConfigError(
                "hugepages: %d x %s on NUMA node %d is %d MiB, more than %d%% of the node's "
                "%d MiB; lower the count"
                % (count, size, node, want_kb // 1024, HUGEPAGES_MAX_SHARE * 100, memory_kb // 1024)
            )
    if not any(counts.values()):
        return {}
    return dict(sorted(counts.items()))


def hugepage_runtime_settings(topology, size, per_node):
    """What rtfleet-host-tune allocates at every boot: {"size_kb", "per_node"} or {}.

    Empty when the size is reserved on the command line (HUGEPAGES_AT_BOOT) or nothing is.
    """
    counts = hugepage_counts(topology, size, per_node)
    if not counts or size in HUGEPAGES_AT_BOOT:
        return {}
    return {"size_kb": HUGEPAGE_KB[size], "per_node": {str(n): c for n, c in counts.items()}}


def _hugepage_args(topology, size, per_node):
    counts = hugepage_counts(topology, size, per_node)
    if not counts or size not in HUGEPAGES_AT_BOOT:
        return []
    spec = ",".join("%d:%d" % (node, count) for node, count in counts.items())
    return ["default_hugepagesz=%s" % size, "hugepagesz=%s" % size, "hugepages=%s" % spec]


def compose_kernel_args(plan, topology, options=None):
    """The full list of arguments the host role adds to the kernel command line.

    ``plan`` gives the isolation arguments; ``options`` the host-wide ones (keys:
    skew_tick, tsc_reliable, nosoftlockup, transparent_hugepage, max_cstate, amd_pstate,
    panic_s, hugepages_size, hugepages_per_node, extra).
    """
    opts = dict(options or {})
    vendor = topology.get("vendor") or ""
    args = list(plan.get("kernel_args") or [])
    if opts.get("skew_tick", True):
        args.append("skew_tick=1")
    if opts.get("tsc_reliable", True) and topology.get("arch") in ("x86_64", None):
        args.append("tsc=reliable")
    if opts.get("nosoftlockup", True):
        args.append("nosoftlockup")
    thp = opts.get("transparent_hugepage", "never")
    if thp:
        if thp not in ("never", "madvise", "always"):
            raise BootConfigError(
                "transparent_hugepage must be never, madvise or always, not %r" % (thp,)
            )
        args.append("transparent_hugepage=%s" % thp)
    max_cstate = opts.get("max_cstate")
    if isinstance(max_cstate, str) and max_cstate.strip().isdigit():
        max_cstate = int(max_cstate)
    if max_cstate is not None:
        if (
            not isinstance(max_cstate, int)
            or isinstance(max_cstate, bool)
            or not 0 <= max_cstate <= 9
        ):
            raise BootConfigError(
                "max_cstate must be a whole number 0..9 (or null to leave C-states alone)"
            )
        if vendor in _INTEL:
            args.append("intel_idle.max_cstate=%d" % max_cstate)
        if vendor in _INTEL + _AMD:
            # acpi_idle on AMD (and on Intel when intel_idle is off) takes the same limit.
            args.append("processor.max_cstate=%d" % max(max_cstate, 1))
    amd_pstate = opts.get("amd_pstate")
    if amd_pstate and vendor in _AMD:
        if amd_pstate not in ("active", "passive", "guided", "disable"):
            raise BootConfigError(
                "amd_pstate must be active, passive, guided or disable, not %r" % (amd_pstate,)
            )
        args.append("amd_pstate=%s" % amd_pstate)
    panic_s = opts.get("panic_s")
    if panic_s:
        args.append("panic=%d" % int(panic_s))
    args += _hugepage_args(
        topology, opts.get("hugepages_size") or "2M", opts.get("hugepages_per_node") or 0
    )

    managed = {arg_key(a): a for a in args}
    for token in opts.get("extra") or []:
        if not isinstance(token, str) or not token.strip() or split_cmdline(token) != [token]:
            raise BootConfigError(
                "extra kernel argument %r must be one word (key or key=value)" % (token,)
            )
        key = arg_key(token)
        if key in _NEVER_EXTRA:
            raise BootConfigError(
                "extra kernel argument %r: %s belongs to the distribution's boot entry"
                % (token, key)
            )
        if key in managed:
            raise BootConfigError(
                "extra kernel argument %r conflicts with %r, which the plan or a role "
                "variable sets; change it there instead" % (token, managed[key])
            )
        managed[key] = token
        args.append(token)
    return args


def isolation_expected(args):
    """What /sys/devices/system/cpu/{isolated,nohz_full} must show for these arguments.

    ``isolated`` lists only scheduler-domain isolation: ``isolcpus=`` with no flags or with
    ``domain``. With ``managed_irq`` (and/or ``nohz``) alone the kernel leaves it empty.
    """
    isolated, nohz_full = "", ""
    for token in args:
        key, _sep, value = token.partition("=")
        if key == "isolcpus":
            parts = value.split(",")
            flags = []
            while parts and parts[0] and parts[0][0].isalpha():
                flags.append(parts.pop(0))
            if not flags or "domain" in flags:
                isolated = format_cpulist(parse_cpulist(",".join(parts)))
            else:
                isolated = ""
        elif key == "nohz_full":
            nohz_full = format_cpulist(parse_cpulist(value))
    return {"isolated": isolated, "nohz_full": nohz_full}


# --- what a host runs ---------------------------------------------------------------


def _read(root, rel, default=None):
    try:
        with open(os.path.join(root, rel), encoding="utf-8", errors="replace") as fh:
            return fh.read().replace("\x00", "").strip()
    except OSError:
        return default


def _norm_cpulist(text):
    if text is None:
        return None
    return format_cpulist(parse_cpulist(text)) if text.strip() else ""


def read_running(root="/"):
    cmdline = _read(root, "proc/cmdline", "")
    realtime = _read(root, "sys/kernel/realtime")
    return {
        "release": _read(root, "proc/sys/kernel/osrelease"),
        "cmdline": cmdline,
        "args": split_cmdline(cmdline),
        "realtime": realtime == "1",
        "isolated": _norm_cpulist(_read(root, "sys/devices/system/cpu/isolated", "")),
        "nohz_full": _norm_cpulist(_read(root, "sys/devices/system/cpu/nohz_full", "")),
    }


def _version_key(release):
    return [(0, int(p)) if p.isdigit() else (1, p) for p in re.split(r"[.\-+_~]", release)]


def installed_kernels(root="/"):
    """Kernel releases with an image in /boot, newest first."""
    try:
        names = os.listdir(os.path.join(root, "boot"))
    except OSError:
        return []
    releases = [n[len("vmlinuz-") :] for n in names if n.startswith("vmlinuz-")]
    return sorted(releases, key=_version_key, reverse=True)


def is_rt_release(release):
    return bool(re.search(r"(^|[.\-+])rt([.\-+\d]|$)", release))


def pick_kernel(releases, flavour):
    """Newest installed kernel of the flavour: rt -> a PREEMPT_RT build; stock/tuned -> not."""
    want_rt = flavour == "rt"
    for release in releases:
        if is_rt_release(release) == want_rt:
            return release
    return None


def verify(wanted, running):
    """Mismatches between the wanted boot (release, flavour, args) and the running host."""
    problems = []
    release = wanted.get("release")
    if release and running["release"] != release:
        problems.append("running kernel is %s, wanted %s" % (running["release"], release))
    flavour = wanted.get("flavour")
    if flavour == "rt" and not running["realtime"]:
        problems.append("/sys/kernel/realtime is not 1: the running kernel is not PREEMPT_RT")
    if flavour in ("stock", "tuned") and running["realtime"]:
        problems.append(
            "a PREEMPT_RT kernel is running but flavour %s wants a stock kernel" % flavour
        )
    have = set(running["args"])
    missing = [a for a in wanted.get("args") or [] if a not in have]
    if missing:
        problems.append("/proc/cmdline lacks %s" % " ".join(missing))
    expected = isolation_expected(wanted.get("args") or [])
    for key in ("isolated", "nohz_full"):
        if running[key] is not None and running[key] != expected[key]:
            problems.append(
                "/sys/devices/system/cpu/%s is %r, the plan says %r"
                % (key, running[key], expected[key])
            )
    return problems


# --- GRUB ---------------------------------------------------------------------------

_ENTRY_RE = re.compile(r"^\s*(menuentry|submenu)\s+'((?:[^']|'\\'')*)'(.*)\{\s*$")
_ID_RE = re.compile(r"(?:\$menuentry_id_option|--id)[\s=]+'?([^'\s]+)'?")
_LINUX_RE = re.compile(r"^\s*linux(?:efi|16)?\s+(\S+)\s*(.*)$")


def parse_grub_cfg(text):
    """Menu entries of a grub.cfg: title, id, their submenu paths, kernel release, args.

    ``top_index`` is the entry's number in the top-level menu (a submenu counts as one
    item, as in GRUB), None inside a submenu.
    """
    entries, stack, top = [], [], 0
    for line in (text or "").splitlines():
        m = _ENTRY_RE.match(line)
        if m:
            kind, title, rest = m.group(1), m.group(2).replace("'\\''", "'"), m.group(3)
            idm = _ID_RE.search(rest)
            node = {"kind": kind, "title": title, "id": idm.group(1) if idm else None}
            if not stack:
                node["top_index"], top = top, top + 1
            else:
                node["top_index"] = None
            if kind == "menuentry":
                node["title_path"] = ">".join([p["title"] for p in stack] + [title])
                node["id_path"] = ">".join(
                    [p["id"] or p["title"] for p in stack] + [node["id"] or title]
                )
                node["release"], node["args"] = None, []
                entries.append(node)
            stack.append(node)
            continue
        if line.strip() == "}" and stack:
            stack.pop()
            continue
        m = _LINUX_RE.match(line)
        if m and stack and stack[-1]["kind"] == "menuentry":
            base = m.group(1).rsplit("/", 1)[-1]
            stack[-1]["release"] = base[len("vmlinuz-") :] if base.startswith("vmlinuz-") else None
            stack[-1]["args"] = split_cmdline(m.group(2))
    return [{k: v for k, v in e.items() if k != "kind"} for e in entries]


def parse_grubenv(text):
    env = {}
    for line in (text or "").splitlines():
        if line.startswith("#") or "=" not in line:
            continue
        key, _sep, value = line.partition("=")
        env[key] = value
    return env


def resolve_entry(entries, ref):
    """The entry GRUB boots for a default/next_entry value (index, title, id or a path)."""
    if ref is None or ref == "":
        ref = "0"
    for e in entries:
        if ref in (e["id_path"], e["title_path"]):
            return e
    for e in entries:
        if e["top_index"] is not None and ref in (e["id"], e["title"]):
            return e
    if ref.isdigit():
        for e in entries:
            if e["top_index"] == int(ref):
                return e
    return None


def kernel_entry(entries, release):
    """The distribution's normal (not recovery, not rtfleet) entry for a kernel release."""
    for e in entries:
        if (
            e["release"] != release
            or "recovery" in (e["id"] or "")
            or (e["id"] or "").startswith("rtfleet")
        ):
            continue
        if "single" in e["args"] or "recovery" in e["title"].lower():
            continue
        if (e["id"] or "").startswith("gnulinux-simple"):
            continue
        return e
    return None


def read_grub(root="/", grub_cfg="boot/grub/grub.cfg", grubenv="boot/grub/grubenv"):
    entries = parse_grub_cfg(_read(root, grub_cfg.lstrip("/"), "") or "")
    env = parse_grubenv(_read(root, grubenv.lstrip("/"), "") or "")
    saved = env.get("saved_entry")
    default = resolve_entry(entries, saved)
    return {
        "entries": entries,
        "saved_entry": saved,
        "next_entry": env.get("next_entry") or None,
        "default": default,
    }
