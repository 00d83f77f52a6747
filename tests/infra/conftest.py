"""testinfra suite for operators: point it at rolled-out nodes.

    pytest tests/infra --hosts='ansible://inference_nodes' --ansible-inventory=inventory/prod

Molecule's verify step runs the same files against the lab hosts. Every check compares the
running host with the plan the host role applied, which it records in /etc/rtfleet/plan.json,
and with the role settings it records in /etc/rtfleet/host.json.
"""

from __future__ import annotations

import json

import pytest

from rtfleet.topology import parse_cpulist  # noqa: F401  (re-exported for the test files)

PLAN_PATH = "/etc/rtfleet/plan.json"
HOST_PATH = "/etc/rtfleet/host.json"


def _read_json(host, path):
    f = host.file(path)
    if not f.exists:
        name = host.backend.hostname
        pytest.fail("%s has no %s: the rtfleet_host role has not completed on it" % (name, path))
    return json.loads(f.content_string)


@pytest.fixture
def rtfleet_plan(host):
    """The CPU partition plan the host role applied on this host."""
    return _read_json(host, PLAN_PATH)


@pytest.fixture
def rtfleet_host_config(host):
    """What the host role configured: kernel, kernel args, sysctls, IRQ mode, hugepages."""
    return _read_json(host, HOST_PATH)
