"""Kubelet configuration: rendering from the plan, kubelet's own validation rules, the
checkpoint-reset decision, and the rtfleet_kubelet role run by ansible-playbook on
localhost against generated sysfs trees, with a temporary directory as kubelet's files.

The invalid cases follow kubelet's validation tests (pkg/kubelet/apis/config/validation/
validation_test.go, validation_reserved_memory_test.go) and the CPU / Topology / Memory
Manager constructors that refuse a configuration at kubelet start.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import pytest
import yaml
from conftest import REPO

from rtfleet import kubelet, kubelet_state, kubelet_validate, kubelet_values
from rtfleet.plan_record import to_record
from rtfleet.planner import plan_partition
from rtfleet.topology import read_topology


@pytest.fixture(scope="module")
def epyc(trees):
    """EPYC 7702P NPS4: 64 cores, no SMT, 16 CCX on 4 NUMA nodes."""
    topology = read_topology(str(trees("epyc-7702p-nps4")))
    return topology, plan_partition(topology, {"runtime_l3_groups": 8})


@pytest.fixture(scope="module")
def xeon(trees):
    """Dual Xeon 8380 with SMT: 80 cores / 160 threads, siblings n and n+80."""
    topology = read_topology(str(trees("xeon-2s-smt")))
    return topology, plan_partition(topology, {"runtime_l3_groups": 1})


def _build(machine, **settings):
    topology, plan = machine
    settings.setdefault("kubelet_version", "1.34")
    return kubelet.build(plan, topology, settings)


def _errors(machine, extra=None, **settings):
    """Validation errors of the effective config (extra keys merged last)."""
    topology, plan = machine
    settings.setdefault("kubelet_version", "1.34")
    if extra is not None:
        settings["extra"] = extra
    normalized = kubelet.normalize_settings(settings)
    try:
        config, _ = kubelet.render(plan, topology, normalized)
    except (
        kubelet_values.KubeletConfigError
    ) as exc:  # refused while rendering (reservedMemory auto)
        return [str(exc)]
    return kubelet_validate.validate(config, topology, normalized, plan)


# ------------------------------------------------------------------ rendering


def test_render_reserves_housekeeping_and_runtime_and_splits_memory(epyc):
    _topology, plan = epyc
    result = _build(epyc)
    config = result["config"]
    assert result["dropin"] and not result["warnings"]
    assert config["apiVersion"] == "kubelet.config.k8s.io/v1beta1"
    assert config["kind"] == "KubeletConfiguration"
    assert config["cpuManagerPolicy"] == "static"
    assert config["reservedSystemCPUs"] == plan["kubelet"]["reservedSystemCPUs"]
    reserved = set(kubelet_values.parse_cpuset(config["reservedSystemCPUs"]))
    assert reserved == set(plan["housekeeping"]) | set(plan["runtime"])
    assert not reserved & set(plan["pod_pool"])
    assert config["topologyManagerPolicy"] == "single-numa-node"
    assert config["memoryManagerPolicy"] == "Static"
    # 512Mi + 512Mi + 100Mi over 4 nodes: 281Mi each, and the sum is exact.
    assert config["reservedMemory"] == [
        {"numaNode": n, "limits": {"memory": "281Mi"}} for n in range(4)
    ]
    assert "max-allowable-numa-nodes" not in config.get("topologyManagerPolicyOptions", {})


@pytest.mark.parametrize(
    ("version", "options", "gates", "dropin"),
    [
        (
            "1.27",
            ["full-pcpus-only"],
            {"CPUManagerPolicyOptions": True, "CPUManagerPolicyBetaOptions": True},
            False,
        ),
        (
            "1.29",
            ["full-pcpus-only"],
            {"CPUManagerPolicyOptions": True, "CPUManagerPolicyBetaOptions": True},
            False,
        ),
        (
            "1.31",
            ["full-pcpus-only"],
            {"CPUManagerPolicyOptions": True, "CPUManagerPolicyBetaOptions": True},
            True,
        ),
        (
            "1.33",
            ["full-pcpus-only", "strict-cpu-reservation"],
            {"CPUManagerPolicyBetaOptions": True},
            True,
        ),
        (
            "v1.34.2",
            ["full-pcpus-only", "prefer-align-cpus-by-uncorecache", "strict-cpu-reservation"],
            {"CPUManagerPolicyBetaOptions": True},
            True,
        ),
        (
            "1.36",
            ["full-pcpus-only", "prefer-align-cpus-by-uncorecache", "strict-cpu-reservation"],
            None,
            True,
        ),
    ],
)
def test_recommended_options_and_gates_follow_the_kubelet_version(
    epyc, version, options, gates, dropin
):
    result = _build(epyc, kubelet_version=version)
    assert sorted(result["config"]["cpuManagerPolicyOptions"]) == options
    assert result["config"].get("featureGates") == gates
    assert result["dropin"] is dropin


def test_old_kubelet_warns_that_reserved_cpus_are_shared(epyc):
    warnings = _build(epyc, kubelet_version="1.31")["warnings"]
    assert any("strict-cpu-reservation is off" in w for w in warnings)


def test_explicit_options_win_and_conflicting_recommendations_are_left_out(epyc):
    config = _build(
        epyc,
        cpu_manager_policy_options={"full-pcpus-only": False, "distribute-cpus-across-numa": True},
        topology_manager_policy="restricted",
    )["config"]
    assert config["cpuManagerPolicyOptions"] == {
        "full-pcpus-only": "false",  # YAML false becomes the string kubelet's map wants
        "distribute-cpus-across-numa": "true",
        "strict-cpu-reservation": "true",
    }


def test_alpha_option_needs_consent_and_then_turns_on_its_gate(epyc):
    settings = {"cpu_manager_policy_options": {"align-by-socket": "true"}}
    settings["topology_manager_policy"] = "restricted"
    with pytest.raises(
        kubelet_values.KubeletConfigError, match="rtfleet_kubelet_allow_alpha_options"
    ):
        _build(epyc, **settings)
    config = _build(epyc, allow_alpha_options=True, **settings)["config"]
    assert config["featureGates"]["CPUManagerPolicyAlphaOptions"] is True


def test_extra_keys_are_merged_last(epyc):
    config = _build(
        epyc,
        extra={"maxPods": 50, "evictionHard": {"nodefs.available": "5%"}},
        reserved_memory="auto",
    )["config"]
    assert config["maxPods"] == 50
    assert config["evictionHard"] == {"memory.available": "100Mi", "nodefs.available": "5%"}


def test_more_than_eight_numa_nodes_gets_max_allowable_numa_nodes(epyc):
    topology, plan = epyc
    big = copy.deepcopy(topology)
    big["numa_nodes"] = [
        {"id": i, "cpus": [i * 4 + c for c in range(4)], "memory_kb": 2**20} for i in range(16)
    ]
    config, _ = kubelet.render(plan, big, kubelet.normalize_settings({"kubelet_version": "1.34"}))
    assert config["topologyManagerPolicyOptions"] == {"max-allowable-numa-nodes": "16"}
    assert len(config["reservedMemory"]) == 16
    settings = kubelet.normalize_settings({"kubelet_version": "1.30"})
    config, _ = kubelet.render(plan, big, settings)
    errors = kubelet_validate.validate(config, big, settings, plan)
    assert any("upgrade kubelet" in e and "16 NUMA nodes" in e for e in errors)


def test_main_file_mode_merges_into_the_main_config(epyc):
    result = _build(
        epyc,
        kubelet_version="1.29",
    )
    assert not result["dropin"]
    topology, plan = epyc
    base = {"apiVersion": "kubelet.config.k8s.io/v1beta1", "cgroupDriver": "systemd"}
    result = kubelet.build(plan, topology, {"kubelet_version": "1.29"}, base_config=base)
    assert result["config"]["cgroupDriver"] == "systemd"
    assert result["config"]["cpuManagerPolicy"] == "static"


def test_dropin_mode_is_refused_before_1_28(epyc):
    with pytest.raises(kubelet_values.KubeletConfigError, match=r"needs kubelet >= 1\.28"):
        _build(epyc, kubelet_version="1.27", config_mode="dropin")
    assert any(
        "KUBELET_CONFIG_DROPIN_DIR_ALPHA" in w
        for w in _build(epyc, kubelet_version="1.28", config_mode="dropin")["warnings"]
    )


def test_dump_is_commented_json_that_yaml_and_load_read_back(epyc):
    config = _build(epyc)["config"]
    text = kubelet.dump(config, "Managed by rtfleet (role rtfleet_kubelet).\nSecond line.")
    assert text.startswith("# Managed by rtfleet (role rtfleet_kubelet).\n# Second line.\n{")
    assert yaml.safe_load(text) == config == kubelet.load(text)
    # Option values stay strings through YAML (kubelet's map[string]string needs that).
    assert yaml.safe_load(text)["cpuManagerPolicyOptions"]["full-pcpus-only"] == "true"


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("1Gi", 2**30),
        ("512Mi", 512 * 2**20),
        ("1G", 10**9),
        ("1e3", 1000),
        ("1.5Gi", 3 * 2**29),
        (1024, 1024),
        ("100m", Fraction(1, 10)),
    ],
)
def test_quantities(text, value):
    assert kubelet_values.parse_quantity(text) == value


@pytest.mark.parametrize("text", ["", "1GB", "Gi", "1 Gi", "one"])
def test_bad_quantities(text):
    with pytest.raises(ValueError):
        kubelet_values.parse_quantity(text)


# ------------------------------------------------------------------ validation


@pytest.mark.parametrize(
    ("settings", "extra", "message"),
    [
        # kubelet validation_test.go: invalid topology manager policy / scope
        (
            {},
            {"topologyManagerPolicy": "invalid-policy"},
            "topologyManagerPolicy 'invalid-policy' must be one of",
        ),
        (
            {},
            {"topologyManagerScope": "invalid-scope"},
            "topologyManagerScope 'invalid-scope' must be one of",
        ),
        # reservedSystemCPUs: unparseable, and not together with the reserved cgroups
        ({"reserved_system_cpus": "0-"}, None, "unable to parse reservedSystemCPUs"),
        ({"reserved_system_cpus": "a"}, None, "unable to parse reservedSystemCPUs"),
        (
            {},
            {"systemReservedCgroup": "/system.slice"},
            "can't use reservedSystemCPUs with systemReservedCgroup",
        ),
        (
            {},
            {"kubeReservedCgroup": "/kube.slice"},
            "can't use reservedSystemCPUs with systemReservedCgroup",
        ),
        # validation_reserved_memory_test.go
        (
            {"reserved_memory": [{"numaNode": 0, "limits": {"cpu": "1"}}]},
            None,
            "the limit type 'cpu' for NUMA node 0 is not supported",
        ),
        (
            {"reserved_memory": [{"numaNode": 0, "limits": {"memory": "0"}}]},
            None,
            "reserved memory may not be zero for NUMA node 0",
        ),
        (
            {
                "reserved_memory": [
                    {"numaNode": 0, "limits": {"memory": "562Mi"}},
                    {"numaNode": 0, "limits": {"memory": "562Mi"}},
                ]
            },
            None,
            "duplicate value for NUMA node 0 and resource 'memory'",
        ),
        # memory manager: nodes that exist, sums equal to kube + system + hard eviction
        (
            {"reserved_memory": [{"numaNode": 9, "limits": {"memory": "1124Mi"}}]},
            None,
            "references a NUMA node 9 that does not exist",
        ),
        (
            {"reserved_memory": [{"numaNode": 0, "limits": {"memory": "1Gi"}}]},
            None,
            "adds up to 1Gi over the NUMA nodes, but kubeReserved + systemReserved + evictionHard",
        ),
        ({"eviction_hard": {"memory.available": "5%"}}, None, "a percentage"),
        (
            {"kube_reserved": {"memory": "1Gi", "hugepages-2Mi": "3Mi"}},
            None,
            "not a whole number of pages",
        ),
        (
            {
                "kube_reserved": {},
                "system_reserved": {},
                "eviction_hard": {"memory.available": "0"},
            },
            None,
            "needs a memory reservation",
        ),
        ({"memory_manager_policy": "static"}, None, "note the capital letter"),
        # CPU manager: policy, options per version, values, conflicts
        ({}, {"cpuManagerPolicy": "none"}, "rtfleet needs static"),
        ({}, {"cpuManagerPolicy": "dynamic"}, "is not a kubelet CPU Manager policy"),
        ({"cpu_manager_policy_options": {"no-such-option": "true"}}, None, "unknown option"),
        (
            {
                "kubelet_version": "1.31",
                "cpu_manager_policy_options": {"prefer-align-cpus-by-uncorecache": "true"},
            },
            None,
            "appeared in 1.32",
        ),
        ({"cpu_manager_policy_options": {"full-pcpus-only": "yes"}}, None, 'use "true" or "false"'),
        (
            {
                "cpu_manager_policy_options": {
                    "distribute-cpus-across-numa": "true",
                    "prefer-align-cpus-by-uncorecache": "true",
                }
            },
            None,
            "prefer-align-cpus-by-uncorecache and distribute-cpus-across-numa can not be used",
        ),
        (
            {
                "allow_alpha_options": True,
                "cpu_manager_policy_options": {
                    "full-pcpus-only": "true",
                    "distribute-cpus-across-cores": "true",
                },
            },
            None,
            "full-pcpus-only and distribute-cpus-across-cores can not be used at the same time",
        ),
        (
            {
                "allow_alpha_options": True,
                "cpu_manager_policy_options": {"align-by-socket": "true"},
            },
            None,
            "align-by-socket is incompatible with topologyManagerPolicy single-numa-node",
        ),
        (
            {"kubelet_version": "1.31", "feature_gates": {"CPUManagerPolicyBetaOptions": False}},
            None,
            "needs featureGates.CPUManagerPolicyBetaOptions: true",
        ),
        ({"cpu_manager_reconcile_period": "10 seconds"}, None, "is not a duration"),
        ({"cpu_manager_reconcile_period": "0s"}, None, "must be greater than zero"),
        ({"kube_reserved": {"memory": "512Mi", "cpu": "1"}}, None, "kubeReserved.cpu is set"),
        # Topology manager options
        (
            {"topology_manager_policy_options": {"max-allowable-numa-nodes": "4"}},
            None,
            "wants at least 8",
        ),
        (
            {"topology_manager_policy_options": {"max-allowable-numa-nodes": "many"}},
            None,
            "is not an integer",
        ),
        (
            {
                "kubelet_version": "1.30",
                "topology_manager_policy_options": {"max-allowable-numa-nodes": "8"},
            },
            None,
            "appeared in 1.31",
        ),
        (
            {
                "kubelet_version": "1.27",
                "topology_manager_policy_options": {"prefer-closest-numa-nodes": "true"},
            },
            None,
            "is alpha in kubelet 1.27",
        ),
        ({"kubelet_version": "1.25"}, None, "older than rtfleet supports"),
        ({"feature_gates": {"Foo": "yes"}}, None, "featureGates.Foo must be true or false"),
    ],
)
def test_invalid_configurations_are_refused_with_what_to_change(epyc, settings, extra, message):
    errors = _errors(epyc, extra, **settings)
    assert any(message in e for e in errors), errors


def test_reserved_cpus_must_exist_and_cover_the_runtime(epyc):
    errors = _errors(epyc, reserved_system_cpus="0-3,200")
    assert any("CPUs 200 that this host does not have online" in e for e in errors)
    assert any("leaves runtime CPUs" in e for e in errors)


def test_full_pcpus_only_needs_whole_reserved_cores(xeon):
    _topology, plan = xeon
    assert not _errors(xeon)  # the plan reserves whole cores
    hk = plan["housekeeping"]
    half = ",".join(str(c) for c in sorted(set(plan["runtime"]) | set(hk[: len(hk) // 2])))
    errors = _errors(xeon, reserved_system_cpus=half)
    assert any("splits SMT cores" in e for e in errors), errors
    assert not any(
        "splits SMT cores" in e
        for e in _errors(
            xeon, reserved_system_cpus=half, cpu_manager_policy_options={"full-pcpus-only": "false"}
        )
    )


def test_build_reports_every_problem_at_once(epyc):
    with pytest.raises(kubelet_values.KubeletConfigError) as failure:
        _build(epyc, topology_manager_policy="bogus", reserved_system_cpus="0-")
    assert "2 problems" in str(failure.value) and "nothing was changed" in str(failure.value)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"no_such_setting": 1}, "unknown kubelet setting 'no_such_setting'"),
        ({"kubelet_version": "latest"}, 'kubelet_version must look like "1.31"'),
        ({"config_mode": "both"}, "config_mode must be auto, dropin or main"),
        ({"kube_reserved": "1Gi"}, "kube_reserved must be a mapping"),
        ({"reserved_memory": "half"}, 'reserved_memory must be "auto" or a list'),
    ],
)
def test_bad_settings_are_named(epyc, settings, message):
    with pytest.raises(kubelet_values.KubeletConfigError, match=message):
        _build(epyc, **settings)


def test_a_kubelet_without_the_config_dir_is_reported():
    conf_d = "/etc/kubernetes/kubelet.conf.d"
    assert (
        kubelet_state.dropin_warning(["/usr/bin/kubelet", "--config-dir=" + conf_d + "/"], conf_d)
        is None
    )
    assert kubelet_state.dropin_warning(["kubelet", "--config-dir", conf_d], conf_d) is None
    assert "has no --config-dir" in kubelet_state.dropin_warning(["kubelet", "--config=/x"], conf_d)
    assert "reads --config-dir=/other" in kubelet_state.dropin_warning(
        ["kubelet", "--config-dir=/other"], conf_d
    )


# ------------------------------------------------------------------ checkpoints


def _state(policy):
    return json.dumps({"policyName": policy, "checksum": 1})


def test_checkpoint_reset_only_when_policy_reserved_set_or_options_change(epyc):
    new = _build(epyc)["effective"]
    same = kubelet_state.state_reset(new, new, _state("static"), _state("Static"))
    assert not same["cpu_manager_state"]["reset"] and not same["memory_manager_state"]["reset"]
    topology_only = dict(new, topologyManagerPolicy="restricted")
    assert not kubelet_state.state_reset(topology_only, new, _state("static"), None)[
        "cpu_manager_state"
    ]["reset"]
    for change in (
        {"cpuManagerPolicy": "none"},
        {"reservedSystemCPUs": "0-3"},
        {"cpuManagerPolicyOptions": {"full-pcpus-only": "true"}},
    ):
        decision = kubelet_state.state_reset(
            dict(new, **change), new, _state("static"), _state("Static")
        )
        assert decision["cpu_manager_state"]["reset"], change
        assert not decision["memory_manager_state"]["reset"], change
    memory = kubelet_state.state_reset(
        dict(new, reservedMemory=[]), new, _state("static"), _state("Static")
    )
    assert memory["memory_manager_state"]["reset"] and not memory["cpu_manager_state"]["reset"]


def test_reserved_set_is_compared_as_a_set(epyc):
    new = _build(epyc)["effective"]
    spelled = ",".join(str(c) for c in kubelet_values.parse_cpuset(new["reservedSystemCPUs"]))
    decision = kubelet_state.state_reset(
        dict(new, reservedSystemCPUs=spelled), new, _state("static")
    )
    assert not decision["cpu_manager_state"]["reset"]


def test_absent_checkpoints_never_need_a_reset_and_stale_ones_always_do(epyc):
    new = _build(epyc)["effective"]
    assert kubelet_state.state_reset(None, new)["cpu_manager_state"] == {
        "exists": False,
        "reset": False,
        "reasons": [],
    }
    stale = kubelet_state.state_reset(new, new, _state("none"))["cpu_manager_state"]
    assert stale["reset"] and "records policy 'none'" in stale["reasons"][0]
    assert kubelet_state.state_reset(None, new, _state("static"))["cpu_manager_state"]["reset"]
    assert kubelet_state.state_reset(new, new, "not json")["cpu_manager_state"]["reset"]


# ------------------------------------------------------------------ the role on localhost


def _run_role(tmp_path, root, *args, plan=True, tasks_from=None, **role_vars):
    kube = tmp_path / "kube"
    plan_file = tmp_path / "etc-rtfleet/plan.json"
    if plan and not plan_file.exists():
        # The host role's record (rtfleet_host's one plan task, or `rtfleet plan`).
        plan_file.parent.mkdir(parents=True, exist_ok=True)
        policy = {"runtime_l3_groups": 8}
        plan_file.write_text(
            json.dumps(to_record(plan_partition(read_topology(str(root)), policy)))
        )
    role_vars = {
        "rtfleet_host_plan_file": str(plan_file),
        "rtfleet_kubelet_sysfs_root": str(root),
        "rtfleet_kubelet_config_dir": str(kube / "etc/kubelet.conf.d"),
        "rtfleet_kubelet_main_config": str(kube / "var/config.yaml"),
        "rtfleet_kubelet_state_dir": str(kube / "var"),
        "rtfleet_kubelet_backup_dir": str(kube / "backups"),
        "rtfleet_kubelet_binary": str(kube / "no-kubelet-here"),
        "rtfleet_kubelet_version": "1.34",
        **role_vars,
    }
    play = [
        {
            "name": "Kubelet",
            "hosts": "localhost",
            "gather_facts": False,
            "roles": [{"role": "rtfleet.fleet.rtfleet_kubelet", "vars": role_vars}],
        }
    ]
    if tasks_from:
        del play[0]["roles"]
        play[0]["tasks"] = [
            {
                "ansible.builtin.include_role": {
                    "name": "rtfleet.fleet.rtfleet_kubelet",
                    "tasks_from": tasks_from,
                },
                "vars": role_vars,
            }
        ]
    playbook = tmp_path / "kubelet.yml"
    playbook.write_text(yaml.safe_dump(play))
    # conftest.run_local_playbook, plus --check/--diff.
    run = subprocess.run(
        [
            str(Path(sys.executable).parent / "ansible-playbook"),
            *("-i", "localhost,", "-c", "local"),
            *("-e", f"ansible_python_interpreter={sys.executable}"),
            *args,
            str(playbook),
        ],
        capture_output=True,
        text=True,
        env={
            **os.environ,
            "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"),
            "ANSIBLE_STDOUT_CALLBACK": "json",
        },
        cwd=REPO,
        check=False,
    )
    return run, json.loads(run.stdout) if run.stdout.startswith("{") else None


def _stats(report):
    return report["stats"]["localhost"]


def _task_results(report, name):
    return [
        t["hosts"]["localhost"]
        for play in report["plays"]
        for t in play["tasks"]
        if t["task"]["name"].endswith(name)
    ]


@pytest.fixture
def node(tmp_path):
    """kubelet's files before rtfleet: kubeadm's main config and default-policy checkpoints."""
    var = tmp_path / "kube/var"
    var.mkdir(parents=True)
    (var / "config.yaml").write_text(
        "apiVersion: kubelet.config.k8s.io/v1beta1\ncgroupDriver: systemd\n"
    )
    (var / "cpu_manager_state").write_text(_state("none"))
    (var / "memory_manager_state").write_text(_state("None"))
    return tmp_path


def test_role_writes_the_dropin_resets_checkpoints_and_is_idempotent(trees, node):
    root = trees("epyc-7702p-nps4")
    kube = node / "kube"
    run, report = _run_role(node, root)
    assert run.returncode == 0, run.stdout[-3000:]
    dropin = kube / "etc/kubelet.conf.d/90-rtfleet.conf"
    config = kubelet.load(dropin.read_text())
    assert config["cpuManagerPolicy"] == "static"
    assert oct(dropin.stat().st_mode & 0o777) == "0o644"
    assert not (kube / "var/cpu_manager_state").exists()
    assert not (kube / "var/memory_manager_state").exists()
    (backup,) = (kube / "backups").iterdir()
    record = json.loads((backup / "rtfleet-change.json").read_text())
    assert sorted(p.name for p in backup.iterdir()) == [
        "cpu_manager_state",
        "memory_manager_state",
        "rtfleet-change.json",
    ]
    assert record["steps"][2] == "checkpoints removed: cpu_manager_state, memory_manager_state"
    assert "cgroupDriver: systemd" in (kube / "var/config.yaml").read_text()  # main untouched
    skipped = _task_results(report, "Report that the kubelet restart path cannot run here")
    assert "restart/health check/rollback NOT" in skipped[0]["msg"]

    # Second run: nothing changes; a checkpoint kubelet would now write stays.
    (kube / "var/cpu_manager_state").write_text(_state("static"))
    run, report = _run_role(node, root)
    assert run.returncode == 0 and _stats(report)["changed"] == 0
    assert (kube / "var/cpu_manager_state").exists()

    # A Topology Manager change rewrites the file but keeps the checkpoint.
    run, report = _run_role(node, root, rtfleet_kubelet_topology_manager_policy="restricted")
    assert run.returncode == 0 and _stats(report)["changed"] > 0
    assert kubelet.load(dropin.read_text())["topologyManagerPolicy"] == "restricted"
    assert (kube / "var/cpu_manager_state").exists()


def test_rollback_restores_the_backup_the_change_made(trees, node):
    """tasks_from: rollback puts kubelet back as it was before rtfleet: the drop-in gone (there
    was none), the default-policy checkpoints back; run again, it restores the same backup."""
    root = trees("epyc-7702p-nps4")
    kube = node / "kube"
    before = sorted((p.name, p.read_bytes()) for p in (kube / "var").iterdir())
    run, report = _run_role(node, root)
    assert run.returncode == 0, run.stdout[-3000:]
    dropin = kube / "etc/kubelet.conf.d/90-rtfleet.conf"
    assert dropin.exists() and not (kube / "var/cpu_manager_state").exists()
    (kube / "var/cpu_manager_state").write_text(_state("static"))  # what kubelet then wrote

    run, report = _run_role(node, root, tasks_from="rollback")
    assert run.returncode == 0, run.stdout[-3000:]
    assert not dropin.exists()
    assert sorted((p.name, p.read_bytes()) for p in (kube / "var").iterdir()) == before
    skipped = _task_results(report, "Stop kubelet")
    assert skipped and skipped[0].get("skipped"), "no kubelet binary here: stop is skipped"

    run, report = _run_role(node, root, tasks_from="rollback")
    assert run.returncode == 0 and _stats(report)["changed"] == 0


def test_rollback_without_a_backup_changes_nothing(trees, node):
    root = trees("epyc-7702p-nps4")
    before = sorted((p.name, p.read_bytes()) for p in (node / "kube/var").iterdir())
    run, report = _run_role(node, root, tasks_from="rollback")
    assert run.returncode == 0, run.stdout[-3000:]
    assert (
        "No backup in" in _task_results(report, "Report that there is no kubelet backup")[0]["msg"]
    )
    assert _stats(report)["changed"] == 0
    assert sorted((p.name, p.read_bytes()) for p in (node / "kube/var").iterdir()) == before


def test_role_check_mode_changes_nothing(trees, node):
    root = trees("epyc-7702p-nps4")
    before = sorted((p.name, p.read_bytes()) for p in (node / "kube/var").iterdir())
    run, report = _run_role(node, root, "--check", "--diff")
    assert run.returncode == 0, run.stdout[-3000:]
    assert _task_results(report, "Preview the configuration change (check mode)")[0]["changed"]
    assert sorted((p.name, p.read_bytes()) for p in (node / "kube/var").iterdir()) == before
    assert not (node / "kube/etc").exists() and not (node / "kube/backups").exists()


@pytest.mark.parametrize(
    ("role_vars", "message"),
    [
        (
            {"rtfleet_kubelet_topology_manager_policy": "strict"},
            "rtfleet_kubelet_topology_manager_policy",
        ),
        ({"rtfleet_kubelet_reserved_system_cpus": "0-3"}, "leaves runtime CPUs"),
    ],
)
def test_role_refuses_bad_input_before_anything_changes(trees, node, role_vars, message):
    root = trees("epyc-7702p-nps4")
    before = sorted((p.name, p.read_bytes()) for p in (node / "kube/var").iterdir())
    run, report = _run_role(node, root, **role_vars)
    assert run.returncode == 2
    failed = [
        r
        for play in report["plays"]
        for t in play["tasks"]
        for r in [t["hosts"]["localhost"]]
        if r.get("failed")
    ]
    assert message in failed[0]["msg"]
    assert sorted((p.name, p.read_bytes()) for p in (node / "kube/var").iterdir()) == before
    assert not (node / "kube/etc").exists()


def test_role_alone_without_the_host_record_stops_before_anything_changes(trees, node):
    """The kubelet role never recomputes the plan: without /etc/rtfleet/plan.json it says to
    run the host step first, and kubelet's files are as they were."""
    root = trees("epyc-7702p-nps4")
    before = sorted((p.name, p.read_bytes()) for p in (node / "kube/var").iterdir())
    run, report = _run_role(node, root, plan=False)
    assert run.returncode == 2
    (failed,) = [
        r
        for play in report["plays"]
        for t in play["tasks"]
        for r in [t["hosts"]["localhost"]]
        if r.get("failed")
    ]
    assert "run the host step first" in failed["msg"]
    assert sorted((p.name, p.read_bytes()) for p in (node / "kube/var").iterdir()) == before
    assert not (node / "kube/etc").exists()


