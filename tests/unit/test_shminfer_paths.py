"""shminfer's two hot paths: the optional C extension (shminfer._fast) and pure Python.

`make unit` runs the whole suite on the path the import chooses (C where the extension is
built) and the shminfer test files again with SHMINFER_PURE=1 (the Makefile's
SHMINFER_TESTS), so CI covers both. Here: the environment chooses the path, and where a C
compiler exists the extension must be built, so that CI cannot quietly test pure twice.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig

import pytest

from shminfer import _sys


def _implementation(pure: str) -> str:
    return subprocess.run(
        [sys.executable, "-c", "from shminfer import _sys; print(_sys.IMPLEMENTATION)"],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "SHMINFER_PURE": pure},
    ).stdout.strip()


def _extension_imports() -> bool:
    probe = subprocess.run(
        [sys.executable, "-c", "import shminfer._fast"],
        capture_output=True,
        check=False,
        env={**os.environ, "SHMINFER_PURE": ""},
    )
    return probe.returncode == 0


def test_the_environment_chooses_the_path():
    assert _implementation("1") == "pure"
    assert _implementation("") == ("c" if _extension_imports() else "pure")
    wanted = "pure" if os.environ.get("SHMINFER_PURE") == "1" else _implementation("")
    here = _sys.IMPLEMENTATION
    assert here == wanted


@pytest.mark.skipif(
    shutil.which("cc") is None
    or not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")),
    reason="no C compiler or no Python headers (python3-dev): the pure path only",
)
def test_the_extension_is_built_where_a_compiler_exists():
    assert _extension_imports(), (
        "shminfer._fast does not import: rebuild it with `make setup` (pip install -e .)"
    )
