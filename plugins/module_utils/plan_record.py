# Copyright: rtfleet contributors
# Apache-2.0
"""The plan record (/etc/rtfleet/plan.json): what it stores, and the plan every reader gets.

The host role writes it (:func:`to_record` of planner.plan_partition's result); the kubelet,
runtime and post-check roles, the samplers playbook (through rtfleet_host's ``read_plan``
entry point and the ``plan_record`` filter) and the drift guard on the host
(drift.load_records) read it, each through :func:`check_plan`: the record's ``schema`` must
be one this collection reads, and the fields it stores must have their types. Anything else
is one line naming what is wrong and what to do, before a reader changes anything.

The record stores each CPU set once (schema 2): the four sets of the partition (``online``,
``housekeeping``, ``runtime``, ``pod_pool``), each runtime group's ``cpus`` (and its
``worker_cpus`` when they are not all of them), each NUMA node's ``cpus``, and the policy.
Every other form a layer uses -- the isolated set, cpulist strings, kernel arguments,
kubelet's reserved CPUs, irqbalance's and IRQ masks, tuned's ``isolated_cores``, systemd's
``CPUAffinity`` -- is derived from them by :func:`expand`, for the planner (which builds
its plan with it) and for every reader alike. A schema-1 record (which stored those forms
too) is read by keeping its sets and deriving the rest. Stdlib and cpulist only (it ships
to the host).
"""

from __future__ import annotations

import json
import re

from .cpulist import format_cpulist, format_cpumask

PLAN_FILE = "/etc/rtfleet/plan.json"
SCHEMA_VERSION = 2  # what to_record writes
READABLE_SCHEMAS = (1, 2)
CPU_SETS = ("online", "housekeeping", "runtime", "pod_pool")
# What a record stores besides the sets; everything else of a plan is expand()'s.
STORED = ("schema", "policy", *CPU_SETS, "runtime_groups", "numa_nodes", "warnings")
GROUP_STORED = (
    "name",
    "cpus",
    "worker_cpus",
    "numa_node",
    "memory_node",
    "l3_group",
    "package",
    "partial_l3",
    "sampler_cpus",
    "sampler_cpus_from",
)
NODE_STORED = ("id", "memory_node", "cpus")
GROUP_NAME = re.compile(r"^[A-Za-z0-9_-]+$")


class PlanRecordError(ValueError):
    """What is wrong with a plan record, in one line (without the file's name)."""


def _cpus(value, what):
    if not isinstance(value, list) or not all(
        isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in value
    ):
        raise PlanRecordError("%s is not a list of CPU numbers" % what)


def _int(value, what):
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise PlanRecordError("%s is not a number" % what)


def isolated_of(policy, runtime, pod_pool):
    """The isolated CPUs: the runtime and/or pod pool sets, as the policy's ``isolate`` says."""
    isolate = policy.get("isolate") or ()
    return sorted(
        set(runtime if "runtime" in isolate else ())
        | set(pod_pool if "pod_pool" in isolate else ())
    )


def kernel_args(policy, isolated, housekeeping):
    """isolcpus, nohz_full, rcu_nocbs, irqaffinity and kthread_cpus; none when nothing is
    isolated."""
    if not isolated:
        return []
    iso = format_cpulist(isolated)
    flags = ",".join(policy.get("isolcpus_flags") or ())
    return [
        "isolcpus={}{}".format(flags + "," if flags else "", iso),
        "nohz_full=" + iso,
        "rcu_nocbs=" + iso,
        "irqaffinity=" + format_cpulist(housekeeping),
        "kthread_cpus=" + format_cpulist(housekeeping),
    ]


def to_record(plan):
    """What /etc/rtfleet/plan.json stores of ``plan`` (a plan or a record): each CPU set once."""
    record = {k: plan[k] for k in STORED if k in plan}
    record["schema"] = SCHEMA_VERSION
    record["runtime_groups"] = [
        {k: g[k] for k in GROUP_STORED if k in g and not (k == "worker_cpus" and g[k] == g["cpus"])}
        for g in plan["runtime_groups"]
    ]
    record["numa_nodes"] = [{k: n[k] for k in NODE_STORED if k in n} for n in _nodes(plan)]
    return record


def _nodes(plan):
    """The record's NUMA nodes with their CPUs (a schema-1 record kept only their pieces)."""
    nodes = []
    for node in plan.get("numa_nodes") or ():
        if not isinstance(node, dict) or "cpus" in node:
            nodes.append(node)
            continue
        names = set(node.get("runtime_groups") or ())
        cpus = set(node.get("housekeeping") or ()) | set(node.get("pod_pool") or ())
        for group in plan["runtime_groups"]:
            if group["name"] in names:
                cpus |= set(group["cpus"])
        nodes.append(dict(node, cpus=sorted(cpus)))
    return nodes


