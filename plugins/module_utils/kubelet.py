"""Kubelet CPU, Topology and Memory Manager configuration from the CPU partition plan.

The file rtfleet writes for kubelet, rendered and decided here; stdlib-only and Python
3.9-compatible, because it also runs on hosts as the ``kubelet_config`` module's
module_utils. It never touches a host itself:

* :func:`build` renders the KubeletConfiguration keys from a plan (``rtfleet.planner``),
  the topology (``rtfleet.topology``) and the role's settings, validates the effective
  configuration the way kubelet would, and decides whether the CPU / Memory Manager
  checkpoints must be reset;
* :func:`render` turns settings into the keys, :func:`dump` / :func:`load` write and read
  the file.

Beside it: ``kubelet_options`` (kubelet's tables per version), ``kubelet_values`` (its value
syntax), ``kubelet_validate`` (its rules) and ``kubelet_state`` (its checkpoints).
"""

from __future__ import annotations

import copy
import json

from .kubelet_options import (
    CPU_MANAGER_OPTIONS,
    CPU_OPTION_CONFLICTS,
    DEFAULT_MAX_NUMA_NODES,
    DROPIN_ALPHA,
    DROPIN_DEFAULT,
    GATE_TABLE_VERSIONS,
    LEVEL_GATES,
    NEWEST_KNOWN_VERSION,
    OPTION_TABLES,
    TABLED_FEATURE_GATES,
    TOPOLOGY_MANAGER_OPTIONS,
    known_feature_gates,
    option_stage,
    options_gate,
)
from .kubelet_state import state_reset
from .kubelet_validate import (
    eviction_memory,
    is_percentage,
    kubelet_numa_nodes,
    memory_reservation_total,
    validate,
)
from .kubelet_values import (
    HUGEPAGES,
    KubeletConfigError,
    format_bytes,
    merge,
    parse_quantity,
    parse_version,
    truthy,
)

API_VERSION = "kubelet.config.k8s.io/v1beta1"
KIND = "KubeletConfiguration"

# What rtfleet turns on by default once kubelet offers it as beta or GA: whole cores per
# container, no pod of any QoS class on reserved (housekeeping + runtime) CPUs, and exclusive
# CPUs packed into one L3 group (CCX) where they fit.
RECOMMENDED_CPU_OPTIONS = (
    "full-pcpus-only",
    "strict-cpu-reservation",
    "prefer-align-cpus-by-uncorecache",
)

DEFAULT_SETTINGS = {
    "kubelet_version": "1.31",
    "config_mode": "auto",  # auto | dropin | main
    "cpu_manager_policy": "static",
    # Added when beta or GA at the kubelet version, unless set in cpu_manager_policy_options.
    "recommended_cpu_options": True,
    "cpu_manager_policy_options": {},
    "cpu_manager_reconcile_period": "10s",
    "reserved_system_cpus": None,  # None: the plan's housekeeping + runtime CPUs
    "topology_manager_policy": "single-numa-node",
    "topology_manager_scope": "pod",
    "topology_manager_policy_options": {},
    "memory_manager_policy": "Static",
    "reserved_memory": "auto",  # "auto" (split evenly over NUMA nodes) or a list
    "kube_reserved": {"memory": "512Mi"},
    "system_reserved": {"memory": "512Mi"},
    "eviction_hard": {"memory.available": "100Mi"},
    "feature_gates": {},
    "allow_alpha_options": False,
    "extra": {},
}


# ------------------------------------------------------------------ settings


