"""Shared fixtures: generated sysfs trees of real machine shapes, built once per session."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

import sysfs_gen  # noqa: E402


@pytest.fixture(scope="session")
def trees():
    """trees(name) -> root of the generated tree for that shape (tests/fixtures/shapes/)."""
    # Trees are ~10k tiny files per big shape; tmpfs keeps the suite fast on slow disks.
    shm = Path("/dev/shm")
    base = Path(tempfile.mkdtemp(prefix="sysfs-gen-", dir=shm if os.access(shm, os.W_OK) else None))
    cache: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in cache:
            cache[name] = sysfs_gen.build_tree(name, base / name)
        return cache[name]

    yield get
    shutil.rmtree(base, ignore_errors=True)


REPO = TESTS.parent


def run_local_playbook(path: Path, *args: str, **env) -> subprocess.CompletedProcess:
    """ansible-playbook PATH [ARGS] against localhost with this repo's ansible.cfg and Python."""
    return subprocess.run(
        [
            str(Path(sys.executable).parent / "ansible-playbook"),
            "-i",
            "localhost,",
            "-c",
            "local",
            "-e",
            f"ansible_python_interpreter={sys.executable}",
            str(path),
            *args,
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"), **env},
        cwd=REPO,
        check=False,
    )
