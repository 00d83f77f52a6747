"""Kubelet's own rules: which configurations it refuses to start with, and why.

:func:`validate` checks an effective KubeletConfiguration the way kubelet would (its
validation package and the CPU, Topology and Memory Manager constructors), plus rtfleet's
one demand that the reserved CPUs cover the plan's housekeeping and runtime CPUs; each error
says what to change. The Static Memory Manager's accounting lives here too (which NUMA nodes
kubelet sees, how it defaults evictionHard, what reservedMemory must add up to), because
rendering fills reservedMemory by the same rule. Stdlib-only, Python 3.9-compatible.
"""

from __future__ import annotations

import re
from fractions import Fraction

from .kubelet_options import (
    CPU_OPTION_CONFLICTS,
    CPU_POLICIES,
    DEFAULT_MAX_NUMA_NODES,
    LEVEL_GATES,
    LOCKED_FEATURE_GATES,
    MEMORY_POLICIES,
    MIN_VERSION,
    NEWEST_KNOWN_VERSION,
    OPTION_TABLES,
    TOPOLOGY_MANAGER_OPTIONS,
    TOPOLOGY_POLICIES,
    TOPOLOGY_SCOPES,
    known_feature_gates,
    option_stage,
    options_gate,
)
from .kubelet_values import (
    GO_BOOLS,
    HUGEPAGES,
    format_bytes,
    format_cpuset,
    merge,
    parse_cpuset,
    parse_duration,
    parse_quantity,
    parse_version,
    truthy,
)

# ------------------------------------------------------------------ memory accounting


# kubelet's evictionHard defaulting (cmd/kubelet/app/server.go loadConfigFile): a main config
# file without evictionHard gets DefaultEvictionHard, whose memory.available is 100Mi on Linux
# (pkg/kubelet/eviction/defaults_linux.go); a map that is there, even empty, is kept as it is,
# unless mergeDefaultEvictionSettings is true (a field from 1.33; older kubelets decode it
# leniently and ignore it), which fills in the default signals it lacks. Drop-ins are merged
# over the main file as loaded, key by key. The Static Memory Manager counts memory.available
# in the reservation only when it is there.
DEFAULT_EVICTION_MEMORY = "100Mi"
MERGE_DEFAULT_EVICTION = (1, 33)


def _numa_nodes(topology):
    """Nodes with CPUs (where housekeeping, runtime and pods run)."""
    return [n for n in topology.get("numa_nodes", []) if n.get("cpus")]


def kubelet_numa_nodes(topology):
    """Every node kubelet sees (cadvisor lists each nodeN/ directory): CPU-less CXL nodes
    included, an offline memoryless node (no directory) not."""
    return [n for n in topology.get("numa_nodes", []) if n.get("online", True)]


def eviction_memory(config, version, base=None):
    """evictionHard memory.available as kubelet applies it, None when it applies none.

    ``config`` is kubelet's main config file, or, when ``base`` (the main file) is given, a
    drop-in (possibly already merged over ``base``).
    """
    main = config if base is None else base
    eviction = main.get("evictionHard")
    if eviction is None:
        eviction = {"memory.available": DEFAULT_EVICTION_MEMORY}
    elif version >= MERGE_DEFAULT_EVICTION and main.get("mergeDefaultEvictionSettings") is True:
        eviction = merge({"memory.available": DEFAULT_EVICTION_MEMORY}, eviction)
    if base is not None:
        eviction = merge(eviction, config.get("evictionHard") or {})
    return eviction.get("memory.available")


def is_percentage(eviction):
    return eviction is not None and str(eviction).strip().endswith("%")


def memory_reservation_total(config, version, base=None):
    """Per resource (memory, hugepages-*): kubeReserved + systemReserved + evictionHard."""
    totals = {}
    for section in ("kubeReserved", "systemReserved"):
        for name, value in (config.get(section) or {}).items():
            if name == "memory" or HUGEPAGES.match(name):
                totals[name] = totals.get(name, Fraction(0)) + parse_quantity(value)
    eviction = eviction_memory(config, version, base)
    if eviction is not None and not is_percentage(eviction):
        totals["memory"] = totals.get("memory", Fraction(0)) + parse_quantity(eviction)
    return totals


# ------------------------------------------------------------------ validation


