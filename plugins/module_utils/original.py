# -*- coding: utf-8 -*-
# Copyright: rtfleet contributors
# Apache-2.0
"""The host as it was before rtfleet first changed it: recorded once, restored by
``rtfleet.fleet.restore``, and the one check that a restored host matches it.

The host role records it (``rtfleet.fleet.host_original`` with ``state: recorded``) before
its first change, and never again while the record exists; the record names the host it was
taken on (``/etc/machine-id``) and carries the SHA-256 of its own content, so a record from
another host (a cloned disk) or one edited by hand is refused in one line. What it holds is
what rtfleet changes: the kernel command line and GRUB's default entry, the sysctls rtfleet
sets, IRQ affinities, the cpufreq governor, hugepage pools per node, which of the units
rtfleet stops or starts were enabled and active, irqbalance's configuration, and which of
rtfleet's paths existed. Stdlib only: it runs on the managed host.
"""

from __future__ import absolute_import, division, print_function

__metaclass__ = type

import glob
import hashlib
import json
import os

SCHEMA = 1
# Units whose state rtfleet changes (irqbalance stopped, tuned started, kubelet restarted).
UNITS = ("irqbalance.service", "tuned.service", "kubelet.service")
# Files rtfleet edits in place rather than owning: their content before is kept.
EDITED_FILES = ("etc/default/irqbalance", "etc/tuned/active_profile")
# What rtfleet leaves on a host, by pattern (relative to the root). A restored host has none
# of these unless the record says it existed before rtfleet. The check does not use the
# roles' own lists of what they wrote: a path a role forgets to remove is still found.
LEFTOVER_PATTERNS = (
    "etc/rtfleet",
    "var/lib/rtfleet",
    "usr/local/lib/rtfleet",
    "usr/local/sbin/rtfleet-*",
    "etc/sysctl.d/*rtfleet*",
    "etc/default/grub.d/rtfleet*",
    "etc/grub.d/*rtfleet*",
    "etc/systemd/system/rtfleet*",
    "etc/systemd/system/shminfer*",
    "etc/systemd/system/*.d/*rtfleet*",
    "etc/systemd/system/*.wants/rtfleet*",
    "etc/systemd/system/*.wants/shminfer*",
    "etc/tuned/rtfleet*",
    "etc/kubernetes/kubelet.conf.d/*rtfleet*",
    "opt/shminfer",
    "var/lib/shminfer",
    "var/lib/prometheus/node-exporter/rtfleet*",
    "var/lib/prometheus/node-exporter/shminfer*",
)


class RecordError(ValueError):
    """A record that cannot be used; the message is one line that says what to do."""


def _read(root, rel, default=None):
    try:
        with open(os.path.join(root, rel), encoding="utf-8", errors="replace") as fh:
            return fh.read().strip()
    except OSError:
        return default


def _numbered(root, rel, prefix):
    base = os.path.join(root, rel)
    try:
        names = os.listdir(base)
    except OSError:
        return []
    return sorted(
        (n for n in names if n.startswith(prefix) and n[len(prefix) :].isdigit()),
        key=lambda n: int(n[len(prefix) :]),
    )


def read_sysctls(root, keys):
    """{"kernel.numa_balancing": "1", ...}: None for a key this kernel does not have."""
    return {k: _read(root, "proc/sys/" + k.replace(".", "/")) for k in sorted(keys)}


def _irq_actions(root, irq):
    base = os.path.join(root, "proc/irq", irq)
    try:
        return sorted(n for n in os.listdir(base) if os.path.isdir(os.path.join(base, n)))
    except OSError:
        return []


def read_irqs(root):
    """IRQ affinities keyed by the handlers on each IRQ ("virtio0-input.0"), not by number:
    the numbers move between boots (one more IRQ set up earlier shifts every later one), the
    handlers' names do not. An IRQ without a handler keeps its number as its key."""
    affinity, numbers = {}, {}
    for irq in _numbered(root, "proc/irq", ""):
        value = _read(root, "proc/irq/%s/smp_affinity_list" % irq)
        if value is None:
            continue
        key = ",".join(_irq_actions(root, irq)) or irq
        if key in affinity:  # two IRQs of one handler name: told apart by their order
            n = 2
            while "%s#%d" % (key, n) in affinity:
                n += 1
            key = "%s#%d" % (key, n)
        affinity[key] = value
        numbers[key] = irq
    return {
        "default_smp_affinity": _read(root, "proc/irq/default_smp_affinity"),
        "affinity": affinity,
        "numbers": numbers,
    }


