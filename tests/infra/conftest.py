"""testinfra suite for operators: point it at rolled-out nodes, from the installed collection.

    python3 -m pytest ~/.ansible/collections/ansible_collections/rtfleet/fleet/tests/infra \
        --sudo --hosts='ansible://inference_nodes' --ansible-inventory=inventory.yml

It needs only what the collection's requirements.txt installs (pytest-testinfra, PyYAML,
prometheus-client): the parsers it reads the host with are the collection's own
(plugins/module_utils, imported as ansible_collections.rtfleet.fleet...), from the copy
these files are in. Molecule's verify step runs the same files against the lab hosts.
Every check compares the running host with the plan the host role applied, which it records
in /etc/rtfleet/plan.json, and with the role settings it records in /etc/rtfleet/host.json.
Tests that take no ``host`` (the suite's own checks) are marked ``hostfree``:
``-m hostfree`` runs them anywhere.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

# This collection: <collections path>/ansible_collections/rtfleet/fleet when installed, the
# checkout in development (where `make setup` links it into the venv as that package).
COLLECTION = Path(__file__).resolve().parents[2]
if COLLECTION.parents[1].name == "ansible_collections":
    # Installed: its own collections path first, so ansible_collections.rtfleet.fleet is
    # this copy, not another one elsewhere on sys.path.
    sys.path.insert(0, str(COLLECTION.parents[2]))

from rtfleet_infra import read_files  # noqa: E402

from ansible_collections.rtfleet.fleet.plugins.module_utils.plan_record import (  # noqa: E402
    parse_plan,
)

PLAN_PATH = "/etc/rtfleet/plan.json"
HOST_PATH = "/etc/rtfleet/host.json"


def _read(host, path):
    content = read_files(host, PLAN_PATH, HOST_PATH)[path]
    if content is None:
        name = host.backend.hostname
        pytest.fail("%s has no %s: the rtfleet_host role has not completed on it" % (name, path))
    return content


@pytest.fixture
def rtfleet_plan(host):
    """The CPU partition plan the host role applied on this host: its record, read as every
    reader reads it (the sets it stores and the forms derived from them)."""
    return parse_plan(_read(host, PLAN_PATH))


@pytest.fixture
def rtfleet_host_config(host):
    """What the host role configured: kernel, kernel args, sysctls, IRQ mode, hugepages."""
    return json.loads(_read(host, HOST_PATH))


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "hostfree: needs no host (the suite's own checks; set by conftest.py)"
    )


def pytest_collection_modifyitems(items):
    for item in items:
        if "host" not in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.hostfree)
