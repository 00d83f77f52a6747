"""What ships to a node imports there: a module the shipped code imports but the shipping
leaves out fails here, not on a host.

The shminfer wheel is built from its source tree the way the runtime role builds it and
imported by a fresh Python that sees nothing of this repository. (The host package, copied
file by file from the host role's runtime.yml, is checked the same way in
test_collection_layout.)
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy
from conftest import REPO


def _fresh_python(path: list[Path], code: str) -> subprocess.CompletedProcess:
    """``code`` run by a Python without site (no .pth, so no editable checkout), user site
    or PYTHONPATH, with ``path`` first on sys.path."""
    prelude = "import sys; sys.path[:0] = %r\n" % [str(p) for p in path]
    return subprocess.run(
        [sys.executable, "-I", "-S", "-c", prelude + code],
        capture_output=True,
        text=True,
        check=False,
        cwd="/",
    )


def _source_copy(dest: Path) -> Path:
    """shminfer's source tree with its links followed and no build leftovers, so that this
    build shares no directory with another test's."""
    skip = shutil.ignore_patterns("build", "dist", "*.egg-info", "__pycache__", "*.so")
    shutil.copytree(REPO / "shminfer", dest, symlinks=False, ignore=skip)
    return dest


def test_the_shminfer_wheel_carries_the_topology_reader_and_what_it_imports(tmp_path):
    source = _source_copy(tmp_path / "shminfer")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
         "--wheel-dir", str(tmp_path / "wheels"), str(source)],
        check=True,
        env={**os.environ, "SHMINFER_BUILD": "pure", "SOURCE_DATE_EPOCH": "315532800"},
    )  # fmt: skip
    (wheel,) = (tmp_path / "wheels").glob("shminfer-*-py3-none-any.whl")
    # shminfer's own dependencies (numpy, rich) from this environment, shminfer only from
    # the wheel (a wheel imports from its zip).
    site = Path(numpy.__file__).resolve().parents[1]
    run = _fresh_python(
        [wheel, site],
        "import shminfer.topology, shminfer.locality\n"
        "assert shminfer.topology.__file__.startswith(%r), shminfer.topology.__file__\n"
        "print(shminfer.topology.read_topology('/')['schema'])\n" % str(wheel),
    )
    assert run.returncode == 0 and run.stdout.strip() == "1", run.stderr