def test_role_rolls_back_checkpoints_and_file_when_a_step_fails(trees, node):
    """The write fails after the checkpoints were removed (no such owner): the rescue must put
    the checkpoints back, leave no new file and say what failed and what it restored."""
    root = trees("epyc-7702p-nps4")
    before = sorted((p.name, p.read_bytes()) for p in (node / "kube/var").iterdir())
    run, report = _run_role(node, root, rtfleet_kubelet_config_owner="no-such-user-rtfleet")
    assert run.returncode == 2
    (failure,) = _task_results(report, "Fail with what happened and what was restored")
    assert 'failed at "Write the kubelet configuration"' in failure["msg"]
    assert "previous configuration and checkpoints were restored from" in failure["msg"]
    assert "kubelet is not installed" in failure["msg"]
    assert sorted((p.name, p.read_bytes()) for p in (node / "kube/var").iterdir()) == before
    assert not (node / "kube/etc/kubelet.conf.d/90-rtfleet.conf").exists()


def test_role_merges_into_the_main_config_before_kubelet_1_30(trees, node):
    root = trees("epyc-7702p-nps4")
    main = node / "kube/var/config.yaml"
    run, _ = _run_role(node, root, rtfleet_kubelet_version="1.29")
    assert run.returncode == 0, run.stdout[-3000:]
    config = yaml.safe_load(main.read_text())
    assert config["cgroupDriver"] == "systemd" and config["cpuManagerPolicy"] == "static"
    assert main.read_text().startswith("# Managed by rtfleet (role rtfleet_kubelet)")
    assert not (node / "kube/etc").exists()
    (backup,) = (node / "kube/backups").iterdir()
    assert "cgroupDriver: systemd" in (backup / "config.yaml").read_text()
    run, report = _run_role(node, root, rtfleet_kubelet_version="1.29")
    assert run.returncode == 0 and _stats(report)["changed"] == 0