def validate(config, topology, settings, plan=None, base_config=None):
    """Errors (strings, each saying what to change) for the effective kubelet config.

    ``base_config`` is kubelet's main config file when ``config`` is a drop-in merged over it
    (None: ``config`` is the main file).
    """
    errors = []
    version = parse_version(settings["kubelet_version"])
    if version < MIN_VERSION:
        errors.append(
            "kubelet %d.%d is older than rtfleet supports (%d.%d: Topology Manager GA): upgrade "
            "kubelet or set rtfleet_kubelet_version to the version the node runs"
            % (version + MIN_VERSION)
        )
        return errors
    gates = config.get("featureGates") or {}
    _check_feature_gates(gates, version, errors)
    allow_alpha = settings["allow_alpha_options"]
    _check_cpu_policy(config, errors)
    reserved = _check_reserved_cpus(config, topology, plan, errors)
    cpu_options = config.get("cpuManagerPolicyOptions") or {}
    _check_options("cpu", cpu_options, version, gates=gates, allow_alpha=allow_alpha, errors=errors)
    _check_cpu_option_fit(config, topology, reserved, errors)
    _check_reconcile_period(config, errors)
    _check_topology_manager(
        config, topology, version, gates=gates, allow_alpha=allow_alpha, errors=errors
    )
    node_ids = {n["id"] for n in kubelet_numa_nodes(topology)} or {0}
    errors.extend(_validate_memory(config, topology, node_ids, version, base_config))
    return errors


def _check_feature_gates(gates, version, errors):
    for gate, value in gates.items():
        if not isinstance(value, bool):
            errors.append(
                "featureGates.%s must be true or false, got %r: fix rtfleet_kubelet_feature_gates"
                % (gate, value)
            )
    known = known_feature_gates(version)
    for gate, value in sorted(gates.items()):
        if known is not None and gate not in known:
            close = sorted(n for n in known if n.lower() == str(gate).lower())
            errors.append(
                "featureGates.%s: kubelet %d.%d has no such feature gate (it refuses to start: "
                "unrecognized feature gate)%s: fix or remove it in rtfleet_kubelet_feature_gates"
                % ((gate, *version, "; did you mean %s?" % close[0] if close else ""))
            )
            continue
        locked = LOCKED_FEATURE_GATES.get(gate)
        if locked and version >= locked[0] and isinstance(value, bool) and value != locked[1]:
            errors.append(
                "featureGates.%s=%s: the gate is locked to %s since kubelet %d.%d (%s), so kubelet "
                "refuses to start: remove it from rtfleet_kubelet_feature_gates"
                % (
                    gate,
                    str(value).lower(),
                    str(locked[1]).lower(),
                    *locked[0],
                    "GA" if locked[1] else "deprecated",
                )
            )


def _check_cpu_policy(config, errors):
    cpu_policy = config.get("cpuManagerPolicy", "none")
    if cpu_policy not in CPU_POLICIES:
        errors.append(
            'cpuManagerPolicy %r is not a kubelet CPU Manager policy (none, static): use "static"'
            % (cpu_policy,)
        )
    elif cpu_policy != "static":
        errors.append(
            "cpuManagerPolicy is %r: rtfleet needs static so the pod pool gets exclusive CPUs "
            "and runtime CPUs stay reserved; remove the override" % cpu_policy
        )


def _check_reserved_cpus(config, topology, plan, errors):
    """Check reservedSystemCPUs and what may not go with it; its CPUs (None if unparsable)."""
    reserved_text = str(config.get("reservedSystemCPUs", ""))
    reserved = None
    try:
        reserved = set(parse_cpuset(reserved_text))
    except ValueError as exc:
        errors.append(
            "invalid configuration: unable to parse reservedSystemCPUs %r (%s): "
            'write it like "0-1,64-65"' % (reserved_text, exc)
        )
    if reserved is not None:
        if not reserved:
            errors.append(
                "reservedSystemCPUs is empty: the static CPU Manager needs a non-zero reservation "
                "(the plan's housekeeping and runtime CPUs)"
            )
        online = set(topology.get("cpus") or [])
        missing = sorted(reserved - online) if online else []
        if missing:
            errors.append(
                "reservedSystemCPUs names CPUs %s that this host does not have online (%s): "
                "re-plan from this host's topology"
                % (format_cpuset(missing), format_cpuset(online))
            )
        if plan is not None:
            _check_plan_reserved(reserved, plan, errors)
    if reserved_text and (config.get("systemReservedCgroup") or config.get("kubeReservedCgroup")):
        errors.append(
            "invalid configuration: can't use reservedSystemCPUs with systemReservedCgroup or "
            "kubeReservedCgroup: remove those cgroup settings (extra) or the reservation"
        )
    for section in ("kubeReserved", "systemReserved"):
        if "cpu" in (config.get(section) or {}) and reserved_text:
            errors.append(
                "%s.cpu is set, but reservedSystemCPUs already reserves exact CPUs and kubelet "
                "ignores the cpu amount: drop cpu from %s"
                % (section, "kube_reserved" if section == "kubeReserved" else "system_reserved")
            )
    return reserved