def normalize_settings(settings):
    """Defaults + settings, type-checked; raises KubeletConfigError naming the key."""
    merged = copy.deepcopy(DEFAULT_SETTINGS)
    for key, value in (settings or {}).items():
        if key not in DEFAULT_SETTINGS:
            raise KubeletConfigError(
                "unknown kubelet setting %r; known settings: %s"
                % (key, ", ".join(sorted(DEFAULT_SETTINGS)))
            )
        if value is not None or key == "reserved_system_cpus":
            merged[key] = value
    for key in (
        "cpu_manager_policy_options",
        "topology_manager_policy_options",
        "kube_reserved",
        "system_reserved",
        "eviction_hard",
        "feature_gates",
        "extra",
    ):
        if not isinstance(merged[key], dict):
            raise KubeletConfigError(
                "%s must be a mapping, got %r" % (key, type(merged[key]).__name__)
            )
    for key in ("cpu_manager_policy_options", "topology_manager_policy_options"):
        # kubelet decodes these as map[string]string: YAML true must become "true".
        merged[key] = {
            str(k): (str(v).lower() if isinstance(v, bool) else str(v))
            for k, v in merged[key].items()
        }
    if merged["config_mode"] not in ("auto", "dropin", "main"):
        raise KubeletConfigError(
            "config_mode must be auto, dropin or main, got %r" % (merged["config_mode"],)
        )
    for key in ("allow_alpha_options", "recommended_cpu_options"):
        if not isinstance(merged[key], bool):
            raise KubeletConfigError("%s must be true or false" % key)
    if merged["reserved_memory"] != "auto" and not isinstance(merged["reserved_memory"], list):
        raise KubeletConfigError(
            'reserved_memory must be "auto" or a list of {numaNode: N, limits: {memory: 1Gi}}'
        )
    return merged


def config_target(version, mode):
    """(use_dropin, warnings) for this kubelet version and config_mode."""
    if mode == "main":
        return False, []
    if mode == "auto":
        return version >= DROPIN_DEFAULT, []
    if version < DROPIN_ALPHA:
        raise KubeletConfigError(
            "config_mode dropin needs kubelet >= 1.28 (--config-dir); kubelet %d.%d has no "
            "drop-in directory: set config_mode: main (or auto)" % version
        )
    if version < DROPIN_DEFAULT:
        return True, [
            "kubelet %d.%d reads --config-dir only with KUBELET_CONFIG_DROPIN_DIR_ALPHA set in "
            "its environment (alpha); make sure the kubelet unit sets it" % version
        ]
    return True, []


# ------------------------------------------------------------------ rendering


def _reservable_nodes(topology):
    """Nodes the automatic reservedMemory split uses: kubelet-visible, with CPUs and memory."""
    return [
        n
        for n in kubelet_numa_nodes(topology)
        if n.get("cpus") and n.get("has_memory", True) and n.get("memory_kb") != 0
    ]


def _auto_reserved_memory(config, topology, version, base=None):
    """Split each reserved memory type evenly over the NUMA nodes (node 0 takes the rest)."""
    nodes = [n["id"] for n in _reservable_nodes(topology)] or [0]
    eviction = eviction_memory(config, version, base)
    if is_percentage(eviction):
        raise KubeletConfigError(
            "evictionHard memory.available is %s (a percentage), but the Static Memory Manager "
            "needs reservedMemory to sum to an exact amount: give eviction_hard "
            'memory.available an absolute quantity such as "500Mi"' % str(eviction).strip()
        )
    try:
        totals = memory_reservation_total(config, version, base)
    except ValueError as exc:
        raise KubeletConfigError("kube_reserved/system_reserved/eviction_hard: %s" % exc) from None
    per_node = {node: {} for node in nodes}
    for name, total in sorted(totals.items()):
        if total.denominator != 1:
            raise KubeletConfigError(
                "reserved %s adds up to a fraction of a byte; use whole-byte quantities" % name
            )
        granule = 1
        page = HUGEPAGES.match(name)
        if page:
            granule = int(parse_quantity(page.group(1)))
        pages = int(total) // granule
        share, rest = divmod(pages, len(nodes))
        for index, node in enumerate(nodes):
            amount = (share + (rest if index == 0 else 0)) * granule
            if amount:
                per_node[node][name] = format_bytes(amount)
        if int(total) % granule:
            raise KubeletConfigError(
                "reserved %s (%s bytes) is not a whole number of pages" % (name, int(total))
            )
    return [{"numaNode": node, "limits": per_node[node]} for node in nodes if per_node[node]]


