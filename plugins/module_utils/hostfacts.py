"""Reading a Linux root's files, and the host facts that are read straight from them.

:class:`Reader` reads the files under a root directory that holds ``sys/`` and ``proc/``
like a real root, safely (no FIFO hangs, bounded sizes) and with every error naming the
file. The facts beside the CPU layout are here: the kernel and its command line, the CPU
isolation in effect, SMT, frequency and idle states, the CPU model from cpuinfo,
virtualization and the topology-deception verdict. topology.py reads the layout (CPUs,
cores, caches, NUMA nodes) with the same reader and joins both in ``read_topology``.

Stdlib-only and Python >= 3.9: it ships wherever topology.py does (symlinks to this file).
"""

from __future__ import annotations

import os
import re
import stat

from .cpulist import NUMBER, TopologyError, clean, parse_cpulist, parse_cpumask, shown

# What is read from any one sysfs/procfs file; a real file of interest is far smaller.
MAX_READ_BYTES = 1 << 20
_INTEGER = re.compile(r"^-?[0-9]{1,19}$")

CPU_DIR = "sys/devices/system/cpu"


class Reader:
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
        return clean(data.decode("utf-8", "replace"))

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
            raise TopologyError(self.path(rel), f"expected an integer, got {shown(text)}")
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

    def numbered(self, rel, prefix):
        """{N: name} for the entries of directory ``rel`` named prefixN (cpu12, node3)."""
        found = {}
        for name in self.listdir(rel):
            if name.startswith(prefix) and NUMBER.match(name[len(prefix) :]):
                found[int(name[len(prefix) :])] = name
        return found


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


def read_cpu_model(reader):
    """(cpuinfo blocks, arch, vendor, model name) from /proc/cpuinfo's first blocks."""
    # Only the first two blocks are used; a 1024-CPU cpuinfo is megabytes.
    cpuinfo_text = reader.read_opt("proc/cpuinfo", limit=1 << 18, truncate=True) or ""
    cpuinfo_blocks, arch = _parse_cpuinfo(cpuinfo_text)
    first = cpuinfo_blocks[0] if cpuinfo_blocks else {}
    vendor = first.get("vendor_id") or _arm_vendor(first.get("cpu implementer")) or None
    model_name = first.get("model name") or first.get("cpu") or None
    return cpuinfo_blocks, arch, vendor, model_name


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


def read_kernel(reader):
    """Release, PREEMPT model, real-time or not and the command line, split."""
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


def read_isolation(reader, kernel, online):
    """The CPU isolation in effect: isolated, nohz_full, rcu_nocbs and isolcpus flags."""
    isolated_rel = CPU_DIR + "/isolated"
    nohz_rel = CPU_DIR + "/nohz_full"
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


def read_smt(reader, cores):
    """SMT control and state, and the most threads any core has."""
    control = reader.read(CPU_DIR + "/smt/control", default="")
    active = reader.read(CPU_DIR + "/smt/active", default="")
    threads = max((len(core["cpus"]) for core in cores), default=1)
    return {
        "control": control or None,
        "active": (active == "1") if active else threads > 1,
        "threads_per_core": threads,
    }


def read_power(reader, online):
    """Frequency driver/governor, boost and idle states, as the first online CPU sees them."""
    first = online[0]
    base = "%s/cpu%d/" % (CPU_DIR, first)
    boost = None
    text = reader.read_opt(CPU_DIR + "/cpufreq/boost")
    if text in ("0", "1"):
        boost = text == "1"
    no_turbo = reader.read_opt(CPU_DIR + "/intel_pstate/no_turbo")
    if no_turbo in ("0", "1"):
        boost = no_turbo == "0"
    states = []
    for _index, name in sorted(reader.numbered(base + "cpuidle", "state").items()):
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
        "amd_pstate": reader.read_opt(CPU_DIR + "/amd_pstate/status"),
        "boost": boost,
        "idle_driver": reader.read_opt(CPU_DIR + "/cpuidle/current_driver"),
        "idle_states": states,
    }


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


def read_virtualization(reader, cpuinfo_blocks, arch):
    """Hypervisor or bare metal, from cpuinfo flags, /sys/hypervisor and DMI."""
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


def deception_verdict(virt, cpus, packages, nodes, l3_groups, *, l3_source):
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