def read_governors(root):
    out = {}
    for cpu in _numbered(root, "sys/devices/system/cpu", "cpu"):
        value = _read(root, "sys/devices/system/cpu/%s/cpufreq/scaling_governor" % cpu)
        if value is not None:
            out[cpu] = value
    return out


def read_hugepages(root):
    """{"node0": {"2048": 0, "1048576": 0}, ...}."""
    out = {}
    for node in _numbered(root, "sys/devices/system/node", "node"):
        pools = {}
        base = "sys/devices/system/node/%s/hugepages" % node
        for pool in sorted(glob.glob(os.path.join(root, base, "hugepages-*kB"))):
            size = os.path.basename(pool)[len("hugepages-") : -len("kB")]
            value = _read(root, "%s/hugepages-%skB/nr_hugepages" % (base, size))
            if value is not None and value.isdigit():
                pools[size] = int(value)
        out[node] = pools
    return out


def read_packages(root):
    """Installed Debian packages by name, from dpkg's status file (readable in a test tree)."""
    text = _read(root, "var/lib/dpkg/status", "") or ""
    names = set()
    for stanza in text.split("\n\n"):
        fields = {}
        for line in stanza.splitlines():
            if ": " in line and not line[:1].isspace():
                key, value = line.split(": ", 1)
                fields[key] = value
        if fields.get("Package") and fields.get("Status") == "install ok installed":
            names.add(fields["Package"])
    return sorted(names)


# Packages rtfleet's roles install; restore removes those that were not installed before, and
# the versioned kernel images and headers that came with a kernel metapackage.
KERNEL_PACKAGE_PREFIXES = ("linux-image-", "linux-headers-")


def packages_to_remove(original, now, rtfleet_packages):
    """Packages installed since the record that rtfleet put there."""
    new = set(now) - set(original)
    ours = {p for p in new if p in set(rtfleet_packages)}
    if any(p.startswith(KERNEL_PACKAGE_PREFIXES) for p in ours):
        ours |= {p for p in new if p.startswith(KERNEL_PACKAGE_PREFIXES)}
    return sorted(ours)


def leftovers(root, existed_before=()):
    """rtfleet's paths on the host now, less those the record says were there before."""
    found = set()
    for pattern in LEFTOVER_PATTERNS:
        for path in glob.glob(os.path.join(root, pattern)):
            found.add(os.path.relpath(path, root))
    return sorted(found - set(existed_before))


def read_host(root, sysctl_keys, boot, units):
    """The live state the record compares: `boot` (release, cmdline, GRUB default) and
    `units` ({unit: {"enabled": ..., "active": ...}}) come from the caller, which reads them
    with boot.py and systemctl."""
    return {
        "machine_id": _read(root, "etc/machine-id"),
        "boot": boot,
        "sysctls": read_sysctls(root, sysctl_keys),
        "irqs": read_irqs(root),
        "governors": read_governors(root),
        "hugepages": read_hugepages(root),
        "units": units,
        "files": {rel: _read(root, rel) for rel in EDITED_FILES},
        "rtfleet_paths": leftovers(root),
        "packages": read_packages(root),
    }


def _digest(body):
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode("utf-8")).hexdigest()


def seal(state, recorded_at):
    body = dict(state, schema=SCHEMA, recorded_at=recorded_at)
    return dict(body, sha256=_digest(body))


def check_record(record, machine_id, path):
    """The record's body, or RecordError: unknown schema, edited, or another host's."""
    if not isinstance(record, dict) or "sha256" not in record:
        raise RecordError("%s is not an rtfleet original-state record; nothing was changed." % path)
    body = {k: v for k, v in record.items() if k != "sha256"}
    if body.get("schema") != SCHEMA:
        raise RecordError(
            "%s has schema %r; this release reads schema %d only; nothing was changed."
            % (path, body.get("schema"), SCHEMA)
        )
    if _digest(body) != record["sha256"]:
        raise RecordError(
            "%s does not match its own SHA-256: it was edited or damaged, so it cannot say how"
            " the host was; nothing was changed." % path
        )
    if body.get("machine_id") != machine_id:
        raise RecordError(
            "%s was recorded on machine-id %s, this host is %s (a cloned disk?): it is not this"
            " host's original state; nothing was changed."
            % (path, body.get("machine_id"), machine_id)
        )
    return body


def parse_record(text, machine_id, path):
    try:
        record = json.loads(text)
    except ValueError:
        raise RecordError("%s is not JSON; nothing was changed." % path) from None
    return check_record(record, machine_id, path)


