"""shminfer's two hot paths: the optional C extension (shminfer._fast) and pure Python.

`make unit` runs the whole suite on the path the import chooses (C where the extension is
built) and the shminfer test files again with SHMINFER_PURE=1 (the Makefile's
SHMINFER_TESTS), so CI covers both. Here: the environment chooses the path, and where a C
compiler exists the extension must be built, so that CI cannot quietly test pure twice.
"""

from __future__ import annotations

import itertools
import os
import platform
import shutil
import subprocess
import sys
import sysconfig

import numpy as np
import pytest

from shminfer import _sys
from shminfer.codec import Encoder
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


def test_the_c_port_refuses_a_geometry_outside_its_mapping_and_layouts_outside_a_slot():
    fast = pytest.importorskip("shminfer._fast")
    seg = Segment.create(f"port{os.getpid()}", slot_count=4, request_bytes=4096)
    try:
        offsets = (seg.states_off, seg.table_off, seg.requests_off, seg.responses_off, seg.ring_off)

        def port(map_len, geometry=seg.geometry, at=offsets):
            keep = (memoryview(seg.mm),)
            return fast.port(keep, _sys.address_of(seg.mm), map_len, geometry, at, np.ndarray)

        for map_len, geometry, at in (
            (len(seg.mm) - 4096, seg.geometry, offsets),  # the ring past the end
            (len(seg.mm), (5, *seg.geometry[1:]), offsets),  # a slot more: regions overlap
            (len(seg.mm), (4, 2**62, *seg.geometry[2:]), offsets),  # sizes that overflow
            (len(seg.mm), seg.geometry, (0, *offsets[1:])),  # states over the header
        ):
            with pytest.raises(ValueError, match="outside the mapping"):
                port(map_len, geometry, at)
        good = port(len(seg.mm))
        dest = np.ndarray((4,), np.float32, buffer=seg.request_view(0), offset=64)
        layout = (("x",), (dest.dtype,), (dest.shape,), (dest,))
        elsewhere = np.zeros(4, np.float32)  # not in the request slot: refused
        with pytest.raises(TypeError, match="bad layout"):
            good.learn_send(0, *layout[:3], (elsewhere,), b"\0" * 8, 128)
        with pytest.raises(TypeError, match="bad layout"):  # over the slot's header
            good.learn_send(0, *layout, b"\0" * 72, 128)
        with pytest.raises(IndexError):
            good.learn_send(4, *layout, b"\0" * 8, 128)
        with pytest.raises(IndexError):
            good.recv(4, 1, 0)
        with pytest.raises(ValueError, match="outside the slot"):
            good.learn_send(0, *layout, b"\0" * 8, 4097)  # longer than a request slot
        with pytest.raises(ValueError, match="outside the slot"):
            good.learn_recv(0, b"\0" * 8, seg.response_bytes + 64, {})
        with pytest.raises(TypeError, match="bad layout"):
            good.learn_send(
                0, ("x",), (dest.dtype,), (dest.shape,), (bytearray(16),), b"\0" * 8, 128
            )
        good.learn_send(0, *layout, b"\0" * 8, 128)
        # Not the learned layout (another dtype, shape, name or a list): nothing written.
        for inputs in (
            {"x": dest.astype(np.float64)},
            {"x": np.zeros(5, np.float32)},
            {"z": dest},
            {"x": [0.0] * 4},
            {"x": dest, "y": dest},
        ):
            assert good.send(0, inputs, 7) is None
            assert seg.state_words[0] == 0
        assert good.recv(0, 7, 0) == 0  # FREE: the state, for the Python client to judge
        # What send writes is what the Python encoder writes, for contiguous inputs (a
        # memcpy) and strided ones (numpy's assignment), and the publish's fields.
        encoder = Encoder()
        request = seg.request_view(1)
        first = {"a": np.arange(6, dtype="<i8").reshape(2, 3), "b": np.ones(5, np.float32)}
        encoder.encode_into(request, first, slot=1)
        spec, header, total, dests = encoder.cached(request, 1)
        good.learn_send(1, *(tuple(column) for column in zip(*spec)), tuple(dests), header, total)
        wide = np.arange(12, dtype="<i8").reshape(2, 6) * 7
        for inputs in (
            {"a": np.arange(6, dtype="<i8").reshape(2, 3) + 40, "b": np.full(5, 3.5, np.float32)},
            {"a": wide[:, ::2], "b": np.arange(10, dtype=np.float32)[::2]},
        ):
            assert good.send(1, inputs, 0xABC) == total
            expected = bytearray(len(request))
            Encoder().encode_into(memoryview(expected), inputs)
            assert bytes(request[:total]) == bytes(expected[:total])
            assert seg.state_words[1] == 2  # READY
            assert seg.slot_get(1, "request_len") == total
            assert seg.slot_get(1, "seq") == 0xABC
            seg.state_words[1] = 0
        del good
    finally:
        seg.close()


def test_the_c_port_writes_large_inputs_byte_for_byte_as_the_encoder():
    # Inputs of 4 KiB and more go out with plain or (x86-64, after a slow plain copy)
    # streaming stores: the same bytes as the encoder's either way, whatever the length's
    # tail and the source's alignment.
    fast = pytest.importorskip("shminfer._fast")
    seg = Segment.create(f"portbig{os.getpid()}", slot_count=2, request_bytes=1 << 16)
    try:
        offsets = (seg.states_off, seg.table_off, seg.requests_off, seg.responses_off, seg.ring_off)
        port = fast.port(
            (memoryview(seg.mm),),
            _sys.address_of(seg.mm),
            len(seg.mm),
            seg.geometry,
            offsets,
            np.ndarray,
        )
        rng = np.random.default_rng(3)
        raw = rng.integers(0, 256, 40_000, dtype=np.uint8)
        for size, streamed in itertools.product((4096, 4097, 16_404, 20_000 - 63), (0, 2)):
            port.stream(streamed)  # 0: a plain (timed) copy; 2: both arrays streamed
            request = seg.request_view(0)
            first = {"a": raw[:size].copy(), "b": raw[:5000].view(np.float32)[:1000].copy()}
            encoder = Encoder()
            encoder.encode_into(request, first, slot=0)
            spec, header, total, dests = encoder.cached(request, 0)
            columns = tuple(tuple(column) for column in zip(*spec))
            port.learn_send(0, *columns, tuple(dests), header, total)
            # A source one byte off alignment, and one at the buffer's start.
            inputs = {"a": raw[1 : size + 1], "b": raw[8:4008].view(np.float32)}
            request[:total] = b"\xee" * total  # nothing of the last request left
            expected = bytearray(request)
            assert port.send(0, inputs, 9) == total
            Encoder().encode_into(memoryview(expected), inputs)
            assert bytes(request[:total]) == bytes(expected[:total]), (size, streamed)
            if streamed and platform.machine() == "x86_64":
                assert port.stream(0) == 1  # "b" is under 4 KiB: only "a" streamed
            seg.state_words[0] = 0
        del port
    finally:
        seg.close()
