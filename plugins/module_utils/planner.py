"""The CPU partition planner: one topology + one small policy -> one partition.

Every CPU set that any layer of rtfleet uses (kernel command line, irqbalance, kubelet,
systemd units, tuned) is derived here from the same three sets, so no two layers can
disagree:

* housekeeping -- OS, kubelet, IRQs and kernel threads; whole cores on every NUMA node;
* runtime groups -- one per L3 group (AMD CCX) for the pinned shminfer units, never
  spanning two L3 groups, two NUMA nodes or two packages;
* pod pool -- what kubelet may hand to Guaranteed pods.

It runs on the controller (the CLI and the ``rtfleet_plan`` Ansible filter) and takes the
plain dict that :func:`rtfleet.topology.read_topology` returns, so it never touches a host.
"""

from __future__ import annotations

import copy

from .cpulist import TopologyError, format_cpulist, parse_cpulist
from .plan_record import SCHEMA_VERSION as PLAN_SCHEMA_VERSION
from .plan_record import expand as expand_plan


DEFAULT_POLICY = {
    # Whole cores of housekeeping on every NUMA node (ignored when housekeeping_cpus is set).
    "housekeeping_cores_per_node": 1,
    # Explicit housekeeping cpulist ("0-1,64-65"); must be whole cores on every NUMA node.
    "housekeeping_cpus": None,
    # Which L3 groups host runtime units: "all" (all but housekeeping), "none", a count,
    # or a list of L3 group ids as the topology numbers them.
    "runtime_l3_groups": "all",
    # What to do with the rest of an L3 group that housekeeping takes cores from:
    # "runtime" keeps it as a smaller runtime group, "pod_pool" gives it to pods.
    "partial_l3_groups": "runtime",
    # Smallest runtime group worth a unit, in cores.
    "runtime_min_cores": 1,
    # SMT: "allow", or "require_off" to refuse hosts with SMT siblings.
    "smt": "allow",
    # Runtime workers on "all_threads" or "one_thread_per_core" (siblings stay reserved
    # and idle so a worker never shares L1/L2 with anything).
    "runtime_threads": "all_threads",
    # Which sets are isolated from the scheduler tick, RCU callbacks and managed IRQs.
    "isolate": ["runtime", "pod_pool"],
    # isolcpus flags; "domain" removes CPUs from load balancing: add it only when asked.
    "isolcpus_flags": ["managed_irq"],
    # Plan for a VM whose topology is deceptive (VMware 88 sockets x 1 core); never on
    # production nodes: the pinning would be meaningless.
    "allow_deceptive_topology": False,
    "group_name_prefix": "ccx",
}

_POLICY_CHOICES = {
    "partial_l3_groups": ("runtime", "pod_pool"),
    "smt": ("allow", "require_off"),
    "runtime_threads": ("all_threads", "one_thread_per_core"),
}
_ISOLATE_CHOICES = ("runtime", "pod_pool")
_ISOLCPUS_FLAGS = ("managed_irq", "domain", "nohz")


class PlanError(Exception):
    """The policy cannot be satisfied on this topology; the message says what to change."""


# ------------------------------------------------------------------ cpulist edges


def _parse_cpulist(text, what):
    if isinstance(text, (list, tuple)):
        try:
            return sorted({int(c) for c in text})
        except (TypeError, ValueError):
            raise PlanError(f"{what}: expected CPU ids, got {text!r}") from None
    try:
        return parse_cpulist(str(text), what)
    except TopologyError:
        raise PlanError(f'{what}: {text!r} is not a cpulist (write it like "0-1,64-65")') from None


# ------------------------------------------------------------------ policy


