"""Planner: invariants over generated topologies, policy errors, derived settings."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rtfleet.cpulist import format_cpulist, parse_cpulist
from rtfleet.planner import DEFAULT_POLICY, PlanError, check_invariants, plan_partition


def synth_topology(  # noqa: PLR0917 - a shape is many small knobs
    packages=1,
    nodes_per_package=1,
    l3_per_node=2,
    cores_per_l3=4,
    threads=1,
    l3_spans_nodes=False,
    intel_numbering=False,
    offline=(),
    deceptive=False,
):
    """A topology dict shaped like read_topology()'s, for planner-only tests.

    intel_numbering: sibling threads are numbered after all first threads (n, n + ncores),
    as on Intel and AMD hosts; otherwise siblings are adjacent (0,1), as on some ARM/POWER.
    l3_spans_nodes: one L3 per package shared by its nodes (Intel sub-NUMA clustering).
    """
    total_cores = packages * nodes_per_package * l3_per_node * cores_per_l3
    cores = []
    core_index = 0
    for pkg in range(packages):
        for n in range(nodes_per_package):
            node = pkg * nodes_per_package + n
            for l3 in range(l3_per_node):
                for _ in range(cores_per_l3):
                    if intel_numbering:
                        cpus = [core_index + t * total_cores for t in range(threads)]
                    else:
                        cpus = [core_index * threads + t for t in range(threads)]
                    cores.append({"cpus": cpus, "package": pkg, "numa_node": node, "l3": l3})
                    core_index += 1
    offline = set(offline)
    cores = [dict(c, cpus=[x for x in c["cpus"] if x not in offline]) for c in cores]
    cores = [c for c in cores if c["cpus"]]
    online = sorted(x for c in cores for x in c["cpus"])

    def key_l3(core):
        if l3_spans_nodes:
            return (core["package"], 0, 0)
        return (core["package"], core["numa_node"], core["l3"])

    l3_keys = sorted({key_l3(c) for c in cores})
    l3_groups = []
    for index, key in enumerate(l3_keys):
        members = [c for c in cores if key_l3(c) == key]
        cpus = sorted(x for c in members for x in c["cpus"])
        node_ids = sorted({c["numa_node"] for c in members})
        l3_groups.append(
            {
                "id": index,
                "cpus": cpus,
                "numa_node": node_ids[0] if len(node_ids) == 1 else None,
                "numa_nodes": node_ids,
                "package": key[0],
            }
        )
        for c in members:
            c["l3_group"] = index
    node_ids = sorted({c["numa_node"] for c in cores})
    numa_nodes = [
        {"id": n, "cpus": sorted(x for c in cores if c["numa_node"] == n for x in c["cpus"])}
        for n in node_ids
    ]
    pkgs = [
        {"id": p, "cpus": sorted(x for c in cores if c["package"] == p for x in c["cpus"])}
        for p in sorted({c["package"] for c in cores})
    ]
    return {
        "cpus": online,
        "packages": pkgs,
        "numa_nodes": numa_nodes,
        "l3_groups": l3_groups,
        "cores": [{"cpus": sorted(c["cpus"]), "l3_group": c["l3_group"]} for c in cores],
        "virtualization": {
            "deception": {"deceptive": deceptive, "evidence": ["88 sockets x 1 core"]}
        },
    }


def assert_derived_consistent(topology, plan):
    check_invariants(topology, plan)
    hk, rt, pp = set(plan["housekeeping"]), set(plan["runtime"]), set(plan["pod_pool"])
    reserved = set(parse_cpulist(plan["kubelet"]["reservedSystemCPUs"]))
    assert reserved == hk | rt
    assert not reserved & pp
    assert set(parse_cpulist(plan["irqbalance_banned_cpus"])) == set(topology["cpus"]) - hk
    args = dict(a.split("=", 1) for a in plan["kernel_args"])
    if plan["isolated"]:
        iso = args["isolcpus"].split(",", len(plan["policy"]["isolcpus_flags"]))[-1]
        assert parse_cpulist(iso) == plan["isolated"]
        assert parse_cpulist(args["nohz_full"]) == plan["isolated"]
        assert parse_cpulist(args["rcu_nocbs"]) == plan["isolated"]
        assert parse_cpulist(args["irqaffinity"]) == plan["housekeeping"]
        assert not set(plan["isolated"]) & hk
    for group in plan["runtime_groups"]:
        assert parse_cpulist(group["systemd"]["CPUAffinity"]) == group["cpus"]
        assert int(group["systemd"]["NUMAMask"]) == group["numa_node"]
    names = [g["name"] for g in plan["runtime_groups"]]
    assert len(names) == len(set(names))


# ---------------------------------------------------------------- examples


def test_epyc_like_two_ccx_two_nodes_default_policy():
    topo = synth_topology(nodes_per_package=2, l3_per_node=1, cores_per_l3=4)
    plan = plan_partition(topo)
    assert plan["housekeeping"] == [0, 4]
    assert [g["cpus"] for g in plan["runtime_groups"]] == [[1, 2, 3], [5, 6, 7]]
    assert plan["kernel_args"][0] == "isolcpus=managed_irq,1-3,5-7"
    assert plan["kubelet"]["reservedSystemCPUs"] == "0-7"
    assert_derived_consistent(topo, plan)


def test_whole_ccx_for_runtime_when_partial_goes_to_pods():
    # EPYC 7702P NPS1 shape: 16 CCX x 4 cores, SMT, siblings at n + 64.
    topo = synth_topology(l3_per_node=16, cores_per_l3=4, threads=2, intel_numbering=True)
    plan = plan_partition(topo, {"partial_l3_groups": "pod_pool", "runtime_l3_groups": 4})
    assert plan["housekeeping"] == [0, 64]
    assert plan["pod_pool"] == sorted([1, 2, 3, 65, 66, 67, *range(20, 64), *range(84, 128)])
    assert [g["cpulist"] for g in plan["runtime_groups"]] == [
        "4-7,68-71",
        "8-11,72-75",
        "12-15,76-79",
        "16-19,80-83",
    ]
    assert all(not g["partial_l3"] for g in plan["runtime_groups"])
    assert plan["kubelet"]["reservedSystemCPUs"] == "0,4-19,64,68-83"
    assert_derived_consistent(topo, plan)


def test_runtime_count_spreads_across_numa_nodes():
    topo = synth_topology(packages=2, l3_per_node=12, cores_per_l3=7)  # EPYC 9634 x2, SMT off
    plan = plan_partition(topo, {"runtime_l3_groups": 2, "partial_l3_groups": "pod_pool"})
    assert sorted(g["numa_node"] for g in plan["runtime_groups"]) == [0, 1]
    assert_derived_consistent(topo, plan)


def test_one_thread_per_core_keeps_siblings_reserved():
    topo = synth_topology(l3_per_node=2, cores_per_l3=2, threads=2)
    plan = plan_partition(topo, {"runtime_threads": "one_thread_per_core"})
    group = plan["runtime_groups"][-1]
    assert group["cpus"] == [4, 5, 6, 7]
    assert group["worker_cpus"] == [4, 6]
    assert_derived_consistent(topo, plan)


def test_l3_shared_by_two_numa_nodes_is_split_per_node():
    topo = synth_topology(nodes_per_package=2, l3_per_node=1, cores_per_l3=4, l3_spans_nodes=True)
    assert len(topo["l3_groups"]) == 1
    plan = plan_partition(topo)
    assert [g["name"] for g in plan["runtime_groups"]] == ["ccx0n0", "ccx0n1"]
    assert_derived_consistent(topo, plan)


def test_explicit_housekeeping_and_domain_flag():
    topo = synth_topology(nodes_per_package=2, l3_per_node=2, cores_per_l3=2, threads=2)
    plan = plan_partition(
        topo, {"housekeeping_cpus": "0-1,8-9", "isolcpus_flags": ["managed_irq", "domain"]}
    )
    assert plan["housekeeping"] == [0, 1, 8, 9]
    assert plan["kernel_args"][0].startswith("isolcpus=managed_irq,domain,")
    assert_derived_consistent(topo, plan)


def test_only_runtime_isolated_when_asked():
    topo = synth_topology(l3_per_node=3, cores_per_l3=2)
    plan = plan_partition(topo, {"runtime_l3_groups": [1], "isolate": ["runtime"]})
    assert plan["isolated"] == [2, 3]
    assert plan["pod_pool"] == [1, 4, 5]
    assert_derived_consistent(topo, plan)


# ---------------------------------------------------------------- bad policy


@pytest.mark.parametrize(
    ("policy", "message"),
    [
        ({"housekeeping_cpus": "0"}, "splits the SMT core 0-1"),
        ({"housekeeping_cpus": "0-1"}, "no CPU on NUMA node 1"),
        ({"housekeeping_cpus": "0-1,8-9,99"}, "not online"),
        ({"housekeeping_cpus": "7-3"}, "not a cpulist"),
        ({"housekeeping_cores_per_node": 4}, "leaving nothing"),
        ({"housekeeping_cores_per_node": 5}, "has only 4 cores"),
        ({"housekeeping_cores_per_node": 0}, "integer >= 1"),
        ({"runtime_l3_groups": 9}, "only"),
        ({"runtime_l3_groups": [7]}, "do not exist"),
        ({"runtime_l3_groups": [0], "housekeeping_cores_per_node": 2}, "wholly housekeeping"),
        ({"runtime_l3_groups": "some"}, "runtime_l3_groups must be"),
        ({"smt": "require_off"}, "disable SMT"),
        ({"smt": "maybe"}, "smt must be one of"),
        ({"isolate": "runtime"}, "isolate must be a list"),
        ({"isolcpus_flags": ["domian"]}, "isolcpus_flags must be a list drawn from"),
        ({"hosekeeping_cpus": "0-1"}, "unknown policy key 'hosekeeping_cpus'"),
        ({"group_name_prefix": "ccx-"}, "letters/digits"),
    ],
)
def test_impossible_policy_says_what_to_change(policy, message):
    topo = synth_topology(nodes_per_package=2, l3_per_node=2, cores_per_l3=2, threads=2)
    with pytest.raises(PlanError, match=message.replace("(", r"\(")):
        plan_partition(topo, policy)


def test_deceptive_vm_is_refused_with_its_evidence():
    topo = synth_topology(l3_per_node=8, cores_per_l3=1, deceptive=True)
    with pytest.raises(PlanError, match="88 sockets x 1 core"):
        plan_partition(topo)
    plan = plan_partition(topo, {"allow_deceptive_topology": True})
    assert_derived_consistent(topo, plan)


def test_default_policy_is_not_mutated():
    before = repr(DEFAULT_POLICY)
    plan_partition(synth_topology(), {"isolate": ["runtime"]})
    assert repr(DEFAULT_POLICY) == before


def test_check_invariants_catches_a_split_core():
    topo = synth_topology(l3_per_node=2, cores_per_l3=2, threads=2)
    plan = plan_partition(topo)
    plan["housekeeping"] = [*plan["housekeeping"], plan["runtime"][0]]
    plan["runtime"] = plan["runtime"][1:]
    with pytest.raises(PlanError, match=r"overlap|split|add up"):
        check_invariants(topo, plan)


# ---------------------------------------------------------------- properties

shapes = st.fixed_dictionaries(
    {
        "packages": st.integers(1, 2),
        "nodes_per_package": st.integers(1, 4),
        "l3_per_node": st.integers(1, 4),
        "cores_per_l3": st.integers(1, 8),
        "threads": st.integers(1, 2),
        "l3_spans_nodes": st.booleans(),
        "intel_numbering": st.booleans(),
    }
)
policies = st.fixed_dictionaries(
    {},
    optional={
        "housekeeping_cores_per_node": st.integers(1, 3),
        "runtime_l3_groups": st.one_of(
            st.sampled_from(["all", "none"]),
            st.integers(0, 6),
            st.lists(st.integers(0, 8), max_size=4),
        ),
        "partial_l3_groups": st.sampled_from(["runtime", "pod_pool"]),
        "runtime_min_cores": st.integers(1, 4),
        "runtime_threads": st.sampled_from(["all_threads", "one_thread_per_core"]),
        "isolate": st.sampled_from([["runtime", "pod_pool"], ["runtime"], ["pod_pool"], []]),
        "isolcpus_flags": st.sampled_from([["managed_irq"], ["managed_irq", "domain"], []]),
    },
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shape=shapes, policy=policies, offline_seed=st.integers(0, 2**16))
def test_plan_invariants_hold_or_policy_is_refused(shape, policy, offline_seed):
    topo = synth_topology(**shape)
    # Take a couple of CPUs offline (never all of a node) to exercise sparse numbering.
    if offline_seed % 3 == 0 and len(topo["cpus"]) > 4:
        victim = topo["cpus"][offline_seed % len(topo["cpus"])]
        topo = synth_topology(**shape, offline=[victim])
    try:
        plan = plan_partition(topo, policy)
    except PlanError as exc:
        assert str(exc)  # refused, with a message
        return
    assert_derived_consistent(topo, plan)
    for node in topo["numa_nodes"]:
        assert set(node["cpus"]) & set(plan["housekeeping"])


def test_cpulist_round_trip_edges():
    assert format_cpulist([]) == ""
    assert format_cpulist([3, 1, 2, 8, 10, 9]) == "1-3,8-10"
    assert parse_cpulist("0-3,8,10-15:2\x00\n") == [0, 1, 2, 3, 8, 10, 12, 14]


def test_memoryless_node_binds_runtime_memory_to_the_nearest_node_with_memory():
    """Node 0 has CPUs but no memory (a socket without DIMMs): its units bind node 1."""
    topology = synth_topology(packages=2, l3_per_node=2, cores_per_l3=4)
    node0, node1 = topology["numa_nodes"]
    node0.update(has_memory=False, memory_kb=0, memory_node=1)
    node1.update(has_memory=True, memory_kb=2**20, memory_node=1)
    topology["memoryless_nodes"] = [0]
    plan = plan_partition(topology)
    on_node0 = [g for g in plan["runtime_groups"] if g["numa_node"] == 0]
    assert on_node0 and all(g["memory_node"] == 1 for g in on_node0)
    assert {g["systemd"]["NUMAMask"] for g in on_node0} == {"1"}
    assert all(
        g["systemd"]["NUMAMask"] == "1" == str(g["memory_node"])
        for g in plan["runtime_groups"]
        if g["numa_node"] == 1
    )
    assert [n["memory_node"] for n in plan["numa_nodes"]] == [1, 1]
    assert any("node 0 has CPUs but no memory" in w for w in plan["warnings"])
    # A plan that binds memory to the memoryless node breaks an invariant.
    on_node0[0]["systemd"]["NUMAMask"] = "0"
    with pytest.raises(PlanError, match="binds memory to node 0, which has none"):
        check_invariants(topology, plan)


def test_nodes_with_memory_bind_their_own_node():
    plan = plan_partition(synth_topology(packages=2, nodes_per_package=2))
    assert all(
        str(g["memory_node"]) == g["systemd"]["NUMAMask"] == str(g["numa_node"])
        for g in plan["runtime_groups"]
    )


def test_samplers_go_to_the_pod_pool_of_their_units_node(tmp_path):
    """The smoke client (and a sampler pod) of a unit runs on a pod-pool CPU of the unit's
    NUMA node, never on a runtime or housekeeping CPU when the node has a pod pool."""
    import tarfile
    from pathlib import Path

    from rtfleet.topology import read_topology

    # Captured from the server-shaped lab host (lab/topologies/server-nps2.yml).
    archive = Path(__file__).resolve().parents[1] / "fixtures/sysfs/lab-server-nps2.tar.gz"
    with tarfile.open(archive) as tar:
        tar.extractall(tmp_path)
    topo = read_topology(str(tmp_path))
    plan = plan_partition(
        topo,
        {"partial_l3_groups": "pod_pool", "runtime_threads": "one_thread_per_core"},
    )
    node_cpus = {n["id"]: set(n["cpus"]) for n in topo["numa_nodes"]}
    assert len(plan["runtime_groups"]) == 4
    for group in plan["runtime_groups"]:
        assert group["sampler_cpus_from"] == "pod_pool_same_node"
        assert set(group["sampler_cpus"]) <= set(plan["pod_pool"]) & node_cpus[group["numa_node"]]
    # Without a pod pool the node's housekeeping CPUs are the fallback, and the plan says so.
    plan = plan_partition(topo, {"partial_l3_groups": "runtime"})
    assert {g["sampler_cpus_from"] for g in plan["runtime_groups"]} == {"housekeeping_same_node"}