# ------------------------------------------------------------------ issue 11 item 4


@pytest.mark.parametrize("reserved", ["0-3,", "0-3, 64", " 0-3", "0,,1", "0-3:2", "0-3\n"])
def test_reserved_cpus_kubelet_cannot_parse_are_refused(epyc, reserved):
    """kubelet's cpuset.Parse takes neither spaces nor empty items: "0-3," fails there."""
    errors = _errors(epyc, reserved_system_cpus=reserved)
    assert any("unable to parse reservedSystemCPUs" in e for e in errors), errors
    errors = _errors(epyc, extra={"reservedSystemCPUs": reserved})
    assert any("unable to parse reservedSystemCPUs" in e for e in errors), errors
    with pytest.raises(ValueError):
        kubelet_values.parse_cpuset(reserved)


def test_reserved_cpus_kubelet_parses_are_accepted(epyc):
    _, plan = epyc
    spelled = plan["kubelet"]["reservedSystemCPUs"]
    assert not [e for e in _errors(epyc, reserved_system_cpus=spelled) if "parse" in e]
    assert kubelet_values.parse_cpuset("") == [] and kubelet_values.parse_cpuset("3-3,1") == [1, 3]


# ------------------------------------------------------------------ evictionHard defaulting
#
# kubelet's source, kubernetes/kubernetes at a97c6a70451b9c3c9665235f5bd322895a895706 (PR #127577
# "Added the MergeDefaultEvictionSettings Kubelet Config", first released in v1.33.0):
#
# * cmd/kubelet/app/server.go, loadConfigFile (the main --config file, after decoding):
#       if kc.EvictionHard == nil {
#           kc.EvictionHard = eviction.DefaultEvictionHard
#       } else if kc.MergeDefaultEvictionSettings {
#           for k, v := range eviction.DefaultEvictionHard {
#               if _, exists := kc.EvictionHard[k]; !exists { kc.EvictionHard[k] = v }
#           }
#       }
#   so only an absent (nil) map gets the defaults; an empty map stays empty and a partial map
#   keeps only its own signals. Before 1.33 the function is the same without the else branch
#   (its comment cites PR #110263, which took the EvictionHard default out of
#   SetDefaults_KubeletConfiguration in pkg/kubelet/apis/config/v1beta1/defaults.go).
# * same file, mergeKubeletConfigurations (--config-dir): each drop-in is applied with
#   jsonpatch.MergePatch over the main file as loadConfigFile left it (maps merge key by key),
#   then SetDefaults_KubeletConfiguration runs, which does not touch EvictionHard: a drop-in's
#   partial map adds to the main file's defaults, and a drop-in's mergeDefaultEvictionSettings
#   comes too late to merge anything.
# * pkg/kubelet/eviction/defaults_linux.go: DefaultEvictionHard["memory.available"] = "100Mi".
# * staging/src/k8s.io/kubelet/config/v1beta1/types.go: MergeDefaultEvictionSettings *bool
#   `json:"mergeDefaultEvictionSettings,omitempty"` is in k8s.io/kubelet v0.33.0 (Kubernetes
#   1.33.0), not in v0.32.0. An older kubelet decodes the unknown field leniently and ignores it
#   (pkg/kubelet/kubeletconfig/util/codec/codec.go, DecodeKubeletConfiguration: "Using lenient
#   decoding as strict decoding failed"), and rtfleet passes unknown keys through, so the flag
#   is ignored there, not refused.
# * pkg/kubelet/cm/node_container_manager_linux.go, hardEvictionReservation: only a
#   memory.available threshold that is there reserves memory; pkg/kubelet/cm/memorymanager/
#   memory_manager.go, validateReservedMemory: the Static policy refuses to start unless the
#   reservedMemory sum equals that Node Allocatable reservation ("the total amount ... is not
#   equal to the value ... determined by Node Allocatable feature").