def render(plan, topology, settings, base_config=None):
    """The KubeletConfiguration fragment and the feature gates it needs.

    ``base_config`` is kubelet's main config file (None: the fragment is the whole file).
    Returns (config, warnings). Raises KubeletConfigError for settings that cannot be
    rendered at all; :func:`validate` checks the result.
    """
    version = parse_version(settings["kubelet_version"])
    warnings = []
    if version > NEWEST_KNOWN_VERSION:
        warnings.append(
            "kubelet %d.%d is newer than rtfleet's option table (%d.%d): option maturity and "
            "feature gates are assumed as of %d.%d" % (version + NEWEST_KNOWN_VERSION * 2)
        )
    table_version = min(version, NEWEST_KNOWN_VERSION)
    config = _manager_keys(plan, settings)
    cpu_options = _cpu_options(settings, table_version)
    if not truthy(cpu_options, "strict-cpu-reservation"):
        strict = option_stage(CPU_MANAGER_OPTIONS, "strict-cpu-reservation", table_version)
        warnings.append(
            "strict-cpu-reservation is off (kubelet %d.%d%s): Burstable and BestEffort pods share "
            "the reserved CPUs, runtime CPUs included; only isolcpus keeps them off"
            % (*version, "" if strict in ("beta", "ga") else ", beta from 1.33")
        )
    if cpu_options:
        config["cpuManagerPolicyOptions"] = cpu_options
    topo_options = _topology_options(settings, topology, table_version)
    if topo_options:
        config["topologyManagerPolicyOptions"] = topo_options
    _add_reservations(config, topology, settings, version, base_config)
    gates = _feature_gates({"cpu": cpu_options, "topology": topo_options}, table_version)
    gates.update(settings["feature_gates"])
    warnings.extend(_untabled_gate_warnings(settings["feature_gates"], version))
    if gates:
        config["featureGates"] = gates
    config = merge(config, settings["extra"])
    return config, warnings


def _manager_keys(plan, settings):
    """The keys every rendering has: the three managers' policies and the reserved CPUs."""
    reserved = settings["reserved_system_cpus"]
    if reserved in (None, ""):
        reserved = plan["kubelet"]["reservedSystemCPUs"]
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "cpuManagerPolicy": settings["cpu_manager_policy"],
        "reservedSystemCPUs": str(reserved),
        "cpuManagerReconcilePeriod": settings["cpu_manager_reconcile_period"],
        "topologyManagerPolicy": settings["topology_manager_policy"],
        "topologyManagerScope": settings["topology_manager_scope"],
        "memoryManagerPolicy": settings["memory_manager_policy"],
    }


def _cpu_options(settings, table_version):
    """The settings' CPU Manager options, plus the recommended ones kubelet offers and allows."""
    cpu_options = dict(settings["cpu_manager_policy_options"])
    if not settings["recommended_cpu_options"]:
        return cpu_options
    for name in RECOMMENDED_CPU_OPTIONS:
        if option_stage(CPU_MANAGER_OPTIONS, name, table_version) not in ("beta", "ga"):
            continue
        clash = [
            b if a == name else a
            for a, b in CPU_OPTION_CONFLICTS
            if name in (a, b) and truthy(cpu_options, b if a == name else a)
        ]
        if name not in cpu_options and not clash:
            cpu_options[name] = "true"
    return cpu_options


def _topology_options(settings, topology, table_version):
    """The settings' Topology Manager options; max-allowable-numa-nodes when the host needs it."""
    topo_options = dict(settings["topology_manager_policy_options"])
    node_count = len(kubelet_numa_nodes(topology))
    if (
        node_count > DEFAULT_MAX_NUMA_NODES
        and settings["topology_manager_policy"] != "none"
        and "max-allowable-numa-nodes" not in topo_options
        and option_stage(TOPOLOGY_MANAGER_OPTIONS, "max-allowable-numa-nodes", table_version)
    ):
        topo_options["max-allowable-numa-nodes"] = str(node_count)
    return topo_options


def _add_reservations(config, topology, settings, version, base_config):
    """kubeReserved, systemReserved, evictionHard and, for the Static policy, reservedMemory."""
    for key, section in (
        ("kube_reserved", "kubeReserved"),
        ("system_reserved", "systemReserved"),
        ("eviction_hard", "evictionHard"),
    ):
        if settings[key]:
            config[section] = {k: str(v) for k, v in settings[key].items()}
    if settings["memory_manager_policy"] != "Static":
        return
    if settings["reserved_memory"] == "auto":
        # What kubelet will load: the main file rtfleet rewrites, or its drop-in over it.
        view = merge(base_config or {}, merge(config, settings["extra"]))
        dropin = base_config is not None and config_target(version, settings["config_mode"])[0]
        base = base_config if dropin else None
        config["reservedMemory"] = _auto_reserved_memory(view, topology, version, base)
    else:
        config["reservedMemory"] = copy.deepcopy(settings["reserved_memory"])