def compare(record, live, rtfleet_packages=(), irqs_managed_by_irqbalance=None):
    """Differences between a host and its original record, one line each (empty: restored).

    Per-IRQ affinity is compared only where the record's irqbalance was not running: the
    balancer moves IRQs by load, so its placement is no fixed state to return to."""
    diffs = []
    for key in ("release", "cmdline", "grub_default"):
        if record["boot"].get(key) != live["boot"].get(key):
            diffs.append(
                "boot %s: %r, originally %r" % (key, live["boot"].get(key), record["boot"].get(key))
            )
    for section in ("sysctls", "governors", "hugepages", "units", "files"):
        was, now = record[section], live[section]
        for key in sorted(set(was) | set(now)):
            if was.get(key) != now.get(key):
                diffs.append(
                    "%s %s: %r, originally %r" % (section, key, now.get(key), was.get(key))
                )
    if record["irqs"]["default_smp_affinity"] != live["irqs"]["default_smp_affinity"]:
        diffs.append(
            "IRQ default affinity: %s, originally %s"
            % (live["irqs"]["default_smp_affinity"], record["irqs"]["default_smp_affinity"])
        )
    if irqs_managed_by_irqbalance is None:
        irqs_managed_by_irqbalance = (
            record["units"].get("irqbalance.service", {}).get("active") == "active"
        )
    if not irqs_managed_by_irqbalance:
        was, now = record["irqs"]["affinity"], live["irqs"]["affinity"]
        for irq in sorted(set(was) & set(now)):
            if was[irq] != now[irq]:
                diffs.append("IRQ %s affinity: %s, originally %s" % (irq, now[irq], was[irq]))
    installed = packages_to_remove(record["packages"], live["packages"], rtfleet_packages)
    if installed:
        diffs.append("packages rtfleet installed are still there: %s" % ", ".join(installed))
    left = sorted(set(live["rtfleet_paths"]) - set(record["rtfleet_paths"]))
    if left:
        diffs.append("rtfleet left on the host: %s" % ", ".join("/" + p for p in left))
    return diffs


def _write(path, value, check, changed, label):
    if not check:
        try:
            with open(path, "w") as fh:
                fh.write(value)
        except OSError as exc:
            return "%s: %s" % (label, exc.strerror)
    changed.append(label)
    return None


def restore_live(root, record, check=False):
    """Put back the live settings rtfleet-host-tune changed: sysctls, governors, hugepages,
    IRQ affinities. -> (changed, skipped), one line each. An IRQ the kernel will not move
    (per-CPU, managed) is skipped, as rtfleet-host-tune skips it."""
    changed, skipped = [], []
    live = read_host(root, record["sysctls"], {}, {})
    for key, value in sorted(record["sysctls"].items()):
        if value is not None and live["sysctls"].get(key) != value:
            path = os.path.join(root, "proc/sys", key.replace(".", "/"))
            err = _write(path, value, check, changed, "sysctl %s -> %s" % (key, value))
            if err:
                skipped.append(err)
    for cpu, gov in sorted(record["governors"].items()):
        if live["governors"].get(cpu) not in (None, gov):
            path = os.path.join(root, "sys/devices/system/cpu", cpu, "cpufreq/scaling_governor")
            err = _write(path, gov, check, changed, "%s governor -> %s" % (cpu, gov))
            if err:
                skipped.append(err)
    for node, pools in sorted(record["hugepages"].items()):
        for size, count in sorted(pools.items()):
            if live["hugepages"].get(node, {}).get(size, count) != count:
                path = "sys/devices/system/node/%s/hugepages/hugepages-%skB/nr_hugepages" % (
                    node,
                    size,
                )
                err = _write(
                    os.path.join(root, path),
                    str(count),
                    check,
                    changed,
                    "%s %s kB hugepages -> %d" % (node, size, count),
                )
                if err:
                    skipped.append(err)
    default = record["irqs"]["default_smp_affinity"]
    if default and live["irqs"]["default_smp_affinity"] != default:
        err = _write(
            os.path.join(root, "proc/irq/default_smp_affinity"),
            default,
            check,
            changed,
            "IRQ default affinity -> %s" % default,
        )
        if err:
            skipped.append(err)
    for key, cpus in sorted(record["irqs"]["affinity"].items()):
        now = live["irqs"]["affinity"].get(key)
        if now is not None and now != cpus:
            irq = live["irqs"]["numbers"][key]
            path = os.path.join(root, "proc/irq", irq, "smp_affinity_list")
            err = _write(path, cpus, check, changed, "IRQ %s -> %s" % (key, cpus))
            if err:
                skipped.append(err)
    return changed, skipped