KUBE_AND_SYSTEM = 1024 * 2**20  # kube_reserved 512Mi + system_reserved 512Mi (the defaults)
DEFAULT_EVICTION = 100 * 2**20


def _reserved_memory_total(result):
    return sum(
        kubelet_values.parse_quantity(entry["limits"]["memory"])
        for entry in result["config"]["reservedMemory"]
    )


@pytest.mark.parametrize(
    ("version", "eviction_hard", "extra", "counted"),
    [
        # absent: kubelet fills in DefaultEvictionHard
        ("1.34", {}, None, DEFAULT_EVICTION),
        ("1.29", {}, None, DEFAULT_EVICTION),
        # an explicitly empty map stays empty
        ("1.34", {}, {"evictionHard": {}}, 0),
        # a partial map keeps only its own signals
        ("1.34", {"nodefs.available": "10%"}, None, 0),
        ("1.29", {"nodefs.available": "10%"}, None, 0),
        ("1.34", {"memory.available": "200Mi"}, None, 200 * 2**20),
        # mergeDefaultEvictionSettings fills in the missing defaults from 1.33 on
        (
            "1.33",
            {"nodefs.available": "10%"},
            {"mergeDefaultEvictionSettings": True},
            DEFAULT_EVICTION,
        ),
        ("1.34", {}, {"evictionHard": {}, "mergeDefaultEvictionSettings": True}, DEFAULT_EVICTION),
        (
            "1.34",
            {"memory.available": "200Mi"},
            {"mergeDefaultEvictionSettings": True},
            200 * 2**20,
        ),
        ("1.34", {"nodefs.available": "10%"}, {"mergeDefaultEvictionSettings": False}, 0),
        # ... and kubelet 1.32 does not know the field: ignored
        ("1.32", {"nodefs.available": "10%"}, {"mergeDefaultEvictionSettings": True}, 0),
    ],
)
def test_main_file_eviction_hard_is_defaulted_as_kubelet_does(
    epyc, version, eviction_hard, extra, counted
):
    """rtfleet writes the whole main file: reservedMemory counts memory.available exactly as
    kubelet's loadConfigFile leaves it (see the sources above)."""
    settings = {"kubelet_version": version, "config_mode": "main", "eviction_hard": eviction_hard}
    if extra is not None:
        settings["extra"] = extra
    result = _build(epyc, **settings)
    assert not result["dropin"]
    assert _reserved_memory_total(result) == KUBE_AND_SYSTEM + counted


