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

import numpy as np
import pytest

from shminfer import _sys
from shminfer.queue import Segment


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


def test_the_c_loop_refuses_a_geometry_outside_its_mapping_and_slots_outside_it():
    fast = pytest.importorskip("shminfer._fast")
    seg = Segment.create(f"paths{os.getpid()}", slot_count=4, request_bytes=4096)
    claims = bytearray(16)
    try:
        offsets = (seg.states_off, seg.table_off, seg.requests_off, seg.responses_off, seg.ring_off)

        def loop(map_len, geometry=seg.geometry, at=offsets):
            keep = (memoryview(seg.mm), claims, None)
            base = _sys.address_of(seg.mm)
            return fast.loop(
                keep, base, map_len, geometry, at, _sys.address_of(claims), None, 1e9, 1e9
            )

        for map_len, geometry, at in (
            (len(seg.mm) - 4096, seg.geometry, offsets),  # the ring past the end
            (len(seg.mm), (5, *seg.geometry[1:]), offsets),  # a slot more: regions overlap
            (len(seg.mm), (4, 2**62, *seg.geometry[2:]), offsets),  # sizes that overflow
            (len(seg.mm), (4, *seg.geometry[1:3], 0), offsets),  # no ring
            (len(seg.mm), seg.geometry, (*offsets[:4], 2**64 - 8)),
            (len(seg.mm), seg.geometry, (0, *offsets[1:])),  # states over the header
        ):
            with pytest.raises(ValueError, match="outside the mapping"):
                loop(map_len, geometry, at)
        good = loop(len(seg.mm))
        views = {"x": np.zeros(1, np.float32)}
        with pytest.raises(IndexError):
            good.learn(4, b"\0" * 8, 64, views, 1, None, b"", 0)
        with pytest.raises(ValueError, match="outside the slot"):
            good.learn(0, b"\0" * 8, 4097, views, 1, None, b"", 0)  # longer than a slot
        with pytest.raises(ValueError, match="outside the slot"):
            good.learn(0, b"\0" * 8, 64, views, 1, {}, b"\0" * 8, seg.response_bytes + 64)
        good.learn(0, b"\0" * 8, 64, views, 1, None, b"", 0)
        assert good.serve(lambda inputs, out: out) is None  # nothing READY
        del good
    finally:
        seg.close()
