"""A sampler finds the unit nearest to its CPUs (shminfer.locality, `shminfer where`).

On generated server trees (2-socket 256-CPU EPYC with SMT; Genoa NPS4 with 8 CPU nodes and
2 CPU-less CXL memory nodes; a Xeon whose socket 0 has no memory) the units are the plan's
runtime groups and the callers the plan's sampler CPUs, as the runtime role and the pod
manifests place them; then real servers on this machine, found through their registries.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tarfile
from pathlib import Path

import pytest
from shminfer_serving import CPUS, serving

from rtfleet.planner import plan_partition
from rtfleet.topology import read_topology
from shminfer import cli
from shminfer.client import Client
from shminfer.locality import NEAREST, SAME_L3, SAME_NODE, choose_unit, running_units, where
from shminfer.queue import QueueError
from shminfer.registry import make_unit_dir, registry_path, run_dir, unit_dir

BIG = ("epyc-7763-2s", "epyc-9354-2s-nps4-cxl", "xeon-2s-memoryless-node0")
# The server-shaped lab guest's captured tree, with the lab inventory's policy for it
# (inventory/lab/group_vars/server_nps2.yml).
LAB = Path(__file__).resolve().parents[1] / "fixtures/sysfs/lab-server-nps2.tar.gz"
LAB_POLICY = {
    "housekeeping_cores_per_node": 1,
    "runtime_l3_groups": "all",
    "partial_l3_groups": "pod_pool",
    "runtime_threads": "one_thread_per_core",
}


def _units(plan):
    return [{"name": g["name"], "cpus": g["worker_cpus"]} for g in plan["runtime_groups"]]


def _node_of(topology):
    return {cpu: n["id"] for n in topology["numa_nodes"] for cpu in n["cpus"]}


@pytest.fixture(scope="module")
def hosts(trees, tmp_path_factory):
    """shape -> (topology, plan): the runtime on half the L3 groups, the pods on the rest;
    and the lab's server-shaped guest as the lab plans it."""
    found = {}
    for shape in BIG:
        topology = read_topology(str(trees(shape)))
        policy = {"runtime_l3_groups": max(1, len(topology["l3_groups"]) // 2)}
        found[shape] = (topology, plan_partition(topology, policy))
    root = tmp_path_factory.mktemp("lab-server-nps2")
    with tarfile.open(LAB) as tar:
        tar.extractall(root, filter="data")
    topology = read_topology(str(root))
    found["lab-server-nps2"] = (topology, plan_partition(topology, LAB_POLICY))
    return found


@pytest.mark.parametrize("shape", [*BIG, "lab-server-nps2"])
def test_every_sampler_of_the_plan_gets_a_unit_on_its_own_node(hosts, shape):
    topology, plan = hosts[shape]
    node_of = _node_of(topology)
    units = _units(plan)
    assert len(topology["cpus"]) >= 48 and len(units) >= 1
    for group in plan["runtime_groups"]:
        for cpu in group["sampler_cpus"]:
            choice = choose_unit(units, [cpu], topology)
            assert choice.unit_node == node_of[cpu], choice.reason
            assert choice.rule in (SAME_L3, SAME_NODE), choice.reason
            chosen = next(g for g in plan["runtime_groups"] if g["name"] == choice.name)
            assert node_of[chosen["worker_cpus"][0]] == node_of[cpu]
            # The pod-pool CPUs of a partial L3 group share it with their unit.
            if group.get("partial_l3") and cpu in next(
                g["cpus"] for g in topology["l3_groups"] if g["id"] == group["l3_group"]
            ):
                assert choice.rule == SAME_L3


def test_a_node_without_units_goes_to_the_nearest_node_and_says_so(hosts):
    # Genoa NPS4 with the runtime on 4 CCDs: the plan puts them on socket 0's nodes (0-3),
    # so a caller on socket 1 (nodes 4-7, distance 32 from socket 0) has no unit of its own.
    topology, _plan = hosts["epyc-9354-2s-nps4-cxl"]
    plan = plan_partition(topology, {"runtime_l3_groups": 4})
    node_of = _node_of(topology)
    units = _units(plan)
    unit_nodes = {node_of[u["cpus"][0]] for u in units}
    remote = [cpu for cpu in plan["pod_pool"] if node_of[cpu] not in unit_nodes]
    assert remote, "the plan left no node without a unit"
    choice = choose_unit(units, [remote[0]], topology)
    assert choice.rule == NEAREST and not choice.local
    caller_row = dict(
        next(n for n in topology["numa_nodes"] if n["id"] == choice.caller_node)["distances"]
    )
    assert choice.distance == min(caller_row[n] for n in unit_nodes)
    assert "crosses the interconnect" in choice.reason
    assert f"no unit on NUMA node {choice.caller_node}" in choice.reason
    # The CPU-less CXL nodes (8, 9) are never a unit's node.
    assert choice.unit_node not in topology["cpuless_nodes"]
    # Callers on that node spread over the equally near units instead of all taking one.
    picks = {choose_unit(units, [cpu], topology).name for cpu in remote[:16]}
    assert len(picks) > 1


def test_a_memoryless_node_keeps_its_samplers_on_its_own_cpus_units(hosts):
    # Socket 0 has no DIMMs: its units' memory lives on node 1, but their CPUs (and the
    # caller's cache lines) are on node 0, so node 0's callers stay with node 0's units.
    topology, plan = hosts["xeon-2s-memoryless-node0"]
    assert 0 in topology["memoryless_nodes"]
    node_of = _node_of(topology)
    units = _units(plan)
    on_zero = [g for g in plan["runtime_groups"] if node_of[g["worker_cpus"][0]] == 0]
    assert on_zero and all(g["memory_node"] != 0 for g in on_zero)
    # (The plan gives node 0's L3 group to the runtime; its housekeeping CPU is a caller.)
    caller = next(c for c in plan["housekeeping"] if node_of[c] == 0)
    choice = choose_unit(units, [caller], topology)
    assert choice.unit_node == 0 and choice.local


def test_a_caller_spanning_nodes_belongs_to_the_node_of_most_of_its_cpus(hosts):
    topology, plan = hosts["epyc-7763-2s"]
    node_of = _node_of(topology)
    units = _units(plan)
    by_node = {}
    for cpu in plan["pod_pool"]:
        by_node.setdefault(node_of[cpu], []).append(cpu)
    first, second = sorted(by_node)[:2]
    caller = by_node[first][:1] + by_node[second][:3]
    assert choose_unit(units, caller, topology).caller_node == second


def test_bad_input_is_one_clear_error(hosts):
    topology, plan = hosts["epyc-7763-2s"]
    with pytest.raises(QueueError, match="no running shminfer unit of this host's CPUs"):
        choose_unit([], [0], topology)
    with pytest.raises(QueueError, match="not in this host's topology"):
        choose_unit(_units(plan), [100000], topology)
    with pytest.raises(QueueError, match="no CPUs"):
        choose_unit(_units(plan), [], topology)
    # A registry of CPUs this host does not have is no candidate.
    with pytest.raises(QueueError, match="no running shminfer unit"):
        choose_unit([{"name": "ghost", "cpus": [100000]}], [0], topology)


# --------------------------------------------------------------------- real servers


def test_real_servers_are_found_through_their_registries_and_the_nearest_is_used(caplog):
    prefix = "loc%d" % os.getpid()
    with (
        serving(name=prefix + "a", cpus=CPUS[:1]) as first,
        serving(name=prefix + "b", cpus=CPUS[-1:]) as second,
    ):
        found = {u["name"]: u["cpus"] for u in running_units(prefix + "*")}
        assert found == {first.name: first.cpus, second.name: second.cpus}
        # This machine: every CPU on node 0 and one L3 group, so both are local; the
        # caller's first CPU spreads callers over them.
        choice = where([CPUS[-1]], match=prefix + "*")
        assert choice.local and choice.name in found
        with caplog.at_level(logging.WARNING, logger="shminfer"):
            client = Client.nearest(cpus=[CPUS[0]], match=prefix + "*", timeout=30)
        try:
            assert client.choice.local and not caplog.records
            out = client.infer({"x": __import__("numpy").arange(4, dtype="float32")})
            assert out
        finally:
            client.close()


def test_scribbled_or_foreign_registries_are_skipped_not_fatal(tmp_path):
    """What a crashed server, a peer or a hand left in the run directory: bad JSON, a pid
    that is no number, workers naming files that are not the server's, a registry that is
    a symlink, a directory that is a symlink or a stranger's, a name no server could have.
    where() skips them and still finds the live unit."""
    prefix = "loc%dh" % os.getpid()
    target = tmp_path / "elsewhere.json"
    target.write_text('{"pid": 1, "workers": []}')
    scribbled = {
        prefix + "json": "{not json",
        prefix + "pid": json.dumps({"pid": "x", "pid_start": 1, "workers": []}),
        prefix + "foreign": json.dumps(
            {"pid": os.getpid(), "workers": [{"cpu": 0, "segment": "/etc/passwd"}]}
        ),
        prefix + "dead": json.dumps(
            {
                "pid": 2**22 + 7,
                "pid_start": 1,
                "workers": [{"cpu": 0, "segment": "shminfer.%sdead.cpu0" % prefix}],
            }
        ),
    }
    dirs = [Path(unit_dir(name)) for name in [*scribbled, prefix + "link", prefix + "dirlink"]]
    try:
        for name, text in scribbled.items():
            make_unit_dir(name)
            Path(registry_path(name)).write_text(text)
        make_unit_dir(prefix + "link")
        Path(registry_path(prefix + "link")).symlink_to(target)
        Path(unit_dir(prefix + "dirlink")).symlink_to(tmp_path)
        odd = Path(run_dir(), prefix + ".x")  # not a name check_name accepts
        odd.mkdir()
        dirs.append(odd)
        Path(odd, "registry.json").write_text("{}")
        if os.geteuid() == 0:  # a stranger's directory with a copy of a live registry
            stranger = Path(unit_dir(prefix + "stranger"))
            stranger.mkdir()
            dirs.append(stranger)
            os.chown(stranger, 65534, 65534)
        with serving(name=prefix + "live", cpus=CPUS[-1:]):
            skipped = []
            live = running_units(prefix + "*", skipped=skipped)
            assert [u["name"] for u in live] == [prefix + "live"]
            assert where([CPUS[0]], match=prefix + "*").name == prefix + "live"
            reasons = dict(skipped)
            assert "not a directory" in reasons[prefix + "dirlink"]
            assert "symlink" in reasons[prefix + "link"]
            if os.geteuid() == 0:
                assert "not a trusted server user" in reasons[prefix + "stranger"]
    finally:
        for path in dirs:
            if path.is_symlink():
                path.unlink()
            else:
                shutil.rmtree(path, ignore_errors=True)


def test_where_prints_the_unit_and_why(capsys):
    name = "loc%dw" % os.getpid()
    with serving(name=name, cpus=CPUS[-1:]):
        assert cli.main(["where", "--cpus", str(CPUS[0]), "--match", name]) == 0
        text = capsys.readouterr().out
        assert text.startswith(f"unit: {name}\nwhy: CPUs {CPUS[0]} ")
        assert cli.main(["where", "--match", name, "--format", "json"]) == 0
        answer = json.loads(capsys.readouterr().out)
        assert answer["unit"] == name and answer["local"] is True
        assert answer["caller_cpus"] == sorted(os.sched_getaffinity(0))
    # Stopped: its directory stays (systemd removes a unit's), its registry is gone.
    assert cli.main(["where", "--match", name]) == 2
    assert f"no running shminfer unit matching '{name}' in " in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["where", "--cpus", "3-1"], "--cpus"),
        (["where", "--format", "yaml"], "invalid choice"),
        (["bench", "ray", "--requests", "0"], "--requests must be 1..100000000, got 0"),
        (["bench", "ipc", "--requests", "x"], "--requests takes an integer, got 'x'"),
    ],
)
def test_bad_flags_are_one_line_before_anything_runs(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err
