"""Lab topologies: lab/topologies/<name>.yml, validated and rendered into QEMU arguments."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import yaml

from rtfleet.cpulist import parse_cpulist
from rtfleet.lab_state import LabError

# --------------------------------------------------------------------------- topologies


def _runs(cpus: list[int]) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    for cpu in cpus:
        if runs and cpu == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], cpu)
        else:
            runs.append((cpu, cpu))
    return runs


@dataclasses.dataclass(frozen=True)
class Topology:
    name: str
    description: str
    cpu_model: str
    cpu_flags: tuple[str, ...]
    sockets: int
    dies: int
    cores: int
    threads: int
    memory_mib: int
    numa: tuple[tuple[tuple[int, ...], int], ...]  # (cpus, memory_mib) per node
    smbios: tuple[dict[str, Any], ...]
    expect: dict[str, Any]

    @property
    def cpus(self) -> int:
        return self.sockets * self.dies * self.cores * self.threads


def topologies_dir(repo_root: Path) -> Path:
    return repo_root / "lab" / "topologies"


def available_topologies(repo_root: Path) -> list[str]:
    return sorted(p.stem for p in topologies_dir(repo_root).glob("*.yml"))


def load_topology(repo_root: Path, name: str) -> Topology:
    path = topologies_dir(repo_root) / f"{name}.yml"
    if not path.is_file():
        known = ", ".join(available_topologies(repo_root))
        raise LabError(f"unknown topology {name!r}; known: {known}")
    with open(path) as stream:
        data = yaml.safe_load(stream)
    return topology_from_dict(data, source=str(path))


def topology_from_dict(data: dict[str, Any], source: str = "<topology>") -> Topology:
    """Validate a topology document; errors name the file and the key."""

    def need(key: str, kind: type) -> Any:
        value = data.get(key)
        if not isinstance(value, kind):
            raise LabError(f"{source}: {key!r} must be a {kind.__name__}")
        return value

    cpu = need("cpu", dict)
    smp = need("smp", dict)
    sockets, dies, cores, threads = (
        int(smp.get(k, 1)) for k in ("sockets", "dies", "cores", "threads")
    )
    memory_mib = int(need("memory_mib", int))
    ncpus = sockets * dies * cores * threads
    nodes = []
    seen: set[int] = set()
    for index, node in enumerate(data.get("numa") or []):
        cpus = tuple(parse_cpulist(str(node["cpus"])))
        if seen & set(cpus) or (cpus and cpus[-1] >= ncpus):
            raise LabError(
                f"{source}: numa[{index}].cpus {node['cpus']!r} overlaps or exceeds {ncpus} cpus"
            )
        seen.update(cpus)
        nodes.append((cpus, int(node["memory_mib"])))
    if nodes and seen != set(range(ncpus)):
        raise LabError(f"{source}: numa nodes must cover cpus 0-{ncpus - 1} exactly")
    if nodes and sum(mem for _, mem in nodes) != memory_mib:
        raise LabError(f"{source}: numa memory_mib must add up to memory_mib ({memory_mib})")
    cpu_flags = tuple(str(f) for f in cpu.get("flags") or [])
    if (
        dies > 1
        and "vendor=GenuineIntel" in cpu_flags
        and ("full-cpuid-auto-level=off" not in cpu_flags)
    ):
        # QEMU 10 exposes CPUID leaf 0x1f for this and aborts as the guest boots.
        raise LabError(
            f"{source}: an Intel vendor with dies > 1 needs 'full-cpuid-auto-level=off' in "
            "cpu.flags (QEMU 10 aborts on CPUID leaf 0x1f otherwise; see lab/README.md)"
        )
    smbios = tuple(dict(entry) for entry in data.get("smbios") or [])
    for entry in smbios:
        if "type" not in entry:
            raise LabError(f"{source}: every smbios entry needs a type")
    return Topology(
        name=need("name", str),
        description=str(data.get("description", "")).strip(),
        cpu_model=str(cpu["model"]),
        cpu_flags=cpu_flags,
        sockets=sockets,
        dies=dies,
        cores=cores,
        threads=threads,
        memory_mib=memory_mib,
        numa=tuple(nodes),
        smbios=smbios,
        expect=dict(data.get("expect") or {}),
    )


def _qemu_opt(value: object) -> str:
    # QEMU option values escape a literal comma by doubling it.
    return str(value).replace(",", ",,")


def topology_argv(topo: Topology) -> list[str]:
    """The QEMU arguments that give a guest this topology."""
    argv = ["-cpu", ",".join([topo.cpu_model, *topo.cpu_flags])]
    smp = (
        f"{topo.cpus},sockets={topo.sockets},dies={topo.dies},"
        f"cores={topo.cores},threads={topo.threads}"
    )
    argv += ["-smp", smp, "-m", f"{topo.memory_mib}M"]
    for nodeid, (cpus, memory_mib) in enumerate(topo.numa):
        argv += ["-object", f"memory-backend-ram,id=m{nodeid},size={memory_mib}M"]
        cpu_opts = ",".join(
            f"cpus={lo}" if lo == hi else f"cpus={lo}-{hi}" for lo, hi in _runs(list(cpus))
        )
        argv += ["-numa", f"node,nodeid={nodeid},{cpu_opts},memdev=m{nodeid}"]
    for entry in topo.smbios:
        fields = [f"type={entry['type']}"]
        fields += [f"{key}={_qemu_opt(value)}" for key, value in entry.items() if key != "type"]
        argv += ["-smbios", ",".join(fields)]
    return argv
