"""Kubelet checks for operators, after rtfleet_kubelet ran (Molecule's verify runs them too).

    infra=~/.ansible/collections/ansible_collections/rtfleet/fleet/tests/infra
    python3 -m pytest $infra/test_kubelet.py --hosts='ansible://inference_nodes' --sudo \
        --ansible-inventory=inventory.yml

What must hold on every node: the configuration kubelet reads gives it the static CPU
Manager with exactly the plan's reserved CPUs (housekeeping + runtime), so the pod pool
never overlaps a runtime group's CPUAffinity, and a CPU / Memory Manager checkpoint, when
there is one, was written under the policy the configuration names (else kubelet refuses
to start). Set RTFLEET_KUBELET_CONFIG to read another file than the rtfleet drop-in or the
main config.
"""

from __future__ import annotations

import json
import os

import pytest
import yaml

from ansible_collections.rtfleet.fleet.plugins.module_utils.cpulist import (
    format_cpulist,
    parse_cpulist,
)

DROPIN = "/etc/kubernetes/kubelet.conf.d/90-rtfleet.conf"
MAIN_CONFIG = "/var/lib/kubelet/config.yaml"
STATE_DIR = "/var/lib/kubelet"


@pytest.fixture(scope="module")
def kubelet_config(host):
    """The configuration rtfleet_kubelet wrote: its drop-in, else the main config file."""
    candidates = (
        [os.environ["RTFLEET_KUBELET_CONFIG"]]
        if "RTFLEET_KUBELET_CONFIG" in os.environ
        else [DROPIN, MAIN_CONFIG]
    )
    for path in candidates:
        f = host.file(path)
        if f.exists:
            # rtfleet writes comment lines + JSON, which is YAML; kubeadm writes YAML.
            return yaml.safe_load(f.content_string)
    pytest.fail(
        "no kubelet configuration at %s: has rtfleet_kubelet run?" % " or ".join(candidates)
    )


def _online(host):
    return set(parse_cpulist(host.file("/sys/devices/system/cpu/online").content_string))


def test_static_cpu_manager_reserves_the_plans_cpus(kubelet_config, rtfleet_plan):
    assert kubelet_config.get("cpuManagerPolicy") == "static"
    reserved = set(parse_cpulist(str(kubelet_config.get("reservedSystemCPUs", ""))))
    planned = set(rtfleet_plan["housekeeping"]) | set(rtfleet_plan["runtime"])
    assert reserved == planned, (
        "reservedSystemCPUs %s, the plan reserves %s (housekeeping + runtime)"
        % (format_cpulist(reserved), format_cpulist(planned))
    )


def test_pod_pool_never_overlaps_a_runtime_cpu(host, kubelet_config, rtfleet_plan):
    reserved = set(parse_cpulist(str(kubelet_config.get("reservedSystemCPUs", ""))))
    pod_pool = _online(host) - reserved
    assert pod_pool == set(rtfleet_plan["pod_pool"])
    for group in rtfleet_plan["runtime_groups"]:
        affinity = set(parse_cpulist(group["systemd"]["CPUAffinity"]))
        assert not pod_pool & affinity, "pods may get CPUs %s of runtime group %s" % (
            format_cpulist(pod_pool & affinity),
            group["name"],
        )


def test_reservations_match_the_memory_manager(kubelet_config, rtfleet_plan):
    if kubelet_config.get("memoryManagerPolicy") != "Static":
        pytest.skip("Memory Manager policy is not Static")
    nodes = {entry["numaNode"] for entry in kubelet_config.get("reservedMemory", [])}
    assert nodes == {node["id"] for node in rtfleet_plan["numa_nodes"]}


@pytest.mark.parametrize(
    ("checkpoint", "key", "default"),
    [
        ("cpu_manager_state", "cpuManagerPolicy", "none"),
        ("memory_manager_state", "memoryManagerPolicy", "None"),
    ],
)
def test_checkpoint_policy_matches_the_config(host, kubelet_config, checkpoint, key, default):
    f = host.file("%s/%s" % (STATE_DIR, checkpoint))
    if not f.exists:
        pytest.skip("no %s (kubelet writes it at its next start)" % checkpoint)
    recorded = json.loads(f.content_string).get("policyName")
    assert recorded == kubelet_config.get(key, default), (
        "%s was written under policy %r but the configuration says %r: kubelet will refuse to "
        "start; rerun rtfleet_kubelet with rtfleet_kubelet_force_apply: true"
        % (checkpoint, recorded, kubelet_config.get(key, default))
    )