@pytest.mark.parametrize(
    ("version", "base", "settings", "counted"),
    [
        # the main file has no evictionHard: kubelet defaults it, the drop-in adds its keys
        ("1.34", {}, {"eviction_hard": {}}, DEFAULT_EVICTION),
        ("1.34", {}, {"eviction_hard": {"nodefs.available": "10%"}}, DEFAULT_EVICTION),
        (
            "1.30",
            {"cgroupDriver": "systemd"},
            {"eviction_hard": {"nodefs.available": "10%"}},
            DEFAULT_EVICTION,
        ),
        # the main file's empty or partial map is kept; the drop-in adds no memory.available
        ("1.34", {"evictionHard": {}}, {"eviction_hard": {}}, 0),
        ("1.34", {"evictionHard": {"nodefs.available": "10%"}}, {"eviction_hard": {}}, 0),
        ("1.34", {"evictionHard": {}}, {"eviction_hard": {"imagefs.available": "15%"}}, 0),
        # the drop-in's own memory.available wins over the main file's
        ("1.34", {"evictionHard": {"memory.available": "1Gi"}}, {"eviction_hard": {}}, 2**30),
        ("1.34", {}, {"eviction_hard": {"memory.available": "300Mi"}}, 300 * 2**20),
        # the main file's mergeDefaultEvictionSettings merges the defaults (1.33+) ...
        (
            "1.34",
            {"evictionHard": {"nodefs.available": "10%"}, "mergeDefaultEvictionSettings": True},
            {"eviction_hard": {}},
            DEFAULT_EVICTION,
        ),
        (
            "1.32",
            {"evictionHard": {"nodefs.available": "10%"}, "mergeDefaultEvictionSettings": True},
            {"eviction_hard": {}},
            0,
        ),
        # ... the drop-in's comes after loadConfigFile and merges nothing
        (
            "1.34",
            {"evictionHard": {"nodefs.available": "10%"}},
            {"eviction_hard": {}, "extra": {"mergeDefaultEvictionSettings": True}},
            0,
        ),
    ],
)
def test_dropin_eviction_hard_merges_over_the_defaulted_main_file(
    epyc, version, base, settings, counted
):
    topology, plan = epyc
    settings = dict(settings, kubelet_version=version)
    result = kubelet.build(plan, topology, settings, base_config=base)
    assert result["dropin"]
    assert _reserved_memory_total(result) == KUBE_AND_SYSTEM + counted


