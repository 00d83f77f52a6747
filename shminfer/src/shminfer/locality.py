"""Which unit a sampler should use: the one nearest to the CPUs it runs on.

A host runs one shminfer unit per L3 group (CCX) the plan gave the runtime. A sampler (a
pod's process, a Ray actor) should talk to a unit on its own NUMA node, where the request
and response slots sit in local memory, and best one in its own L3 group. The rules, in
order:

1. units whose worker CPUs share an L3 group with the caller's CPUs, on its NUMA node;
2. units on the caller's NUMA node;
3. none there: units on the nearest node by ``/sys/devices/system/node/nodeN/distance``
   (then the same package, then the lowest node id; nodes at the same distance share),
   with a warning: every request then crosses the interconnect.

A unit's node is the node of its worker CPUs (on a memoryless node its memory lives on
another node; the CPUs decide where the caller's cache lines travel). The caller's node
is the one holding most of its allowed CPUs (``sched_getaffinity``). Ties between equally
good units are spread by the caller's first CPU, so the samplers of one node share its
units instead of all picking the first.
"""

from __future__ import annotations

import fnmatch
import logging
import os
import socket
from dataclasses import dataclass, field

from shminfer.queue import QueueError

log = logging.getLogger("shminfer")

SAME_L3 = "same L3 group"
SAME_NODE = "same NUMA node"
NEAREST = "nearest NUMA node"


@dataclass(frozen=True)
class Choice:
    """The unit chosen for a caller, and why."""

    name: str
    rule: str  # SAME_L3, SAME_NODE or NEAREST
    reason: str  # one line a person reads
    caller_cpus: list
    caller_node: int
    unit_node: int
    distance: int | None
    units: list = field(default_factory=list)  # every unit seen: name, cpus, node, l3_groups

    @property
    def local(self) -> bool:
        return self.rule != NEAREST

    def as_dict(self) -> dict:
        return {
            "unit": self.name,
            "rule": self.rule,
            "reason": self.reason,
            "local": self.local,
            "caller_cpus": self.caller_cpus,
            "caller_node": self.caller_node,
            "unit_node": self.unit_node,
            "distance": self.distance,
            "units": self.units,
        }


def _cpulist(cpus) -> str:
    from shminfer.cpulist import format_cpulist  # noqa: PLC0415

    return format_cpulist(cpus)


def _node_of_cpus(cpus, node_of):
    """The node holding most of ``cpus`` (lowest id on a tie); None when none is known."""
    counts = {}
    for cpu in cpus:
        if cpu in node_of:
            counts[node_of[cpu]] = counts.get(node_of[cpu], 0) + 1
    if not counts:
        return None
    return min(counts, key=lambda node: (-counts[node], node))


def choose_unit(units, caller_cpus, topology) -> Choice:
    """The unit for a caller allowed on ``caller_cpus``.

    ``units``: ``[{"name", "cpus"}]`` (the worker CPUs of each running unit, as its
    registry lists them); ``topology``: rtfleet's topology record of this host.
    """
    from shminfer.topology import nearest_nodes  # noqa: PLC0415

    caller = sorted(set(caller_cpus))
    if not caller:
        raise QueueError("the caller has no CPUs to choose a unit for")
    node_of = {cpu: n["id"] for n in topology["numa_nodes"] for cpu in n["cpus"]}
    l3_of = {cpu: g["id"] for g in topology["l3_groups"] for cpu in g["cpus"]}
    seen = []
    for unit in sorted(units, key=lambda u: u["name"]):
        node = _node_of_cpus(unit["cpus"], node_of)
        if node is None:
            continue  # its CPUs are not this host's: a unit of another machine's tree
        groups = sorted({l3_of[c] for c in unit["cpus"] if c in l3_of})
        cpus = _cpulist(unit["cpus"])
        seen.append({"name": unit["name"], "cpus": cpus, "node": node, "l3_groups": groups})
    if not seen:
        raise QueueError(
            "no running shminfer unit of this host's CPUs to choose from (units of "
            "another machine?)"
        )
    caller_node = _node_of_cpus(caller, node_of)
    if caller_node is None:
        raise QueueError(f"CPUs {_cpulist(caller)} are not in this host's topology")
    caller_l3 = {l3_of[c] for c in caller if c in l3_of}
    spread = caller[0]

    def pick(candidates):
        return candidates[spread % len(candidates)]

    on_node = [u for u in seen if u["node"] == caller_node]
    same_l3 = [u for u in on_node if caller_l3 & set(u["l3_groups"])]
    where = f"CPUs {_cpulist(caller)}"
    if on_node:
        rule = SAME_L3 if same_l3 else SAME_NODE
        unit = pick(same_l3 or on_node)
        distance = _self_distance(topology, caller_node)
        if same_l3:
            shared = _cpulist(sorted(caller_l3 & set(unit["l3_groups"])))
            reason = f"{where} share L3 group {shared} and NUMA node {caller_node} with unit"
        else:
            reason = f"{where} are on NUMA node {caller_node}, like unit"
        reason += f" {unit['name']} (CPUs {unit['cpus']})"
    else:
        rule = NEAREST
        ranked = nearest_nodes(topology, caller_node, sorted({u["node"] for u in seen}))
        best, distance = ranked[0]
        # Nodes at the same distance are equally near: their units share the callers.
        nearest = {n for n, d in ranked if d == distance} if distance is not None else {best}
        unit = pick([u for u in seen if u["node"] in nearest])
        reason = (
            f"no unit on NUMA node {caller_node} ({where}); the nearest is unit "
            f"{unit['name']} on node {unit['node']}"
            + (f" at distance {distance}" if distance is not None else " (no distance table)")
            + ": every request crosses the interconnect"
        )
    return Choice(
        name=unit["name"],
        rule=rule,
        reason=reason,
        caller_cpus=caller,
        caller_node=caller_node,
        unit_node=unit["node"],
        distance=distance,
        units=seen,
    )