def _check_plan_reserved(reserved, plan, errors):
    """The reservation must cover the plan's runtime and housekeeping CPUs."""
    runtime = set(plan.get("runtime") or [])
    housekeeping = set(plan.get("housekeeping") or [])
    unreserved_runtime = sorted(runtime - reserved)
    if unreserved_runtime:
        errors.append(
            "reservedSystemCPUs leaves runtime CPUs %s to the pod pool: kubelet would hand "
            "pinned runtime CPUs to pods; reserve housekeeping + runtime (%s)"
            % (format_cpuset(unreserved_runtime), plan["kubelet"]["reservedSystemCPUs"])
        )
    unreserved_hk = sorted(housekeeping - reserved)
    if unreserved_hk:
        errors.append(
            "reservedSystemCPUs leaves housekeeping CPUs %s to pods: reserve them too (%s)"
            % (format_cpuset(unreserved_hk), plan["kubelet"]["reservedSystemCPUs"])
        )


def _check_options(kind, options, version, *, gates, allow_alpha, errors):
    table = OPTION_TABLES[kind]
    label = "cpuManagerPolicyOptions" if kind == "cpu" else "topologyManagerPolicyOptions"
    role_key = "cpu_manager_policy_options" if kind == "cpu" else "topology_manager_policy_options"
    table_version = min(version, NEWEST_KNOWN_VERSION)
    for name, value in sorted(options.items()):
        stage = option_stage(table, name, table_version)
        if stage is None:
            first = min(table[name].values()) if name in table else None
            if first:
                errors.append(
                    "%s %s: kubelet %d.%d does not have this option (it appeared in %d.%d): "
                    "remove it from %s or upgrade kubelet"
                    % ((label, name, *version, *first, role_key))
                )
            else:
                errors.append(
                    "%s %s: unknown option (known: %s): fix the name in %s"
                    % (label, name, ", ".join(sorted(table)), role_key)
                )
            continue
        gate = options_gate(kind, table_version)
        if gate and gates.get(gate) is False:
            errors.append(
                "%s needs feature gate %s on kubelet %d.%d, but featureGates.%s is false: "
                "remove that override" % ((label, gate, *version, gate))
            )
        if stage in ("alpha", "beta"):
            level_gate = LEVEL_GATES[kind][stage]
            if stage == "alpha" and not allow_alpha:
                errors.append(
                    "%s %s is alpha in kubelet %d.%d (needs feature gate %s): set "
                    "allow_alpha_options (rtfleet_kubelet_allow_alpha_options: true) to accept "
                    "an alpha option on this node, or remove it"
                    % ((label, name, *version, level_gate))
                )
            elif gates.get(level_gate) is False or (stage == "alpha" and not gates.get(level_gate)):
                errors.append(
                    "%s %s is %s in kubelet %d.%d and needs featureGates.%s: true; it is "
                    "disabled: remove the override or the option"
                    % ((label, name, stage, *version, level_gate))
                )
        _check_option_value(label, name, value, errors)


def _check_option_value(label, name, value, errors):
    if name == "max-allowable-numa-nodes":
        if not re.match(r"^[+-]?\d+$", value):
            errors.append(
                "%s max-allowable-numa-nodes=%r is not an integer: give the number of NUMA "
                "nodes the host has" % (label, value)
            )
        elif int(value) < DEFAULT_MAX_NUMA_NODES:
            errors.append(
                '%s max-allowable-numa-nodes=%s: kubelet wants at least %d ("the minimum value '
                'should not be less than 8"): raise it or drop the option'
                % (label, value, DEFAULT_MAX_NUMA_NODES)
            )
    elif value not in GO_BOOLS:
        errors.append(
            '%s %s=%r: kubelet parses this as a boolean: use "true" or "false"'
            % (label, name, value)
        )


