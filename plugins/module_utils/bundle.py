"""Reproducible tar bundles: what the runtime role ships to a node in one transfer.

The same members give the same bytes (sorted names, fixed mtime, root:root, fixed modes,
uncompressed: wheels and models compress poorly and the node unpacks faster), so the
role's copy changes nothing when nothing changed. Each directory in the bundle gets a
``SHA256SUMS`` that the node checks (``sha256sum --check``) before it uses the files.
"""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
import tempfile
from pathlib import Path, PurePosixPath

# 1980-01-01, the epoch zip (wheels) can represent; also the role's SOURCE_DATE_EPOCH.
MTIME = 315532800
CHUNK = 1 << 20


class BundleError(ValueError):
    """A member spec that cannot be bundled; the message says what to fix."""


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(CHUNK), b""):
            digest.update(block)
    return digest.hexdigest()


def parse_members(specs: list[str]) -> dict[str, Path]:
    """``DIR/NAME=PATH`` or ``DIR=PATH`` (NAME is PATH's) -> {DIR/NAME: path}."""
    members: dict[str, Path] = {}
    for spec in specs:
        arcname, sep, path = spec.partition("=")
        if sep and path and "/" not in arcname.strip("/"):
            arcname = f"{arcname.strip('/')}/{PurePosixPath(path).name}"
        parts = PurePosixPath(arcname).parts
        if not sep or not path or len(parts) != 2 or ".." in parts or arcname.startswith("/"):
            raise BundleError(
                f"member {spec!r}: write DIR/NAME=PATH or DIR=PATH, e.g. wheels=/tmp/x.whl"
            )
        if parts[1] == "SHA256SUMS":
            raise BundleError(f"member {spec!r}: SHA256SUMS is written by the bundle itself")
        if arcname in members:
            raise BundleError(f"member {arcname!r} is given twice")
        source = Path(path)
        if not source.is_file():
            raise BundleError(f"member {arcname!r}: {path} is not a file")
        members[arcname] = source
    if not members:
        raise BundleError("no members: give at least one DIR/NAME=PATH")
    return members


def _info(name: str, size: int, mode: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size = size
    info.mtime = MTIME
    info.mode = mode
    info.uid = info.gid = 0
    info.uname = info.gname = "root"
    return info


def write_bundle(out: str | os.PathLike, specs: list[str]) -> dict:
    """Write the bundle to OUT unless OUT already holds the same bytes.

    Returns {"path", "sha256", "changed", "members"}; OUT is replaced atomically.
    """
    members = parse_members(specs)
    out = Path(out)
    sums: dict[str, list[str]] = {}
    for arcname in sorted(members):
        directory, name = arcname.split("/")
        sums.setdefault(directory, []).append(f"{_sha256(members[arcname])}  {name}\n")

    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", dir=out.parent)
    try:
        with (
            os.fdopen(fd, "wb") as raw,
            tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar,
        ):
            for directory in sorted(sums):
                tar.addfile(_dir_info(directory))
                entries = sorted(a for a in members if a.startswith(directory + "/"))
                for arcname in entries:
                    source = members[arcname]
                    with source.open("rb") as handle:
                        tar.addfile(_info(arcname, source.stat().st_size, 0o644), handle)
                listing = "".join(sums[directory]).encode()
                tar.addfile(
                    _info(f"{directory}/SHA256SUMS", len(listing), 0o644), io.BytesIO(listing)
                )
        digest = _sha256(Path(tmp))
        changed = not (out.is_file() and _sha256(out) == digest)
        if changed:
            os.chmod(tmp, 0o644)
            os.replace(tmp, out)
        else:
            os.unlink(tmp)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return {"path": str(out), "sha256": digest, "changed": changed, "members": len(members)}


def _dir_info(name: str) -> tarfile.TarInfo:
    info = _info(name, 0, 0o755)
    info.type = tarfile.DIRTYPE
    return info