def _feature_gates(options_by_kind, table_version):
    """The gates the chosen options need: the options gate while not GA, alpha/beta levels."""
    gates = {}
    for kind, options in options_by_kind.items():
        table = OPTION_TABLES[kind]
        stages = {option_stage(table, name, table_version) for name in options}
        stages.discard(None)
        if not stages:
            continue
        gate = options_gate(kind, table_version)
        if gate:
            gates[gate] = True
        for level in ("alpha", "beta"):
            if level in stages:
                gates[LEVEL_GATES[kind][level]] = True
    return gates


def _untabled_gate_warnings(feature_gates, version):
    """A warning for set gates no tabled version knows, when ``version`` is not tabled."""
    if not feature_gates or known_feature_gates(version) is not None:
        return []
    unknown = sorted(g for g in feature_gates if g not in TABLED_FEATURE_GATES)
    if not unknown:
        return []
    return [
        "feature gates %s are not in rtfleet's gate table (kubelet %d.%d-%d.%d); kubelet "
        "%d.%d refuses to start on a name it does not know: check the spelling"
        % ((", ".join(unknown), *GATE_TABLE_VERSIONS[0], *GATE_TABLE_VERSIONS[1], *version))
    ]


# ------------------------------------------------------------------ files


def dump(config, header):
    """File content: the managed header as comments, then the config as indented JSON.

    JSON is YAML, so kubelet reads it as its config file; unlike YAML it cannot turn an
    option value "true" into a boolean that kubelet's map[string]string refuses.
    """
    lines = ["# " + line if line else "#" for line in header.splitlines()]
    return "\n".join(lines) + "\n" + json.dumps(config, indent=2, sort_keys=True) + "\n"


def load(text):
    """Parse a file written by :func:`dump` (comment lines, then JSON); ValueError if not."""
    body = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    data = json.loads(body)
    if not isinstance(data, dict):
        raise ValueError("not a mapping")
    return data


def build(
    plan,
    topology,
    settings,
    *,
    base_config=None,
    previous_text=None,
    cpu_state=None,
    memory_state=None,
):
    """Render, validate and decide. Raises KubeletConfigError listing every problem.

    ``base_config`` is kubelet's main config file as parsed (None or {} when absent);
    ``previous_text`` the current content of the file rtfleet writes (None when absent).
    """
    settings = normalize_settings(settings)
    version = parse_version(settings["kubelet_version"])
    use_dropin, warnings = config_target(version, settings["config_mode"])
    base = base_config or {}
    fragment, render_warnings = render(plan, topology, settings, base_config=base)
    warnings += render_warnings
    effective = merge(base, fragment)
    errors = validate(effective, topology, settings, plan, base_config=base if use_dropin else None)
    if errors:
        raise KubeletConfigError(
            "kubelet configuration refused (%d problem%s), nothing was changed:\n- %s"
            % (len(errors), "" if len(errors) == 1 else "s", "\n- ".join(errors))
        )
    if not plan.get("pod_pool"):
        warnings.append(
            "the plan leaves no pod-pool CPUs: every CPU is reserved, so Guaranteed pods get no "
            "exclusive CPUs (set runtime_l3_groups to a count to leave some to pods)"
        )
    previous = None
    if use_dropin:
        if previous_text is None:
            previous = base
        else:
            try:
                previous = merge(base, load(previous_text))
            except ValueError:
                warnings.append(
                    "the current drop-in is not one rtfleet wrote; treating the previous "
                    "configuration as unknown"
                )
        written = fragment
    else:
        previous = base if base else None
        written = effective
    return {
        "version": "%d.%d" % version,
        "dropin": use_dropin,
        "config": written,
        "effective": effective,
        "previous": previous,
        "state": state_reset(previous, effective, cpu_state, memory_state),
        "warnings": warnings,
    }