def _check_cpu_option_fit(config, topology, reserved, errors):
    """CPU Manager options that clash with each other, the reservation or the host."""
    cpu_options = config.get("cpuManagerPolicyOptions") or {}
    for first, second in CPU_OPTION_CONFLICTS:
        if truthy(cpu_options, first) and truthy(cpu_options, second):
            errors.append(
                "static policy options %s and %s can not be used at the same time (kubelet "
                "refuses to start): keep one" % (first, second)
            )
    if truthy(cpu_options, "full-pcpus-only") and reserved:
        split = []
        for core in topology.get("cores", []):
            cpus = set(core["cpus"])
            if cpus & reserved and not cpus <= reserved:
                split.append(format_cpuset(cpus))
        if split:
            errors.append(
                "full-pcpus-only is on, but reservedSystemCPUs splits SMT cores %s: reserve "
                "whole cores (both siblings) or turn full-pcpus-only off" % ", ".join(split)
            )
    if truthy(cpu_options, "align-by-socket"):
        if config.get("topologyManagerPolicy") == "single-numa-node":
            errors.append(
                "align-by-socket is incompatible with topologyManagerPolicy single-numa-node: "
                "use restricted or best-effort, or drop the option"
            )
        sockets = len(topology.get("packages") or []) or 1
        cpu_nodes = _numa_nodes(topology)
        if sockets > len(cpu_nodes or [0]):
            errors.append(
                "align-by-socket needs at least as many NUMA nodes as sockets (this host has %d "
                "sockets, %d NUMA nodes): drop the option" % (sockets, len(cpu_nodes or [0]))
            )


def _check_reconcile_period(config, errors):
    duration = config.get("cpuManagerReconcilePeriod")
    if duration is not None:
        try:
            if parse_duration(duration) <= 0:
                errors.append('cpuManagerReconcilePeriod must be greater than zero: use e.g. "10s"')
        except ValueError:
            errors.append(
                'cpuManagerReconcilePeriod %r is not a duration: write it like "10s" or "1m30s"'
                % (duration,)
            )


def _check_topology_manager(config, topology, version, *, gates, allow_alpha, errors):
    topo_policy = config.get("topologyManagerPolicy", "none")
    if topo_policy not in TOPOLOGY_POLICIES:
        errors.append(
            "invalid configuration: topologyManagerPolicy %r must be one of: %s"
            % (topo_policy, ", ".join(TOPOLOGY_POLICIES))
        )
    scope = config.get("topologyManagerScope", "container")
    if scope not in TOPOLOGY_SCOPES:
        errors.append(
            "invalid configuration: topologyManagerScope %r must be one of: container, or pod"
            % (scope,)
        )
    topo_options = config.get("topologyManagerPolicyOptions") or {}
    _check_options(
        "topology", topo_options, version, gates=gates, allow_alpha=allow_alpha, errors=errors
    )
    nodes = kubelet_numa_nodes(topology)
    if len(nodes) > DEFAULT_MAX_NUMA_NODES and topo_policy != "none":
        _check_numa_node_limit(nodes, topo_options, version, errors)


def _check_numa_node_limit(nodes, topo_options, version, errors):
    """The Topology Manager refuses more NUMA nodes than max-allowable-numa-nodes (8)."""
    without_cpus = [n["id"] for n in nodes if not n.get("cpus")]
    cpuless = (
        " (CPU-less %s included: the Topology Manager counts every node)"
        % format_cpuset(without_cpus)
        if without_cpus
        else ""
    )
    limit = topo_options.get("max-allowable-numa-nodes", "")
    allowed = int(limit) if re.match(r"^\d+$", limit) else DEFAULT_MAX_NUMA_NODES
    if allowed >= len(nodes):
        return
    if option_stage(
        TOPOLOGY_MANAGER_OPTIONS,
        "max-allowable-numa-nodes",
        min(version, NEWEST_KNOWN_VERSION),
    ):
        errors.append(
            "this host has %d NUMA nodes%s and the Topology Manager refuses more than "
            "%d: set topology_manager_policy_options max-allowable-numa-nodes to %d or "
            "more" % (len(nodes), cpuless, allowed, len(nodes))
        )
    else:
        errors.append(
            "this host has %d NUMA nodes%s; kubelet %d.%d's Topology Manager refuses "
            "more than 8 (max-allowable-numa-nodes came in 1.31): upgrade kubelet, set "
            "topology_manager_policy none, or fold nodes in the BIOS (NPS1)"
            % ((len(nodes), cpuless, *version))
        )


# ------------------------------------------------------------------ memory manager


def _validate_memory(config, topology, node_ids, version, base=None):
    errors = []
    policy = config.get("memoryManagerPolicy", "None")
    if policy not in MEMORY_POLICIES:
        errors.append(
            "memoryManagerPolicy %r is not a Memory Manager policy (None, Static): note the "
            "capital letter" % (policy,)
        )
        return errors
    reservations = config.get("reservedMemory") or []
    per_type, per_node_bytes = _reserved_memory_amounts(reservations, node_ids, errors)
    if policy == "Static" and _check_memory_totals(config, version, base, per_type, errors):
        _check_node_capacity(topology, per_node_bytes, errors)
    return errors


