"""The optional C hot path of shminfer (src/shminfer/_fast.c); everything else is in pyproject.

Built against the stable ABI (Py_LIMITED_API 3.9): one abi3 wheel per architecture,
``shminfer-*-cp39-abi3-linux_<arch>.whl``, serves every node Python >= 3.9. ``optional=True``:
without a compiler (or off Linux) the build goes on without it and shminfer runs its
pure-Python path; SHMINFER_PURE=1 forces that path at import even where it is built.
SHMINFER_BUILD=pure builds the pure wheel (``py3-none-any``) on purpose: what the runtime
role ships to nodes of an architecture the controller cannot compile for.

Reproducible: no debug info and no build paths in the object (-g0, -ffile-prefix-map), and
the role builds with SOURCE_DATE_EPOCH fixed, so the same tree and compiler give the same
wheel bytes.
"""

import os
from pathlib import Path

from setuptools import Extension, setup

ROOT = Path(__file__).resolve().parent

if os.environ.get("SHMINFER_BUILD", "").strip() == "pure":
    setup()
else:
    setup(
        ext_modules=[
            Extension(
                "shminfer._fast",
                ["src/shminfer/_fast.c"],
                define_macros=[("Py_LIMITED_API", "0x03090000")],
                py_limited_api=True,
                optional=True,
                extra_compile_args=[
                    "-O2",
                    "-std=gnu11",
                    "-Wall",
                    "-g0",
                    f"-ffile-prefix-map={ROOT}=.",
                ],
            )
        ],
        options={"bdist_wheel": {"py_limited_api": "cp39"}},
    )