def test_reserved_memory_that_counts_a_default_kubelet_does_not_apply_is_refused(epyc):
    """A partial evictionHard in the main file: kubelet's Static Memory Manager wants
    reservedMemory == kubeReserved + systemReserved (1Gi) and refuses 1Gi + 100Mi."""
    topology, _ = epyc
    nodes = [n["id"] for n in topology["numa_nodes"]]
    exact = [{"numaNode": n, "limits": {"memory": "256Mi"}} for n in nodes]
    with_default = copy.deepcopy(exact)
    with_default[0]["limits"]["memory"] = "356Mi"
    partial = {"nodefs.available": "10%"}
    errors = _errors(epyc, eviction_hard=partial, reserved_memory=with_default)
    assert any("adds up to 1124Mi" in e and "is 1Gi" in e for e in errors), errors
    assert not _errors(epyc, eviction_hard=partial, reserved_memory=exact)
    # absent: the 100Mi default is counted
    errors = _errors(epyc, eviction_hard={}, reserved_memory=exact)
    assert any("adds up to 1Gi" in e and "is 1124Mi" in e for e in errors), errors
    assert not _errors(epyc, eviction_hard={}, reserved_memory=with_default)
    # an explicitly empty map: nothing is counted
    assert not _errors(epyc, eviction_hard={}, extra={"evictionHard": {}}, reserved_memory=exact)


