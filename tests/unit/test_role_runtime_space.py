"""rtfleet_runtime refuses a release the node has no room for (tasks/space.yml), before it
ships anything: played on this machine against real filesystems (tmpfs mounts of known size,
df reading them), one shared by the bundle and the release and two separate ones."""

from __future__ import annotations

import os
import subprocess

import pytest
import yaml
from conftest import run_local_playbook

MIB = 1 << 20

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounts tmpfs: root only")


@pytest.fixture
def tmpfs(tmp_path):
    mounted = []

    def mount(name: str, mib: int):
        path = tmp_path / name
        path.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mib}m", "rtfleet-test-" + name,
                        str(path)], check=True)  # fmt: skip
        mounted.append(path)
        return path

    yield mount
    for path in reversed(mounted):
        subprocess.run(["umount", str(path)], check=False)


def _space(tmp_path, data_dir, prefix, *, bundle_mib, release_mib, min_free_mib=16):
    (prefix / "releases").mkdir(exist_ok=True)
    play = [{
        "name": "The runtime's free-space check",
        "hosts": "localhost",
        "gather_facts": False,
        "tasks": [{
            "ansible.builtin.include_role": {"name": "rtfleet.fleet.rtfleet_runtime",
                                             "tasks_from": "space"},
            "vars": {
                "rtfleet_runtime_data_dir": str(data_dir),
                "rtfleet_runtime_prefix": str(prefix),
                "rtfleet_runtime_min_free_mib": min_free_mib,
                "__rtfleet_runtime_bundle_sha256": "ab" * 32,
                "__rtfleet_runtime_bundle_bytes": bundle_mib * MIB,
                "__rtfleet_runtime_release_bytes": release_mib * MIB,
            },
        }],
    }]  # fmt: skip
    playbook = tmp_path / "space.yml"
    playbook.write_text(yaml.safe_dump(play))
    return run_local_playbook(playbook)


def _message(run) -> str:
    lines = [line for line in run.stdout.splitlines() if "MiB free" in line]
    assert lines, run.stdout[-3000:]
    return lines[0]


def test_one_filesystem_counts_the_bundle_and_the_release_together(tmp_path, tmpfs):
    disk = tmpfs("disk", 64)
    (disk / "data").mkdir()
    (disk / "opt").mkdir()
    ok = _space(tmp_path, disk / "data", disk / "opt", bundle_mib=20, release_mib=20)
    assert ok.returncode == 0, ok.stdout[-3000:]
    # Each alone would fit; together with what must stay free they do not.
    full = _space(tmp_path, disk / "data", disk / "opt", bundle_mib=20, release_mib=30)
    assert full.returncode != 0
    message = _message(full)
    assert "rtfleet-test-disk has 6" in message  # 64 MiB, df's own figure
    assert "needs about 66 MiB there (20 MiB bundle, 30 MiB installed" in message
    assert "nothing was changed and the running units were not touched" in message


def test_separate_filesystems_are_checked_each_for_its_part(tmp_path, tmpfs):
    var = tmpfs("var", 32)
    opt = tmpfs("opt", 64)
    ok = _space(tmp_path, var, opt, bundle_mib=10, release_mib=40)
    assert ok.returncode == 0, ok.stdout[-3000:]
    small_var = _space(tmp_path, var, opt, bundle_mib=20, release_mib=10)
    assert small_var.returncode != 0
    assert "rtfleet-test-var has" in _message(small_var)
    small_opt = _space(tmp_path, var, opt, bundle_mib=1, release_mib=60)
    assert small_opt.returncode != 0
    assert "rtfleet-test-opt has" in _message(small_opt)


def test_a_filled_disk_is_refused(tmp_path, tmpfs):
    disk = tmpfs("filled", 64)
    ok = _space(tmp_path, disk, disk, bundle_mib=5, release_mib=5)
    assert ok.returncode == 0, ok.stdout[-3000:]
    subprocess.run(["fallocate", "-l", "40M", str(disk / "filler")], check=True)
    full = _space(tmp_path, disk, disk, bundle_mib=5, release_mib=5)
    assert full.returncode != 0 and "needs about 26 MiB" in _message(full)