def normalize_policy(policy=None):
    """Merge ``policy`` over the defaults and validate every field."""
    merged = copy.deepcopy(DEFAULT_POLICY)
    for key, value in (policy or {}).items():
        if key not in DEFAULT_POLICY:
            raise PlanError(
                "unknown policy key {!r}; known keys: {}".format(
                    key, ", ".join(sorted(DEFAULT_POLICY))
                )
            )
        merged[key] = value
    count = merged["housekeeping_cores_per_node"]
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise PlanError(
            "housekeeping_cores_per_node must be an integer >= 1 (every NUMA node needs a "
            f"housekeeping core for its IRQs and kernel threads), got {count!r}"
        )
    if merged["housekeeping_cpus"] not in (None, "", []):
        merged["housekeeping_cpus"] = _parse_cpulist(
            merged["housekeeping_cpus"], "policy housekeeping_cpus"
        )
    else:
        merged["housekeeping_cpus"] = None
    runtime = merged["runtime_l3_groups"]
    if isinstance(runtime, str):
        if runtime not in ("all", "none"):
            raise PlanError(
                'runtime_l3_groups must be "all", "none", a count or a list of L3 group ids, '
                f"got {runtime!r}"
            )
    elif isinstance(runtime, bool) or not isinstance(runtime, (int, list, tuple)):
        raise PlanError('runtime_l3_groups must be "all", "none", a count or a list of ids')
    elif isinstance(runtime, int) and runtime < 0:
        raise PlanError("runtime_l3_groups count must be >= 0, got %d" % runtime)
    elif isinstance(runtime, (list, tuple)):
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in runtime):
            raise PlanError(
                f"runtime_l3_groups list must hold L3 group ids (ints), got {runtime!r}"
            )
        merged["runtime_l3_groups"] = sorted(set(runtime))
    minimum = merged["runtime_min_cores"]
    if isinstance(minimum, bool) or not isinstance(minimum, int) or minimum < 1:
        raise PlanError(f"runtime_min_cores must be an integer >= 1, got {minimum!r}")
    for key, choices in _POLICY_CHOICES.items():
        if merged[key] not in choices:
            raise PlanError(
                "{} must be one of {}, got {!r}".format(key, ", ".join(choices), merged[key])
            )
    isolate = merged["isolate"]
    if isinstance(isolate, str) or not all(i in _ISOLATE_CHOICES for i in isolate):
        raise PlanError(
            "isolate must be a list drawn from {}, got {!r}".format(
                ", ".join(_ISOLATE_CHOICES), isolate
            )
        )
    merged["isolate"] = [i for i in _ISOLATE_CHOICES if i in isolate]
    flags = merged["isolcpus_flags"]
    if isinstance(flags, str) or not all(f in _ISOLCPUS_FLAGS for f in flags):
        raise PlanError(
            "isolcpus_flags must be a list drawn from {}, got {!r}".format(
                ", ".join(_ISOLCPUS_FLAGS), flags
            )
        )
    if not isinstance(merged["allow_deceptive_topology"], bool):
        raise PlanError("allow_deceptive_topology must be true or false")
    prefix = merged["group_name_prefix"]
    if not isinstance(prefix, str) or not prefix.isalnum():
        raise PlanError(
            f"group_name_prefix must be letters/digits (it names systemd units), got {prefix!r}"
        )
    return merged


# ------------------------------------------------------------------ planning


def _check_topology(topology):
    for key in ("cpus", "numa_nodes", "l3_groups", "cores"):
        if key not in topology:
            raise PlanError(
                f"topology has no {key!r}: pass the output of `rtfleet topology` "
                "or the cpu_topology module"
            )


def _choose_housekeeping(topology, policy, core_of):
    online = set(topology["cpus"])
    nodes = [n for n in topology["numa_nodes"] if n["cpus"]]
    explicit = policy["housekeeping_cpus"]
    if explicit is not None:
        unknown = sorted(set(explicit) - online)
        if unknown:
            raise PlanError(
                f"housekeeping_cpus names CPUs {format_cpulist(unknown)} that are not online on "
                f"this host (online: {format_cpulist(online)})"
            )
        for cpu in explicit:
            siblings = core_of[cpu]
            if not set(siblings) <= set(explicit):
                raise PlanError(
                    "housekeeping_cpus splits the SMT core %s: add %s or remove %d "
                    "(siblings share L1/L2 and must stay in one set)"
                    % (format_cpulist(siblings), format_cpulist(set(siblings) - set(explicit)), cpu)
                )
        for node in nodes:
            if not set(node["cpus"]) & set(explicit):
                raise PlanError(
                    "housekeeping_cpus has no CPU on NUMA node %d (CPUs %s): every node needs "
                    "housekeeping for its IRQs and kernel threads"
                    % (node["id"], format_cpulist(node["cpus"]))
                )
        return sorted(explicit)

    wanted = policy["housekeeping_cores_per_node"]
    l3_of = {c: g["id"] for g in topology["l3_groups"] for c in g["cpus"]}
    housekeeping = []
    for node in nodes:
        node_cores = []
        seen = set()
        # Take cores from the node's first L3 group, so the other groups stay whole.
        for cpu in sorted(node["cpus"], key=lambda c: (l3_of.get(c, -1), c)):
            core = tuple(core_of[cpu])
            if core not in seen:
                seen.add(core)
                node_cores.append(core)
        if len(node_cores) < wanted:
            raise PlanError(
                "NUMA node %d has only %d cores; housekeeping_cores_per_node=%d cannot be met: "
                "lower housekeeping_cores_per_node or list housekeeping_cpus explicitly"
                % (node["id"], len(node_cores), wanted)
            )
        for core in node_cores[:wanted]:
            housekeeping.extend(core)
    if set(housekeeping) == online:
        raise PlanError(
            "housekeeping_cores_per_node=%d takes every CPU of this host, leaving nothing for "
            "the runtime or pods: lower housekeeping_cores_per_node" % wanted
        )
    return sorted(housekeeping)


