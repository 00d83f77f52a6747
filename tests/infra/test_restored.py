"""After `rtfleet.fleet.restore`: the host is as its original record says, and nothing of
rtfleet is left on it. The record is the controller's copy restore kept
(`reports/restore/<host>-original.json`, or $RTFLEET_RESTORE_RECORD_DIR); the comparison is
rtfleet.fleet.host_original's, the one restore itself ends with:

    infra=~/.ansible/collections/ansible_collections/rtfleet/fleet/tests/infra
    python3 -m pytest $infra/test_restored.py --sudo --hosts='ansible://epyc-node-01' \\
        --ansible-inventory=inventory.yml
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

RECORD_DIR = Path(os.environ.get("RTFLEET_RESTORE_RECORD_DIR", "reports/restore"))


@pytest.fixture
def original(host):
    name = host.backend.hostname
    path = RECORD_DIR / f"{name}-original.json"
    if not path.is_file():
        pytest.skip(f"no restore record for {name} in {RECORD_DIR}: the host was not restored")
    return json.loads(path.read_text())


def test_the_host_is_as_it_was_before_rtfleet(host, original):
    result = host.ansible(
        "rtfleet.fleet.host_original",
        # testinfra hands module arguments to ansible as one string: JSON, which ansible
        # reads as the arguments' dict (k=v quoting would break on the record's values).
        json.dumps({"state": "compared", "record": original, "path": "/nonexistent"}),
        check=False,
        become=True,
    )
    assert not result.get("failed"), result.get("msg")
    assert result["differences"] == []


def test_nothing_of_rtfleet_is_left(host, original):
    # Only on a restored host (the fixture skips a host with no restore record): on a tuned
    # one, everything listed here is rightly present.
    for path in ("/etc/rtfleet", "/var/lib/rtfleet", "/usr/local/lib/rtfleet", "/opt/shminfer"):
        assert not host.file(path).exists, path
    listed = host.run("systemctl list-unit-files 'rtfleet*' 'shminfer*' --no-legend").stdout
    # Units of those names the host had before rtfleet (the lab image's own
    # rtfleet-lab-init.service) are in the record's rtfleet_paths: not rtfleet's to remove.
    before = {Path(p).name for p in original.get("rtfleet_paths", []) if "/systemd/" in p}
    units = [line.split()[0] for line in listed.splitlines() if line.strip()]
    assert [unit for unit in units if unit not in before] == [], listed
    if host.exists("podman"):  # the containerised sampler's images (rtfleet_sampler's remove)
        images = host.check_output("podman images --format '{{.Repository}}:{{.Tag}}'")
        assert [i for i in images.split() if i.startswith("localhost/rtfleet-sampler")] == []
