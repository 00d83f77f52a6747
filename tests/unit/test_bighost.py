"""Big hosts end to end: topology -> plan -> kernel arguments -> kubelet configuration.

Generated server trees (tests/fixtures/shapes: a 2-socket 256-CPU EPYC with SMT and 16 CCX;
2-socket Genoa NPS4 with 8 CPU nodes plus 2 CPU-less CXL nodes; a two-socket Xeon whose
socket 0 has no DIMMs) and the captured real trees in tests/fixtures/sysfs, each checked for
properties the kernel and kubelet hold us to. (The host tuner against a fake /proc is
tested with the tuner.)
"""

from __future__ import annotations

import re
import tarfile
from pathlib import Path

import pytest

from rtfleet import kubelet, kubelet_values
from rtfleet.boot import compose_kernel_args, hugepage_runtime_settings
from rtfleet.cpulist import format_cpulist, parse_cpulist, parse_cpumask
from rtfleet.planner import check_invariants, plan_partition
from rtfleet.topology import read_topology

TESTS = Path(__file__).resolve().parents[1]
# A capture still being written (size 0) is not a tree yet.
CAPTURED = sorted(p for p in (TESTS / "fixtures" / "sysfs").glob("*.tar.gz") if p.stat().st_size)
GENERATED = ("epyc-7763-2s", "epyc-9354-2s-nps4-cxl", "xeon-2s-memoryless-node0")
MASK = re.compile(r"^[0-9a-f]{1,8}(,[0-9a-f]{8})*$")
CPULIST_ARGS = ("isolcpus", "nohz_full", "rcu_nocbs", "irqaffinity", "kthread_cpus")