def _reserved_memory_amounts(reservations, node_ids, errors):
    """reservedMemory summed per resource, and its memory per node; errors for bad entries."""
    seen = set()
    per_type = {}
    per_node_bytes = {}
    for index, entry in enumerate(reservations):
        node = _reservation_node(index, entry, node_ids, errors)
        if node is None:
            continue
        for name, value in sorted((entry.get("limits") or {}).items()):
            amount = _reservation_amount(node, name, value, errors)
            if amount is None:
                continue
            if (node, name) in seen:
                errors.append(
                    "invalid configuration: the reserved memory has a duplicate value for NUMA "
                    "node %d and resource %r: keep one" % (node, name)
                )
            seen.add((node, name))
            per_type[name] = per_type.get(name, Fraction(0)) + amount
            if name == "memory":
                per_node_bytes[node] = per_node_bytes.get(node, Fraction(0)) + amount
    return per_type, per_node_bytes


def _reservation_node(index, entry, node_ids, errors):
    """The NUMA node of reservedMemory[index], None when the entry cannot be read."""
    if not isinstance(entry, dict) or "numaNode" not in entry:
        errors.append(
            "reservedMemory[%d] must be {numaNode: N, limits: {memory: 1Gi}}, got %r"
            % (index, entry)
        )
        return None
    node = entry["numaNode"]
    if isinstance(node, bool) or not isinstance(node, int):
        errors.append("reservedMemory[%d].numaNode must be an integer, got %r" % (index, node))
        return None
    if node not in node_ids:
        errors.append(
            "the reserved memory configuration references a NUMA node %d that does not exist "
            "on this machine (nodes %s): fix reservedMemory" % (node, format_cpuset(node_ids))
        )
    return node


def _reservation_amount(node, name, value, errors):
    """One limit of a reservedMemory entry in bytes, None when it cannot count."""
    if name != "memory" and not HUGEPAGES.match(name):
        errors.append(
            "invalid configuration: the limit type %r for NUMA node %d is not supported, "
            "only memory and hugepages-<size> are accepted" % (name, node)
        )
        return None
    try:
        amount = parse_quantity(value)
    except ValueError:
        errors.append(
            "reservedMemory NUMA node %d %s: %r is not a quantity (write 1Gi, 512Mi)"
            % (node, name, value)
        )
        return None
    if amount == 0:
        errors.append(
            "invalid configuration: reserved memory may not be zero for NUMA node %d and "
            "resource %r: remove the entry or give an amount" % (node, name)
        )
    return amount


def _check_memory_totals(config, version, base, per_type, errors):
    """reservedMemory must equal kubeReserved + systemReserved + evictionHard, per resource.

    False when that sum cannot be known (the error says why).
    """
    eviction = eviction_memory(config, version, base)
    if is_percentage(eviction):
        errors.append(
            "evictionHard memory.available is %s (a percentage); the Static Memory Manager needs "
            "reservedMemory to equal kubeReserved + systemReserved + evictionHard exactly: give "
            "an absolute quantity" % str(eviction).strip()
        )
        return False
    try:
        expected = memory_reservation_total(config, version, base)
    except ValueError as exc:
        errors.append("kubeReserved/systemReserved/evictionHard: %s" % exc)
        return False
    if not expected.get("memory"):
        errors.append(
            "memoryManagerPolicy Static needs a memory reservation (kubeReserved + systemReserved "
            "+ evictionHard memory): set rtfleet_kubelet_kube_reserved/system_reserved memory"
        )
    for name in sorted(set(expected) | set(per_type)):
        want = expected.get(name, Fraction(0))
        have = per_type.get(name, Fraction(0))
        if want != have:
            errors.append(
                "reservedMemory %s adds up to %s over the NUMA nodes, but kubeReserved + "
                "systemReserved + evictionHard for %s is %s; kubelet's Static Memory Manager "
                "refuses to start unless they are equal: fix reservedMemory or use "
                'reserved_memory: "auto"' % (name, format_bytes(have), name, format_bytes(want))
            )
    return True


def _check_node_capacity(topology, per_node_bytes, errors):
    capacity = {n["id"]: n.get("memory_kb") for n in kubelet_numa_nodes(topology)}
    for node, amount in sorted(per_node_bytes.items()):
        memory_kb = capacity.get(node)
        if memory_kb == 0:
            errors.append(
                "reservedMemory reserves %s on NUMA node %d, which has no memory (memoryless): "
                "move it to a node with memory" % (format_bytes(amount), node)
            )
        elif memory_kb and amount > memory_kb * 1024:
            errors.append(
                "reservedMemory reserves %s on NUMA node %d, which has only %s: lower it"
                % (format_bytes(amount), node, format_bytes(memory_kb * 1024))
            )