def _placement_units(topology, housekeeping, core_of, policy):
    """L3 group x NUMA node x package pieces outside housekeeping, whole cores only."""
    node_of = {c: n["id"] for n in topology["numa_nodes"] for c in n["cpus"]}
    package_of = {c: p["id"] for p in topology["packages"] for c in p["cpus"]}
    hk = set(housekeeping)
    units = []
    for group in topology["l3_groups"]:
        pieces = {}
        for cpu in group["cpus"]:
            pieces.setdefault((node_of[cpu], package_of[cpu]), []).append(cpu)
        split = len(pieces) > 1
        for (node, package), cpus in sorted(pieces.items()):
            free = [c for c in cpus if c not in hk]
            # A core whose siblings straddle the piece boundary cannot be placed whole.
            free = [c for c in free if set(core_of[c]) <= set(free)]
            if not free:
                continue
            cores = []
            for cpu in free:
                core = core_of[cpu]
                if core not in cores:
                    cores.append(core)
            name = "%s%d" % (policy["group_name_prefix"], group["id"])
            if split:
                name += "n%d" % node
            units.append(
                {
                    "name": name,
                    "l3_group": group["id"],
                    "numa_node": node,
                    "package": package,
                    "cpus": sorted(free),
                    "cores": [list(c) for c in cores],
                    "partial": len(free) < len(cpus),
                }
            )
    return units


def plan_partition(topology, policy=None):
    """Compute the partition and everything derived from it. Raises PlanError.

    The steps: check the host can be planned, choose housekeeping and the runtime groups'
    L3 pieces, build the groups, then derive every view (cpulists, kernel arguments,
    kubelet, irqbalance, tuned, per node) from the three sets.
    """
    _check_topology(topology)
    policy = normalize_policy(policy)
    online = sorted(topology["cpus"])
    core_of = _plannable_cores(topology, policy, online)
    housekeeping = _choose_housekeeping(topology, policy, core_of)
    units = _placement_units(topology, housekeeping, core_of, policy)
    runtime_units = _choose_runtime_units(topology, policy, units)
    warnings = _runtime_warnings(topology, runtime_units)
    runtime = sorted(c for u in runtime_units for c in u["cpus"])
    pod_pool = sorted(set(online) - set(housekeeping) - set(runtime))
    runtime_groups = _runtime_groups(runtime_units, policy, _memory_nodes(topology))
    _place_samplers(topology, runtime_groups, housekeeping, pod_pool)
    sets = {
        "online": online,
        "housekeeping": housekeeping,
        "runtime": runtime,
        "pod_pool": pod_pool,
    }
    plan = _plan_record(topology, policy, sets, runtime_groups, warnings)
    check_invariants(topology, plan)
    return plan


def _plannable_cores(topology, policy, online):
    """{cpu: its core's CPUs}, after refusing a deceptive VM, cores that miss online CPUs
    and SMT when the policy requires it off."""
    deception = topology.get("virtualization", {}).get("deception", {})
    if deception.get("deceptive") and not policy["allow_deceptive_topology"]:
        raise PlanError(
            "refusing to plan: this VM hides its real CPU topology, so L3/NUMA pinning would "
            "be meaningless. Evidence: %s. Move the node to bare metal (docs/migration.md) or, "
            "for a lab only, set allow_deceptive_topology: true"
            % ("; ".join(deception.get("evidence", [])) or "n/a")
        )
    core_of = {}
    for core in topology["cores"]:
        for cpu in core["cpus"]:
            core_of[cpu] = tuple(sorted(core["cpus"]))
    if set(core_of) != set(online):
        raise PlanError("topology cores do not cover the online CPUs: re-read the topology")
    smt_cores = [c for c in set(core_of.values()) if len(c) > 1]
    if policy["smt"] == "require_off" and smt_cores:
        raise PlanError(
            "policy smt=require_off but %d cores have SMT siblings (e.g. %s): disable SMT in "
            "the BIOS or with nosmt, or set smt: allow"
            % (len(smt_cores), format_cpulist(smt_cores[0]))
        )
    return core_of