def _with_cxl_nodes(topology, cpu_nodes=8, cxl=2):
    big = copy.deepcopy(topology)
    cpus = big["cpus"]
    share = len(cpus) // cpu_nodes
    big["numa_nodes"] = [
        {"id": i, "cpus": cpus[i * share : (i + 1) * share], "memory_kb": 2**24}
        for i in range(cpu_nodes)
    ] + [
        {"id": cpu_nodes + i, "cpus": [], "memory_kb": 2**28, "has_memory": True}
        for i in range(cxl)
    ]
    return big


def test_cpuless_nodes_count_toward_the_eight_node_limit(epyc):
    topology, plan = epyc
    eight = _with_cxl_nodes(topology, cxl=0)
    config, _ = kubelet.render(plan, eight, kubelet.normalize_settings({"kubelet_version": "1.34"}))
    assert "topologyManagerPolicyOptions" not in config  # 8 nodes: no option needed
    ten = _with_cxl_nodes(topology)
    settings = kubelet.normalize_settings({"kubelet_version": "1.34"})
    config, _ = kubelet.render(plan, ten, settings)
    assert config["topologyManagerPolicyOptions"] == {"max-allowable-numa-nodes": "10"}
    assert [e["numaNode"] for e in config["reservedMemory"]] == list(range(8))  # CPU nodes
    assert not [
        e for e in kubelet_validate.validate(config, ten, settings, plan) if "NUMA nodes" in e
    ]
    # 1.31-1.34: beta option behind TopologyManagerPolicyBetaOptions (on by default)
    settings = kubelet.normalize_settings({"kubelet_version": "1.31"})
    config, _ = kubelet.render(plan, ten, settings)
    assert config["topologyManagerPolicyOptions"] == {"max-allowable-numa-nodes": "10"}
    assert config["featureGates"]["TopologyManagerPolicyBetaOptions"] is True
    # An explicit limit below the real count is refused, naming the CPU-less nodes.
    errors = _errors((ten, plan), topology_manager_policy_options={"max-allowable-numa-nodes": "8"})
    assert any("10 NUMA nodes (CPU-less 8-9 included" in e for e in errors), errors
    settings = kubelet.normalize_settings({"kubelet_version": "1.30"})
    config, _ = kubelet.render(plan, ten, settings)
    errors = kubelet_validate.validate(config, ten, settings, plan)
    assert any(
        "10 NUMA nodes (CPU-less 8-9 included" in e and "upgrade kubelet" in e for e in errors
    )


