"""The shminfer unit the runtime role renders (issue 27): its descriptor limit and its
restart on the supervisor's exit code 2, from the role's defaults and an override."""

from __future__ import annotations

import pytest
import yaml
from ansible.parsing.dataloader import DataLoader
from ansible.template import Templar, trust_as_template
from conftest import REPO

ROLE = REPO / "roles/rtfleet_runtime"


def _render(**overrides):
    variables = {
        **yaml.safe_load((ROLE / "defaults/main.yml").read_text()),
        **(yaml.safe_load((ROLE / "vars/main.yml").read_text()) or {}),
        "ansible_managed": "Ansible managed",
        "__rtfleet_runtime_systemd_version": "252",
        "__rtfleet_runtime_model_file": "model.xml",
        **overrides,
    }
    variables = {k: trust_as_template(v) if isinstance(v, str) else v for k, v in variables.items()}
    text = (ROLE / "templates/shminfer@.service.j2").read_text()
    rendered = Templar(loader=DataLoader(), variables=variables).template(trust_as_template(text))
    settings = {}
    for line in rendered.splitlines():
        key, sep, value = line.partition("=")
        if sep and not line.startswith("#"):
            settings.setdefault(key, []).append(value)
    return settings


@pytest.mark.parametrize(
    ("overrides", "limit"), [({}, "16384"), ({"rtfleet_runtime_limit_nofile": 4096}, "4096")]
)
def test_the_unit_sets_its_descriptor_limit(overrides, limit):
    assert _render(**overrides)["LimitNOFILE"] == [limit]


def test_the_unit_is_restarted_when_the_supervisor_exits_unhealthy():
    # shminfer serve exits 2 when its health check fails: a failure for Restart=on-failure.
    unit = _render()
    assert unit["Restart"] == ["on-failure"] and unit["Type"] == ["notify"]
    assert "SuccessExitStatus" not in unit