def _choose_runtime_units(topology, policy, units):
    """The placement units that become runtime groups, as runtime_l3_groups selects them."""
    selector = policy["runtime_l3_groups"]
    eligible = [
        u
        for u in units
        if len(u["cores"]) >= policy["runtime_min_cores"]
        and not (u["partial"] and policy["partial_l3_groups"] == "pod_pool")
    ]
    if selector == "all":
        return eligible
    if selector == "none":
        return []
    if isinstance(selector, int):
        if selector > len(eligible):
            raise PlanError(
                "runtime_l3_groups=%d but only %d L3 groups are eligible (%s): lower the count, "
                "lower housekeeping_cores_per_node or runtime_min_cores"
                % (selector, len(eligible), ", ".join(u["name"] for u in eligible) or "none")
            )
        # Spread across NUMA nodes first: round-robin by position within each node.
        rank = {}
        per_node = {}
        for unit in eligible:
            position = per_node.get(unit["numa_node"], 0)
            per_node[unit["numa_node"]] = position + 1
            rank[unit["name"]] = (position, unit["numa_node"])
        chosen = sorted(eligible, key=lambda u: rank[u["name"]])[:selector]
        chosen.sort(key=lambda u: u["cpus"][0])
        return chosen
    known = {g["id"] for g in topology["l3_groups"]}
    unknown = sorted(set(selector) - known)
    if unknown:
        raise PlanError(
            f"runtime_l3_groups names L3 groups {unknown} that do not exist "
            f"(this host has {format_cpulist(known)})"
        )
    chosen = [u for u in eligible if u["l3_group"] in selector]
    missing = sorted(set(selector) - {u["l3_group"] for u in chosen})
    if missing:
        raise PlanError(
            f"L3 groups {missing} are wholly housekeeping or below runtime_min_cores: "
            "pick other groups or change housekeeping"
        )
    return chosen


def _runtime_warnings(topology, runtime_units):
    """What the plan should tell: memoryless nodes it binds away from, partial CCXs."""
    warnings = []
    memoryless = sorted(
        {u["numa_node"] for u in runtime_units} & set(topology.get("memoryless_nodes") or [])
    )
    for node in memoryless:
        warnings.append(
            "NUMA node %d has CPUs but no memory (no DIMMs on its socket?): its runtime groups "
            "bind memory to node %d, one hop away" % (node, memory_node_of_topology(topology, node))
        )
    for unit in runtime_units:
        if unit["partial"]:
            warnings.append(
                "{} shares its L3 with housekeeping CPUs; set partial_l3_groups: pod_pool "
                "to keep runtime groups on whole CCXs".format(unit["name"])
            )
    return warnings


def _memory_nodes(topology):
    """{node: the node its memory comes from}. Memory for CPUs of a memoryless node (a
    socket without DIMMs) comes from the nearest node with memory; binding to the CPU's own
    node would leave nothing to allocate."""
    memory_node_of = {}
    for node in topology["numa_nodes"]:
        target = node.get("memory_node", node["id"])
        memory_node_of[node["id"]] = node["id"] if target is None else target
    return memory_node_of


def _runtime_groups(runtime_units, policy, memory_node_of):
    """One runtime group per chosen unit: its CPUs, workers and memory node (its cpulist and
    systemd settings are plan_record.expand's)."""
    runtime_groups = []
    for unit in runtime_units:
        if policy["runtime_threads"] == "one_thread_per_core":
            worker_cpus = sorted(core[0] for core in unit["cores"])
        else:
            worker_cpus = list(unit["cpus"])
        runtime_groups.append(
            {
                "name": unit["name"],
                "cpus": unit["cpus"],
                "worker_cpus": worker_cpus,
                "numa_node": unit["numa_node"],
                "memory_node": memory_node_of[unit["numa_node"]],
                "l3_group": unit["l3_group"],
                "package": unit["package"],
                "partial_l3": unit["partial"],
            }
        )
    return runtime_groups


