# Copyright: rtfleet contributors
# Apache-2.0
"""Apply rtfleet's runtime settings: sysctls, hugepages, IRQ affinity and the cpufreq governor.

The implementation of ``rtfleet-host-tune`` (roles/rtfleet_host/files), installed by the
rtfleet_host role as /usr/local/lib/rtfleet/rtfleet_node/hosttune.py (the role's
files/rtfleet_node/ links here); ``rtfleet-drift``
(:mod:`rtfleet.drift`) re-pins IRQs and compares sysctls and hugepages with these same
functions, so the boot and the drift guard cannot disagree. Stdlib only, Python >= 3.9.

rtfleet-host-tune.service runs it at every boot (after drivers have registered their
IRQs), and the role runs it with --check and then without,
so what the role reports is exactly what the boot does. Reads /etc/rtfleet/tune.json:

    {"housekeeping_cpus": "0,4", "irq_default_affinity_mask": "11", "irq_mode": "static",
     "governor": "performance", "sysctls": {"kernel.numa_balancing": 0},
     "hugepages": {"size_kb": 2048, "per_node": {"0": 64, "1": 64}}}

Both CPU sets come from the host's plan record: IRQs get the cpulist, and
/proc/irq/default_smp_affinity the plan's hex mask, which is in the kernel's 32-bit comma
groups ("1,00000001"): the kernel refuses a single hex word longer than 8 digits, so a
plain "%x" fails on any host with a housekeeping CPU >= 32.

The sysctls are also in /etc/sysctl.d/90-rtfleet.conf for systemd-sysctl at early boot;
setting them here as well means a run reports (and undoes) drift from the wanted values.

2M hugepages are allocated per NUMA node here (nodeN/hugepages/hugepages-<kB>kB/nr_hugepages),
at boot before kubelet starts, rather than with the command line's per-node hugepages=
(1G pages stay there: only the boot allocator is sure to find them).

Prints one JSON object: changed (what was, or with --check would be, changed), unmovable
(IRQs the kernel refuses to move: per-CPU and managed ones, which isolcpus=managed_irq
handles), skipped (settings this host cannot take, with the reason), short (nodes the
kernel gave fewer hugepages than asked); without --check also into --state (default
/run/rtfleet/tune-state.json). Exit 2 when the configuration is unreadable, 1 when a node is
short of hugepages (after everything else was applied), else 0.
"""

import argparse
import errno
import json
import os
import sys

from .cpulist import (
    TopologyError,
    format_cpulist,
    format_cpumask,
    parse_cpulist,
    parse_cpumask,
)


def read(path):
    with open(path) as fh:
        return fh.read().strip()


def write(path, value):
    with open(path, "w") as fh:
        fh.write(value)


def irq_numbers(root):
    """The IRQs in /proc/irq, numerically sorted (IRQs that appeared after boot included)."""
    irq_dir = os.path.join(root, "proc/irq")
    if not os.path.isdir(irq_dir):
        return []
    return sorted(int(n) for n in os.listdir(irq_dir) if n.isdigit())


def irq_actions(root, irq):
    """The handlers registered on an IRQ (/proc/irq/N/<name>/ directories): "virtio0-input.0"."""
    base = os.path.join(root, "proc/irq", str(irq))
    try:
        return sorted(n for n in os.listdir(base) if os.path.isdir(os.path.join(base, n)))
    except OSError:
        return []