def _policy(topology):
    """Runtime on half the L3 groups, so pods get the rest (the default takes them all)."""
    policy = {"runtime_l3_groups": max(1, len(topology["l3_groups"]) // 2)}
    if topology["virtualization"]["deception"]["deceptive"]:
        policy["allow_deceptive_topology"] = True  # the captured VMware-like lab guest
    return policy


@pytest.fixture(scope="module")
def machines(trees, tmp_path_factory):
    """name -> (topology, plan) for every generated and captured tree."""
    found = {}
    for name in GENERATED:
        found[name] = read_topology(str(trees(name)))
    for archive in CAPTURED:
        root = tmp_path_factory.mktemp(archive.name.split(".")[0])
        with tarfile.open(archive) as tar:
            tar.extractall(root, filter="data")
        found[archive.name] = read_topology(str(root))
    return {name: (topo, plan_partition(topo, _policy(topo))) for name, topo in found.items()}


ALL = list(GENERATED) + [p.name for p in CAPTURED]


def _check_mask(mask, cpus):
    assert MASK.match(mask), mask
    assert parse_cpumask(mask) == sorted(cpus)
    if cpus and max(cpus) >= 32:
        assert "," in mask  # one long word is what /proc/irq refuses past CPU 31
        assert len(mask.split(",")) == max(cpus) // 32 + 1


def _check_cpulist(text, cpus=None):
    assert format_cpulist(parse_cpulist(text, strict=True)) == text  # compact, kubelet-safe
    if cpus is not None:
        assert parse_cpulist(text) == sorted(cpus)


@pytest.mark.parametrize("name", ALL)
def test_plan_partitions_the_host_into_compact_disjoint_sets(machines, name):
    topology, plan = machines[name]
    check_invariants(topology, plan)
    online = set(topology["cpus"])
    hk, rt, pp = (set(plan[k]) for k in ("housekeeping", "runtime", "pod_pool"))
    assert not hk & rt and not hk & pp and not rt & pp
    assert hk | rt | pp == online
    for key, cpus in plan["cpulists"].items():
        _check_cpulist(cpus, plan[key])
    _check_mask(plan["irq_default_affinity_mask"], plan["housekeeping"])
    _check_mask(plan["irqbalance_banned_cpus_mask"], sorted(online - hk))
    l3_of = {c: g["id"] for g in topology["l3_groups"] for c in g["cpus"]}
    node_of = {c: n["id"] for n in topology["numa_nodes"] for c in n["cpus"]}
    with_memory = {n["id"] for n in topology["numa_nodes"] if n["has_memory"]}
    for group in plan["runtime_groups"]:
        assert len({l3_of[c] for c in group["cpus"]}) == 1, group["name"]
        assert len({node_of[c] for c in group["cpus"]}) == 1, group["name"]
        _check_cpulist(group["systemd"]["CPUAffinity"], group["cpus"])
        assert int(group["systemd"]["NUMAMask"]) in with_memory
    for node in topology["numa_nodes"]:
        if node["cpus"]:
            assert set(node["cpus"]) & hk, "node %d has no housekeeping" % node["id"]


@pytest.mark.parametrize("name", ALL)
def test_kernel_arguments_carry_the_plans_cpulists(machines, name):
    topology, plan = machines[name]
    args = compose_kernel_args(plan, topology, {"hugepages_per_node": 64})
    values = dict(a.split("=", 1) for a in args if "=" in a)
    isolated = values["isolcpus"].split(",", 1)[1]
    assert values["isolcpus"].startswith("managed_irq,")
    for key, text in (("isolcpus", isolated), *((k, values[k]) for k in CPULIST_ARGS[1:])):
        _check_cpulist(text)
        want = plan["housekeeping"] if key in ("irqaffinity", "kthread_cpus") else plan["isolated"]
        assert parse_cpulist(text) == want, key
    assert "hugepages" not in values  # 2M pages: rtfleet-host-tune allocates them per node
    spec = hugepage_runtime_settings(topology, "2M", 64)["per_node"]
    want_nodes = {n["id"] for n in topology["numa_nodes"] if n["cpus"] and n["has_memory"]}
    assert {int(n) for n in spec} == want_nodes  # no pages on memoryless or CXL nodes
    assert len(" ".join(args)) < 4096  # grubenv / COMMAND_LINE_SIZE headroom


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("version", ["1.31", "1.34", "1.35"])
def test_kubelet_config_builds_and_matches_the_plan(machines, name, version):
    topology, plan = machines[name]
    result = kubelet.build(plan, topology, {"kubelet_version": version})
    config = result["effective"]
    reserved = kubelet_values.parse_cpuset(config["reservedSystemCPUs"])
    # reserved = housekeeping + runtime (runtime CPUs are pinned units, never pods')
    assert reserved == sorted(set(plan["housekeeping"]) | set(plan["runtime"]))
    assert set(topology["cpus"]) - set(reserved) == set(plan["pod_pool"])
    _check_cpulist(config["reservedSystemCPUs"])
    visible = [n for n in topology["numa_nodes"] if n["online"]]
    assert {e["numaNode"] for e in config["reservedMemory"]} <= {
        n["id"] for n in visible if n["has_memory"]
    }
    if len(visible) > 8:
        assert config["topologyManagerPolicyOptions"]["max-allowable-numa-nodes"] == str(
            len(visible)
        )
    else:
        # kubelet's default (8) covers the host: the option is not written at all
        assert "max-allowable-numa-nodes" not in (config.get("topologyManagerPolicyOptions") or {})


def test_ten_nodes_with_cxl_need_kubelet_1_31(machines):
    topology, plan = machines["epyc-9354-2s-nps4-cxl"]
    assert len(topology["numa_nodes"]) == 10 and topology["cpuless_nodes"] == [8, 9]
    with pytest.raises(kubelet_values.KubeletConfigError, match=r"10 NUMA nodes \(CPU-less 8-9"):
        kubelet.build(plan, topology, {"kubelet_version": "1.30"})
    config = kubelet.build(plan, topology, {"kubelet_version": "1.31"})["config"]
    assert config["topologyManagerPolicyOptions"] == {"max-allowable-numa-nodes": "10"}
    assert config["featureGates"].get("TopologyManagerPolicyBetaOptions") is True
    config = kubelet.build(plan, topology, {"kubelet_version": "1.35"})["config"]
    assert config["topologyManagerPolicyOptions"] == {"max-allowable-numa-nodes": "10"}
    assert "TopologyManagerPolicyBetaOptions" not in config.get("featureGates", {})  # GA


def test_256_cpu_masks_have_eight_words(machines):
    topology, plan = machines["epyc-7763-2s"]
    assert len(topology["cpus"]) == 256 and len(topology["l3_groups"]) == 16
    assert len(plan["irqbalance_banned_cpus_mask"].split(",")) == 8
    assert plan["cpulists"]["housekeeping"] == "0,64,128,192"  # a core (both threads) per node


def test_memoryless_socket_runs_but_binds_memory_to_the_other_node(machines):
    topology, plan = machines["xeon-2s-memoryless-node0"]
    assert topology["memoryless_nodes"] == [0]
    on_node0 = [g for g in plan["runtime_groups"] if g["numa_node"] == 0]
    assert on_node0 and {g["systemd"]["NUMAMask"] for g in on_node0} == {"1"}
    assert [n["memory_node"] for n in plan["numa_nodes"]] == [1, 1]
    assert set(plan["numa_nodes"][0]["housekeeping"])  # node 0's IRQs still need a home
    pages = hugepage_runtime_settings(topology, "2M", {"0": 0, "1": 128})
    assert pages == {"size_kb": 2048, "per_node": {"0": 0, "1": 128}}
    with pytest.raises(ValueError, match="node 0 has no memory"):
        compose_kernel_args(plan, topology, {"hugepages_per_node": {"0": 16}})
    config = kubelet.build(plan, topology, {"kubelet_version": "1.34"})["config"]
    assert [e["numaNode"] for e in config["reservedMemory"]] == [1]