def _place_samplers(topology, runtime_groups, housekeeping, pod_pool):
    """Where a sampler (a pod, the post-check's smoke client) of each unit should run: the
    pod pool of the unit's NUMA node, else of its package, else the node's housekeeping."""
    node_cpus = {n["id"]: set(n["cpus"]) for n in topology["numa_nodes"]}
    package_cpus = {p["id"]: set(p["cpus"]) for p in topology["packages"]}
    for group in runtime_groups:
        for where, near in (
            ("pod_pool_same_node", node_cpus[group["numa_node"]] & set(pod_pool)),
            ("pod_pool_same_package", package_cpus[group["package"]] & set(pod_pool)),
            ("housekeeping_same_node", node_cpus[group["numa_node"]] & set(housekeeping)),
        ):
            if near:
                group["sampler_cpus"] = sorted(near)
                group["sampler_cpus_from"] = where
                break


def _plan_record(topology, policy, sets, runtime_groups, warnings):
    """The plan: the record (each set once: ``sets`` online, housekeeping, runtime, pod_pool;
    the groups; each NUMA node's CPUs) and every view the layers read, which
    plan_record.expand derives from it as it does for every reader of the record."""
    memory_node_of = _memory_nodes(topology)
    record = {
        "schema": PLAN_SCHEMA_VERSION,
        "policy": policy,
        **{key: sets[key] for key in ("online", "housekeeping", "runtime", "pod_pool")},
        "runtime_groups": runtime_groups,
        "numa_nodes": [
            {"id": node["id"], "memory_node": memory_node_of[node["id"]], "cpus": node["cpus"]}
            for node in topology["numa_nodes"]
            if node["cpus"]
        ],
        "warnings": warnings,
    }
    return expand_plan(record)


def memory_node_of_topology(topology, node_id):
    """The node whose memory serves ``node_id``'s CPUs (itself unless it is memoryless)."""
    for node in topology["numa_nodes"]:
        if node["id"] == node_id:
            target = node.get("memory_node", node_id)
            return node_id if target is None else target
    return node_id


def check_invariants(topology, plan):
    """Raise PlanError when a plan breaks a partition invariant (also used by tests)."""
    online = set(topology["cpus"])
    hk, rt, pp = set(plan["housekeeping"]), set(plan["runtime"]), set(plan["pod_pool"])
    if hk & rt or hk & pp or rt & pp:
        raise PlanError("invariant: housekeeping, runtime and pod pool overlap")
    if hk | rt | pp != online:
        raise PlanError("invariant: the sets do not cover all online CPUs")
    for core in topology["cores"]:
        cpus = set(core["cpus"])
        if not (cpus <= hk or cpus <= rt or cpus <= pp):
            raise PlanError(f"invariant: SMT core {format_cpulist(cpus)} is split")
    node_of = {c: n["id"] for n in topology["numa_nodes"] for c in n["cpus"]}
    l3_of = {c: g["id"] for g in topology["l3_groups"] for c in g["cpus"]}
    seen = set()
    for group in plan["runtime_groups"]:
        cpus = set(group["cpus"])
        if len({l3_of[c] for c in cpus}) != 1 or len({node_of[c] for c in cpus}) != 1:
            raise PlanError(
                "invariant: runtime group {} spans L3 groups or NUMA nodes".format(group["name"])
            )
        if cpus & seen:
            raise PlanError("invariant: runtime groups overlap")
        seen |= cpus
        if not set(group["worker_cpus"]) <= cpus:
            raise PlanError("invariant: {} workers outside the group".format(group["name"]))
    if seen != rt:
        raise PlanError("invariant: runtime groups do not add up to the runtime set")
    with_memory = {n["id"] for n in topology["numa_nodes"] if n.get("has_memory", True)}
    for group in plan["runtime_groups"]:
        bound = int(group["systemd"]["NUMAMask"])
        if with_memory and bound not in with_memory:
            raise PlanError(
                "invariant: {} binds memory to node {}, which has none".format(group["name"], bound)
            )
    for node in topology["numa_nodes"]:
        if node["cpus"] and not set(node["cpus"]) & hk:
            raise PlanError("invariant: NUMA node %d has no housekeeping CPU" % node["id"])
