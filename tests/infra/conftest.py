"""testinfra suite for operators: point it at rolled-out nodes.

    pytest tests/infra --sudo --hosts='ansible://inference_nodes' --ansible-inventory=inventory/prod

Molecule's verify step runs the same files against the lab hosts. Every check compares the
running host with the plan the host role applied, which it records in /etc/rtfleet/plan.json,
and with the role settings it records in /etc/rtfleet/host.json.
"""

from __future__ import annotations

import json

import pytest
from rtfleet_infra import read_files

PLAN_PATH = "/etc/rtfleet/plan.json"
HOST_PATH = "/etc/rtfleet/host.json"


def _read_json(host, path):
    content = read_files(host, PLAN_PATH, HOST_PATH)[path]
    if content is None:
        name = host.backend.hostname
        pytest.fail("%s has no %s: the rtfleet_host role has not completed on it" % (name, path))
    return json.loads(content)


@pytest.fixture
def rtfleet_plan(host):
    """The CPU partition plan the host role applied on this host."""
    return _read_json(host, PLAN_PATH)


@pytest.fixture
def rtfleet_host_config(host):
    """What the host role configured: kernel, kernel args, sysctls, IRQ mode, hugepages."""
    return _read_json(host, HOST_PATH)
