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


@pytest.fixture(scope="session", autouse=True)
def shminfer_dir():
    """Every server of the suite publishes in a directory of its own (SHMINFER_DIR, which
    spawned workers, CLIs and Ray actors inherit), never in a deployed host's /run/shminfer.
    0755 like /run/shminfer, so peers running as other users reach their servers."""
    base = tempfile.mkdtemp(prefix="shminfer-run-")
    os.chmod(base, 0o755)
    old = os.environ.get("SHMINFER_DIR")
    os.environ["SHMINFER_DIR"] = base
    yield base
    if old is None:
        os.environ.pop("SHMINFER_DIR", None)
    else:
        os.environ["SHMINFER_DIR"] = old
    shutil.rmtree(base, ignore_errors=True)


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