def tune_irqs(root, housekeeping, mask, check, out, known_unmovable=()):  # noqa: PLR0917
    """Every IRQ allowed only on housekeeping CPUs (a subset of them is fine too).

    Returns the moves, made or (with ``check``) due: ``[{"irq": N, "from": cpulist, "to":
    cpulist}]``, ``"irq": "default"`` for /proc/irq/default_smp_affinity (hex masks there).
    """
    wanted = set(parse_cpulist(housekeeping))
    moves = []
    irq_dir = os.path.join(root, "proc/irq")
    default = os.path.join(irq_dir, "default_smp_affinity")
    if os.path.exists(default):
        before = read(default)
        if set(parse_cpumask(before, default)) != wanted:
            if not check:
                write(default, mask)
            out["changed"].append("default_smp_affinity=%s" % mask)
            moves.append({"irq": "default", "from": before, "to": mask})
    for name in map(str, irq_numbers(root)):
        path = os.path.join(irq_dir, name, "smp_affinity_list")
        try:
            before = set(parse_cpulist(read(path)))
        except OSError:
            continue
        if before <= wanted:
            continue
        if check and int(name) in known_unmovable:
            out["unmovable"].append(int(name))
            continue
        if check:
            out["changed"].append("irq %s: %s -> %s" % (name, fmt(before), housekeeping))
            moves.append({"irq": int(name), "from": fmt(before), "to": housekeeping})
            continue
        try:
            write(path, housekeeping)
            after = set(parse_cpulist(read(path)))
        except OSError as exc:
            if exc.errno not in (errno.EIO, errno.EINVAL, errno.EPERM):
                raise
            out["unmovable"].append(int(name))
            continue
        if after == before:
            out["unmovable"].append(int(name))
        else:
            out["changed"].append("irq %s: %s -> %s" % (name, fmt(before), fmt(after)))
            moves.append({"irq": int(name), "from": fmt(before), "to": fmt(after)})
    return moves


def sysctl_drift(root, sysctls, out):
    """[(key, running value, wanted value)] for every sysctl that differs (whitespace-blind)."""
    drifted = []
    for key, value in sorted(sysctls.items()):
        path = os.path.join(root, "proc/sys", key.replace(".", "/"))
        if not os.path.exists(path):
            out["skipped"].append("sysctl %s: not in this kernel" % key)
            continue
        wanted = " ".join(str(value).split())
        have = " ".join(read(path).split())
        if have != wanted:
            drifted.append((key, have, wanted))
    return drifted


def tune_sysctls(root, sysctls, check, out):
    for key, _have, wanted in sysctl_drift(root, sysctls, out):
        if not check:
            write(os.path.join(root, "proc/sys", key.replace(".", "/")), wanted)
        out["changed"].append("%s = %s" % (key, wanted))


def read_hugepages(config):
    """tune.json's hugepages -> (size_kb, {node: count}), or None; ValueError when malformed."""
    hugepages = config.get("hugepages")
    if not hugepages:
        return None
    try:
        size_kb = int(hugepages["size_kb"])
        per_node = {int(node): int(count) for node, count in hugepages["per_node"].items()}
    except (KeyError, TypeError, ValueError, AttributeError):
        raise ValueError(
            'hugepages must be {"size_kb": N, "per_node": {"NODE": COUNT}}, not %r' % (hugepages,)
        ) from None
    if size_kb <= 0 or any(node < 0 or count < 0 for node, count in per_node.items()):
        raise ValueError("hugepages: size_kb, node ids and counts must be >= 0 (%r)" % (hugepages,))
    return size_kb, per_node


def _hugepage_pool(root, node, size_kb):
    pool = "node%d/hugepages/hugepages-%dkB/nr_hugepages" % (node, size_kb)
    return os.path.join(root, "sys/devices/system/node", pool)


def hugepage_drift(root, size_kb, per_node, out):
    """[(node, pages the node has, pages wanted)] for every node whose pool differs."""
    drifted = []
    for node, count in sorted(per_node.items()):
        path = _hugepage_pool(root, node, size_kb)
        if not os.path.exists(path):
            out["skipped"].append("hugepages node %d: no %d kB pool on this host" % (node, size_kb))
            continue
        before = int(read(path))
        if before != count:
            drifted.append((node, before, count))
    return drifted


def tune_hugepages(root, size_kb, per_node, check, out):
    """Each node's pool of one size set to its count; a node that gets fewer is "short"."""
    for node, before, count in hugepage_drift(root, size_kb, per_node, out):
        path = _hugepage_pool(root, node, size_kb)
        if not check:
            try:
                write(path, "%d" % count)
            except OSError as exc:  # ENOMEM and the like: what was got is read back below
                out["skipped"].append("hugepages node %d: %s" % (node, exc.strerror))
            after = int(read(path))
            if after < count:
                out["short"].append("node %d: %d of %d" % (node, after, count))
        out["changed"].append(
            "hugepages node %d: %d -> %d x %d kB" % (node, before, count, size_kb)
        )


