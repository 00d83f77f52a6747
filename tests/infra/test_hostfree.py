"""The suite's own checks, which need no host (marked ``hostfree`` by conftest.py).

They run wherever the suite is collected, first of all from an installed collection in a
Python that has only its requirements.txt (tests/collection/run.sh does that):

    python3 -m pytest <collection>/tests/infra -m hostfree

The parsers the host checks read with are this collection's copies; the batched reads and the
drift guard's output come apart as the host checks expect.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from types import SimpleNamespace

from rtfleet_infra import drift_guard, read_files
from test_drift import REPINNED, STAMP, _drifted

from ansible_collections.rtfleet.fleet.plugins.module_utils import boot, drift, topology

COLLECTION = Path(__file__).resolve().parents[2]


class _Local:
    """A stand-in for testinfra's ``host``: runs the suite's scripts with this machine's sh
    (or answers with ``stdout``), counting round trips."""

    def __init__(self, stdout=None):
        self.stdout = stdout
        self.commands = []
        self.backend = SimpleNamespace(
            hostname="local", get_pytest_id=lambda: "local-%d" % id(self)
        )

    def run(self, command):
        self.commands.append(command)
        if self.stdout is not None:
            return SimpleNamespace(stdout=self.stdout, stderr="", rc=0)
        done = subprocess.run(["sh", "-c", command], capture_output=True, text=True, check=False)
        return SimpleNamespace(stdout=done.stdout, stderr=done.stderr, rc=done.returncode)


def test_the_host_checks_read_with_this_collections_parsers():
    # Not a copy elsewhere on sys.path (another installed version, a checkout's package).
    for module in (boot, topology, drift):
        assert Path(module.__file__).resolve().is_relative_to(COLLECTION), module.__file__
    assert topology.parse_cpulist("0-2,8") == [0, 1, 2, 8]
    assert boot.split_cmdline("ro isolcpus=2-3 quiet") == ["ro", "isolcpus=2-3", "quiet"]


def test_read_files_reads_a_batch_in_one_round_trip(tmp_path):
    (tmp_path / "plan.json").write_text('{"isolated": [2, 3]}\n')
    (tmp_path / "empty").write_text("")
    for irq in (5, 17):
        (tmp_path / "irq" / str(irq)).mkdir(parents=True)
        (tmp_path / "irq" / str(irq) / "smp_affinity_list").write_text("0-1\n")
    host = _Local()
    paths = (
        str(tmp_path / "plan.json"),
        str(tmp_path / "empty"),
        str(tmp_path / "missing"),
        str(tmp_path / "irq/*/smp_affinity_list"),
    )
    files = read_files(host, *paths)
    assert files == {
        paths[0]: '{"isolated": [2, 3]}\n',
        paths[1]: "",
        paths[2]: None,  # unreadable: None, not ""
        str(tmp_path / "irq/17/smp_affinity_list"): "0-1\n",
        str(tmp_path / "irq/5/smp_affinity_list"): "0-1\n",
    }
    assert read_files(host, *paths) is files
    assert len(host.commands) == 1


def test_the_drift_guards_output_and_textfile_come_apart():
    # What rtfleet-drift prints and writes after re-pinning IRQs and finding a sysctl off,
    # rendered by the guard's own code, as drift_guard's one ssh round trip returns them.
    checks = {name: {"status": "ok", "details": []} for name in drift.CHECKS}
    checks["sysctls"] = {"status": "drift", "details": ["vm.swappiness is 60, wanted 10"]}
    checks["irqs"] = {
        "status": "repaired",
        "details": [],
        "unmovable": [0, 9],
        "repinned": [{"irq": 24, "from": "7", "to": "0-1"}],
    }
    checks["unit_threads"] = {"status": "ok", "details": [], "units": {}}
    result = {"checks": checks, "repinned_irqs_total": 3, "timestamp": 1700000000.5}
    stdout = "%s\0371\nre-pinned IRQ 24\n\036%s" % (
        json.dumps(result),
        drift.render_textfile(result),
    )
    rc, found, log, metrics = drift_guard(_Local(stdout))
    assert (rc, found, log) == (1, result, "re-pinned IRQ 24\n")
    assert _drifted(found) == ["sysctls"]
    assert metrics[STAMP] == 1700000000.5
    assert metrics[REPINNED] == 3
    assert metrics[("rtfleet_drift", (("check", "sysctls"),))] == 1
    assert metrics[("rtfleet_drift", (("check", "irqs"),))] == 0
    assert metrics[("rtfleet_drift_unmovable_irqs", ())] == 2