def expand(record):
    """The plan a reader uses: the record's sets and every form derived from them."""
    policy = record["policy"]
    online, housekeeping = record["online"], record["housekeeping"]
    runtime, pod_pool = record["runtime"], record["pod_pool"]
    isolated = isolated_of(policy, runtime, pod_pool)
    not_housekeeping = sorted(set(online) - set(housekeeping))
    groups = [
        dict(
            group,
            # Stored only when the workers are not the whole group (one thread per core).
            worker_cpus=group.get("worker_cpus", group["cpus"]),
            cpulist=format_cpulist(group["cpus"]),
            systemd={
                "CPUAffinity": format_cpulist(group["cpus"]),
                "NUMAPolicy": "bind",
                "NUMAMask": str(group["memory_node"]),
            },
        )
        for group in record["runtime_groups"]
    ]
    return {
        "schema": record["schema"],
        "policy": policy,
        "online": online,
        "housekeeping": housekeeping,
        "runtime": runtime,
        "pod_pool": pod_pool,
        "isolated": isolated,
        "runtime_groups": groups,
        "cpulists": {
            "online": format_cpulist(online),
            "housekeeping": format_cpulist(housekeeping),
            "runtime": format_cpulist(runtime),
            "pod_pool": format_cpulist(pod_pool),
            "isolated": format_cpulist(isolated),
        },
        "kernel_args": kernel_args(policy, isolated, housekeeping),
        "kubelet": {
            # Runtime CPUs are reserved too, so kubelet never hands one to a pod.
            "reservedSystemCPUs": format_cpulist(sorted(set(housekeeping) | set(runtime))),
            "podPoolCPUs": format_cpulist(pod_pool),
        },
        "irqbalance_banned_cpus": format_cpulist(not_housekeeping),
        "irqbalance_banned_cpus_mask": format_cpumask(not_housekeeping)
        if not_housekeeping
        else "0",
        "irq_default_affinity_mask": format_cpumask(housekeeping),
        "systemd_cpu_affinity": format_cpulist(housekeeping),
        "tuned": {"isolated_cores": format_cpulist(isolated)},
        "numa_nodes": [
            {
                "id": node["id"],
                "memory_node": node["memory_node"],
                "cpus": node["cpus"],
                "housekeeping": sorted(set(node["cpus"]) & set(housekeeping)),
                "runtime_groups": [g["name"] for g in groups if g["numa_node"] == node["id"]],
                "pod_pool": sorted(set(node["cpus"]) & set(pod_pool)),
            }
            for node in record["numa_nodes"]
        ],
        "warnings": record.get("warnings", []),
    }


def _check_policy(policy):
    if not isinstance(policy, dict):
        raise PlanRecordError("policy is not an object")
    for key in ("isolate", "isolcpus_flags"):
        value = policy.get(key)
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise PlanRecordError("policy %s is not a list of names" % key)


def _check_group(group):
    if not isinstance(group, dict) or not {"name", "cpus"} <= set(group):
        raise PlanRecordError("a runtime group without name or cpus")
    if not isinstance(group["name"], str) or not GROUP_NAME.match(group["name"]):
        raise PlanRecordError("runtime group name %r is not [A-Za-z0-9_-]+" % group["name"])
    name = group["name"]
    _cpus(group["cpus"], "runtime group %s: cpus" % name)
    if "worker_cpus" in group:
        _cpus(group["worker_cpus"], "runtime group %s: worker_cpus" % name)
    for key in ("numa_node", "memory_node"):
        _int(group.get(key), "runtime group %s: %s" % (name, key))
    if "sampler_cpus" in group:
        _cpus(group["sampler_cpus"], "runtime group %s: sampler_cpus" % name)


def _check_node(node, schema):
    _int(node.get("id"), "a NUMA node's id")
    what = "NUMA node %s: " % node["id"]
    _int(node.get("memory_node"), what + "memory_node")
    if schema >= 2 or "cpus" in node:
        _cpus(node.get("cpus"), what + "cpus")
        return
    # Schema 1 kept the node's pieces, from which _nodes puts its CPUs together.
    _cpus(node.get("housekeeping"), what + "housekeeping")
    _cpus(node.get("pod_pool"), what + "pod_pool")
    names = node.get("runtime_groups")
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise PlanRecordError(what + "runtime_groups is not a list of names")


def check_plan(record):
    """The plan (:func:`expand`) of a record this collection reads; PlanRecordError."""
    if not isinstance(record, dict):
        raise PlanRecordError("the plan record is not a JSON object")
    schema = record.get("schema")
    if isinstance(schema, bool) or schema not in READABLE_SCHEMAS:
        raise PlanRecordError(
            "plan schema %s is not one this collection reads (%s): re-run the host step "
            "(playbooks/host.yml) with this collection to record the plan again"
            % (json.dumps(schema), ", ".join(str(s) for s in READABLE_SCHEMAS))
        )
    missing = [k for k in ("policy", *CPU_SETS, "runtime_groups", "numa_nodes") if k not in record]
    if missing:
        raise PlanRecordError("no %s in the plan record" % ", ".join(missing))
    _check_policy(record["policy"])
    for key in CPU_SETS:
        _cpus(record[key], key)
    if not isinstance(record["runtime_groups"], list):
        raise PlanRecordError("runtime_groups is not a list")
    for group in record["runtime_groups"]:
        _check_group(group)
    nodes = record["numa_nodes"]
    if not isinstance(nodes, list) or not all(isinstance(n, dict) for n in nodes):
        raise PlanRecordError("numa_nodes is not a list of nodes")
    for node in nodes:
        _check_node(node, schema)
    warnings = record.get("warnings", [])
    if not isinstance(warnings, list) or not all(isinstance(w, str) for w in warnings):
        raise PlanRecordError("warnings is not a list of strings")
    return expand(dict(record, numa_nodes=_nodes(record)))


def parse_plan(text):
    """The plan of a record's JSON text, checked (:func:`check_plan`)."""
    try:
        record = json.loads(text)
    except ValueError as exc:
        raise PlanRecordError("not JSON (%s)" % exc) from None
    return check_plan(record)