def tune_governor(root, governor, check, out):
    base = os.path.join(root, "sys/devices/system/cpu")
    cpus = sorted(
        (n for n in os.listdir(base) if n[3:].isdigit() and n.startswith("cpu")),
        key=lambda n: int(n[3:]),
    )
    found = False
    for cpu in cpus:
        path = os.path.join(base, cpu, "cpufreq", "scaling_governor")
        if not os.path.exists(path):
            continue
        found = True
        available = os.path.join(base, cpu, "cpufreq", "scaling_available_governors")
        if os.path.exists(available) and governor not in read(available).split():
            out["skipped"].append(
                "%s: governor %s not offered (%s)" % (cpu, governor, read(available))
            )
            continue
        if read(path) != governor:
            if not check:
                write(path, governor)
            out["changed"].append("%s governor -> %s" % (cpu, governor))
    if not found:
        out["skipped"].append("governor: no cpufreq driver on this host")


def fmt(cpus):
    return format_cpulist(sorted(cpus))


class ConfigError(ValueError):
    """tune.json cannot be used; the message names the file and what is wrong."""


def load_config(path):
    """tune.json -> (config, housekeeping cpulist, default affinity mask, hugepages or None)."""
    try:
        with open(path) as fh:
            config = json.load(fh)
        if not isinstance(config, dict):
            raise ValueError("not a JSON object")
        housekeeping = config["housekeeping_cpus"]
        # tune.json from an older role has no mask: the same formatter the plan uses.
        mask = config.get("irq_default_affinity_mask") or format_cpumask(
            parse_cpulist(housekeeping)
        )
        if set(parse_cpumask(mask)) != set(parse_cpulist(housekeeping)):
            raise ValueError(
                "irq_default_affinity_mask %s is not housekeeping_cpus %s" % (mask, housekeeping)
            )
        hugepages = read_hugepages(config)
        if not isinstance(config.get("sysctls") or {}, dict):
            raise ValueError("sysctls must be an object")
    except (OSError, ValueError, KeyError, TypeError, AttributeError, TopologyError) as exc:
        raise ConfigError("cannot use %s: %s" % (path, exc)) from None
    return config, housekeeping, mask, hugepages


def read_unmovable(*state_files):
    """IRQs an earlier real run found the kernel refusing to move (--check cannot try)."""
    found = set()
    for path in state_files:
        try:
            with open(path) as fh:
                found.update(int(irq) for irq in json.load(fh).get("unmovable", []))
        except (OSError, ValueError, TypeError, AttributeError):
            continue
    return found


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n", maxsplit=1)[0])
    ap.add_argument("--config", default="/etc/rtfleet/tune.json")
    ap.add_argument("--root", default="/", help="where proc/ and sys/ are (tests)")
    ap.add_argument("--check", action="store_true", help="report what would change; change nothing")
    ap.add_argument(
        "--state", default="/run/rtfleet/tune-state.json", help="where the result is kept"
    )
    args = ap.parse_args(argv)
    try:
        config, housekeeping, mask, hugepages = load_config(args.config)
    except ConfigError as exc:
        sys.stderr.write("rtfleet-host-tune: %s\n" % exc)
        return 2
    out = {"changed": [], "unmovable": [], "skipped": [], "short": []}
    tune_sysctls(args.root, config.get("sysctls") or {}, args.check, out)
    if hugepages:
        tune_hugepages(args.root, *hugepages, args.check, out)
    if config.get("irq_mode") == "static":
        # --check cannot tell a managed or per-CPU IRQ from a movable one without trying;
        # the last real run tried, and its state says which ones the kernel refused.
        tune_irqs(args.root, housekeeping, mask, args.check, out, read_unmovable(args.state))
    if config.get("governor"):
        tune_governor(args.root, config["governor"], args.check, out)
    sys.stdout.write(json.dumps(out, sort_keys=True) + "\n")
    if not args.check:
        os.makedirs(os.path.dirname(args.state), exist_ok=True)
        with open(args.state, "w") as fh:
            json.dump(out, fh, sort_keys=True)
    if out["short"]:
        sys.stderr.write(
            "rtfleet-host-tune: fewer %s kB hugepages than asked (%s): memory is in use or "
            "fragmented; reboot (this runs before workloads start) or lower "
            "rtfleet_host_hugepages_per_node\n" % (hugepages[0], "; ".join(out["short"]))
        )
        return 1
    return 0