def _self_distance(topology, node_id):
    for node in topology["numa_nodes"]:
        if node["id"] == node_id:
            return dict(node["distances"]).get(node_id)
    return None


def running_units(match: str = "*", trusted=None, skipped=None) -> list:
    """``[{"name", "cpus"}]`` of every live server on this host whose name matches the
    glob ``match`` (a host serving two models: ``policy-*``) and whose registry this
    process may read and trust; the others are skipped (a debug log line says why, and
    ``skipped``, a list, gets ``(name, reason)``)."""
    from shminfer.registry import (  # noqa: PLC0415
        alive,
        check_unit_dir,
        list_names,
        read_registry,
        registry_path,
    )

    units = []
    for name in fnmatch.filter(list_names(), match):
        try:
            check_unit_dir(name, trusted)
            if not os.path.lexists(registry_path(name)):
                continue  # the directory of a server that stopped
            data = read_registry(name, trusted)
        except QueueError as exc:
            log.debug("unit %s skipped: %s", name, exc)
            if skipped is not None:
                skipped.append((name, str(exc)))
            continue
        if alive(data) or _accepts(name):
            units.append({"name": name, "cpus": [w["cpu"] for w in data["workers"]]})
    return units


def _accepts(name) -> bool:
    """Does the server's socket take a connection? How a process in another pid namespace
    (a pod: the registry's pid is not in its /proc) tells a live unit from a dead one."""
    from shminfer.registry import socket_path  # noqa: PLC0415

    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(socket_path(name))
    except OSError:
        return False
    finally:
        probe.close()
    return True


def none_running(match: str, skipped) -> str:
    """Why a caller found no unit, in one line that says what to fix: the runtime directory
    is not there (not deployed, or a container without the mount), every unit refused
    this process (not in the group: the first unit's reason), or none runs."""
    from shminfer.registry import missing_dir, run_dir  # noqa: PLC0415

    base = run_dir()
    if not os.path.isdir(base):
        return missing_dir(base)
    if skipped:
        _name, reason = skipped[0]
        return f"no usable shminfer unit matching {match!r}: {reason}"
    return f"no running shminfer unit matching {match!r} in {base} (is the runtime deployed?)"


def where(cpus=None, *, match: str = "*", root: str = "/") -> Choice:
    """The running unit (name matching ``match``) nearest to ``cpus`` (default: the CPUs
    this process may run on), read from this host's registries and ``root``'s sysfs."""
    from shminfer.topology import read_topology  # noqa: PLC0415

    caller = sorted(cpus if cpus is not None else os.sched_getaffinity(0))
    skipped = []
    units = running_units(match, skipped=skipped)
    if not units:
        raise QueueError(none_running(match, skipped))
    choice = choose_unit(units, caller, read_topology(root))
    if not choice.local:
        log.warning("shminfer: %s", choice.reason)
    return choice
