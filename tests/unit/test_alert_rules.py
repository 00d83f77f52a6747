"""prometheus/rtfleet.rules.yml: every expression is valid PromQL (promql-parser, the
Rust parser's Python binding) and names only series rtfleet exports: the shminfer_* ones
are read from a real server's metrics text after it served a request."""

from __future__ import annotations

import re

import numpy as np
import promql_parser
import pytest
import yaml
from conftest import REPO
from prometheus_client.parser import text_string_to_metric_families
from shminfer_serving import serving

from shminfer.client import Client

RULES = REPO / "prometheus" / "rtfleet.rules.yml"
_SERIES = re.compile(r"\b((?:shminfer|rtfleet|node)_[a-z_]+)\b")


def _rules():
    doc = yaml.safe_load(RULES.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


@pytest.mark.parametrize("rule", _rules(), ids=lambda rule: rule["alert"])
def test_rule_is_valid_promql_with_a_summary(rule):
    promql_parser.parse(rule["expr"])
    assert rule["annotations"]["summary"]
    assert rule["labels"]["severity"] in ("warning", "critical")


def test_shminfer_series_in_the_rules_are_the_ones_a_server_writes():
    wanted = {
        name
        for rule in _rules()
        for name in _SERIES.findall(rule["expr"])
        if name.startswith("shminfer_")
    }
    assert wanted, "the rules watch no shminfer series"
    with serving("echo") as server, Client(server.name, timeout=10) as client:
        client.infer({"x": np.ones((1, 8), np.float32)})
        text = server.metrics_text()
    written = {
        sample.name for family in text_string_to_metric_families(text) for sample in family.samples
    }
    assert wanted <= written, "rules name series no server writes: %s" % sorted(wanted - written)


def test_rtfleet_series_in_the_rules_are_the_ones_the_drift_guard_writes():
    from rtfleet.drift import CHECKS, render_textfile

    wanted = {
        name
        for rule in _rules()
        for name in _SERIES.findall(rule["expr"])
        if name.startswith("rtfleet_")
    }
    assert wanted, "the rules watch no rtfleet series"
    checks = {name: {"status": "ok", "details": []} for name in CHECKS}
    checks["irqs"].update(unmovable=[], repinned=[])
    checks["unit_threads"]["units"] = {"shminfer@ccx0.service": {"outside": []}}
    text = render_textfile({"checks": checks, "repinned_irqs_total": 0, "timestamp": 1.0})
    written = {
        sample.name for family in text_string_to_metric_families(text) for sample in family.samples
    }
    assert wanted <= written, "rules name series the guard never writes: %s" % sorted(
        wanted - written
    )