@pytest.mark.parametrize("version", ["1.31", "1.32", "1.33"])
def test_unknown_feature_gate_is_refused(epyc, version):
    errors = _errors(epyc, kubelet_version=version, feature_gates={"MemoryManagr": True})
    assert any(
        "featureGates.MemoryManagr: kubelet" in e and "no such feature gate" in e for e in errors
    ), errors
    errors = _errors(epyc, kubelet_version=version, feature_gates={"memorymanager": True})
    assert any("did you mean MemoryManager?" in e for e in errors), errors
    assert not _errors(epyc, kubelet_version=version, feature_gates={"KubeletTracing": True})


def test_gates_removed_or_added_follow_the_version(epyc):
    # CPUManager is gone from the 1.33 table; DRADeviceTaints is new there.
    assert any(
        "no such feature gate" in e
        for e in _errors(epyc, kubelet_version="1.33", feature_gates={"CPUManager": True})
    )
    assert not _errors(epyc, kubelet_version="1.32", feature_gates={"CPUManager": True})
    assert not _errors(epyc, kubelet_version="1.33", feature_gates={"DRADeviceTaints": True})


def test_unknown_gate_outside_the_table_is_a_warning_not_an_error(epyc):
    result = _build(epyc, kubelet_version="1.34", feature_gates={"SomeNewGate": True})
    assert any(
        "SomeNewGate" in w and "not in rtfleet's gate table" in w for w in result["warnings"]
    )


@pytest.mark.parametrize(
    ("version", "gates", "refused"),
    [
        ("1.31", {"MemoryManager": False}, False),  # beta in 1.31: may be turned off
        ("1.32", {"MemoryManager": False}, True),  # GA and locked from 1.32
        ("1.31", {"CPUManager": False}, True),  # GA and locked since 1.26
        ("1.32", {"CPUManagerPolicyOptions": False}, False),  # beta until 1.33
        ("1.33", {"CPUManagerPolicyOptions": False}, True),
        ("1.32", {"TopologyManagerPolicyOptions": False}, False),  # GA 1.32 but not locked
        ("1.33", {"SidecarContainers": False}, True),
        ("1.32", {"AllowServiceLBStatusOnNonLB": True}, True),  # deprecated, locked to false
        ("1.34", {"MemoryManager": False}, True),  # newer than the name table: lock still holds
    ],
)
def test_locked_gate_set_against_its_lock_is_refused(epyc, version, gates, refused):
    errors = _errors(epyc, kubelet_version=version, feature_gates=gates)
    locked = [e for e in errors if "the gate is locked to" in e]
    assert bool(locked) is refused, errors
    if refused:
        assert "kubelet refuses to start" in locked[0]
