"""ndarray dicts in a flat buffer: a small binary descriptor, then 64-byte aligned data.

Layout of one payload::

    u32 header_len | header | pad to 64 | array 0 data | pad | array 1 data | ...

header = u16 count, then per array: u8 name_len, name, u8 dtype_len, dtype.str, u8 ndim,
ndim x u64 dims, u64 offset (from the payload start), u64 nbytes.

Descriptors are cached by layout on the writer and by header bytes on the reader, so a
steady stream of same-shaped requests costs one memcpy per array and no parsing.
"""

from __future__ import annotations

import math
import re
import struct

import numpy as np

ALIGN = 64
MAX_ARRAYS = 64
MAX_DIMS = 32  # numpy 1.x's limit; numpy 2 allows 64, a payload never needs that many
MAX_ITEMSIZE = 16
MAX_DIM = 1 << 40
# Plain numeric and bool dtypes only ('<f4', '|b1', '>i8', ...): nothing with fields,
# objects, sub-arrays or sizes of its own.
_DTYPE = re.compile(r"^[<>|=]?[biufc][0-9]{1,2}$")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


class PayloadError(ValueError):
    """A payload that does not fit or cannot be decoded; the message names the problem."""


class TooLarge(PayloadError):
    """A payload larger than the slot it is written into."""


def _dtype(name, code: str) -> np.dtype:
    """The dtype of array ``name`` from its code (``dtype.str``), if a payload may carry it:
    the one check of writer and reader."""
    if not _DTYPE.match(code):
        raise PayloadError(
            f"array {name!r}: dtype code {code!r} refused (plain numeric and bool dtypes only)"
        )
    dtype = np.dtype(code)
    if dtype.hasobject or dtype.fields or dtype.itemsize > MAX_ITEMSIZE:
        raise PayloadError(f"array {name!r}: dtype {code!r} refused")
    return dtype


def _align(n: int) -> int:
    return (n + ALIGN - 1) & ~(ALIGN - 1)


class Layout:
    __slots__ = ("entries", "header", "total")

    def __init__(self, entries, header, total):
        self.entries = entries  # [(name, dtype, shape, offset, nbytes)]
        self.header = header
        self.total = total


def _build_layout(spec) -> Layout:
    parts = [struct.pack("<H", len(spec))]
    sizes = []
    for name, dtype, shape in spec:
        raw_name = name.encode()
        raw_dtype = dtype.str.encode()
        if len(raw_name) > 255:
            raise PayloadError(f"array name {name!r} is longer than 255 bytes")
        nbytes = math.prod(int(d) for d in shape) * dtype.itemsize
        sizes.append(nbytes)
        parts.append(bytes([len(raw_name)]) + raw_name + bytes([len(raw_dtype)]) + raw_dtype)
        parts.append(bytes([len(shape)]) + b"".join(_U64.pack(d) for d in shape))
        parts.append(b"\0" * 16)  # offset + nbytes, patched below
    header_len = sum(len(p) for p in parts)
    offset = _align(4 + header_len)
    entries = []
    patched = [parts[0]]
    for i, (name, dtype, shape) in enumerate(spec):
        patched += [parts[1 + 3 * i], parts[2 + 3 * i], _U64.pack(offset) + _U64.pack(sizes[i])]
        entries.append((name, dtype, shape, offset, sizes[i]))
        offset = _align(offset + sizes[i])
    header = b"".join(patched)
    return Layout(entries, _U32.pack(len(header)) + header, offset)


class Encoder:
    """Writes ndarray dicts into payload buffers.

    Layouts are cached by (name, dtype, shape); with ``slot`` (a key naming a buffer that
    lives as long as this encoder) the destination views are cached too, so a steady
    stream of same-shaped payloads costs one header write and one copy per array.
    """

    def __init__(self, max_layouts: int = 256):
        self._layouts: dict = {}
        self._dests: dict = {}
        self._max = max_layouts
        # slot -> (buf, ((name, dtype, shape), ...), header, total, dests, out): the layout
        # last written to that slot; the same layout again is checked field by field (no
        # key tuple, no dict of layouts) and costs a header write and one copy per array.
        # ``out`` is {name: dest} (None if an array is empty): see out_views.
        self._last: dict = {}

    def layout(self, arrays: dict) -> Layout:
        key = tuple((name, a.dtype, a.shape) for name, a in arrays.items())
        layout = self._layouts.get(key)
        if layout is None:
            # What the reader refuses is refused here, before a byte is written (a struct
            # or attribute error deep in the packing, or a half-written slot, otherwise).
            if len(arrays) > MAX_ARRAYS:
                raise PayloadError(f"{len(arrays)} arrays in one payload (at most {MAX_ARRAYS})")
            for name, a in arrays.items():
                if type(name) is not str:
                    raise TypeError(f"array names must be str, not {type(name).__name__}")
                if a.dtype.hasobject:
                    raise PayloadError("object arrays cannot be shared: use numeric dtypes")
                _dtype(name, a.dtype.str)
            spec = [(name, a.dtype, a.shape) for name, a in arrays.items()]
            if len(self._layouts) >= self._max:
                self._layouts.clear()
                self._dests.clear()
                self._last.clear()
            layout = self._layouts[key] = _build_layout(spec)
        return layout

    def encode_into(self, buf: memoryview, arrays: dict, slot=None) -> int:
        """Copy ``arrays`` into ``buf``; returns the payload length."""
        last = self._last.get(slot) if slot is not None else None
        if last is not None and last[0] is buf and len(last[1]) == len(arrays):
            for (name, array), (want_name, dtype, shape) in zip(arrays.items(), last[1]):
                if (
                    type(array) is not np.ndarray
                    or name != want_name
                    or (array.dtype is not dtype and array.dtype != dtype)
                    or array.shape != shape
                ):
                    break
            else:
                header = last[2]
                buf[: len(header)] = header
                for dest, array in zip(last[4], arrays.values()):
                    if dest is not None:
                        dest[...] = array  # same dtype and shape: a plain copy
                return last[3]
        return self._encode_slow(buf, arrays, slot)

    def out_views(self, buf: memoryview, slot):
        """{name: array} where the last payload written to ``slot`` (into ``buf``) keeps its
        arrays, or None: a writer of the same layout can put its arrays there itself and
        then call :meth:`encode_in_place` instead of copying them in."""
        last = self._last.get(slot)
        return last[5] if last is not None and last[0] is buf else None

    def encode_in_place(self, buf: memoryview, out: dict, slot) -> int:
        """``out`` (this slot's :meth:`out_views`) holds the arrays already: write the
        header; returns the payload length."""
        last = self._last.get(slot)
        if last is None or last[0] is not buf or last[5] is not out:
            raise PayloadError("the arrays are not this slot's payload views")
        header = last[2]
        buf[: len(header)] = header
        return last[3]

    def cached(self, buf: memoryview, slot):
        """(((name, dtype, shape), ...), header, payload length, dests) of the layout last
        written to ``slot`` (into ``buf``): what the next :meth:`encode_into` of arrays of
        those names, dtypes and shapes writes (dests: its arrays in ``buf``, None where an
        array is empty); None if nothing is cached."""
        last = self._last.get(slot)
        if last is None or last[0] is not buf:
            return None
        return last[1], last[2], last[3], last[4]

    def in_place_header(self, buf: memoryview, slot):
        """(header, payload length) of the layout :meth:`out_views` describes for ``slot``."""
        last = self._last.get(slot)
        if last is None or last[0] is not buf or last[5] is None:
            raise PayloadError("no payload views for this slot")
        return last[2], last[3]

    def _encode_slow(self, buf, arrays, slot):
        if not all(type(a) is np.ndarray for a in arrays.values()):
            arrays = {name: np.asarray(a) for name, a in arrays.items()}
        layout = self.layout(arrays)
        if layout.total > len(buf):
            raise TooLarge(f"payload of {layout.total} bytes does not fit a {len(buf)}-byte slot")
        dests = self._dests.get((slot, layout)) if slot is not None else None
        if dests is None:
            dests = [
                np.ndarray(shape, dtype=dtype, buffer=buf, offset=offset) if nbytes else None
                for _name, dtype, shape, offset, nbytes in layout.entries
            ]
            if slot is not None:
                self._dests[(slot, layout)] = dests
        if slot is not None:
            if len(self._last) >= 4 * self._max:
                self._last.clear()
            out = None
            if all(dest is not None for dest in dests):
                out = {entry[0]: dest for entry, dest in zip(layout.entries, dests)}
            self._last[slot] = (
                buf,
                tuple(e[:3] for e in layout.entries),
                layout.header,
                layout.total,
                dests,
                out,
            )
        buf[: len(layout.header)] = layout.header
        for dest, array in zip(dests, arrays.values()):
            if dest is not None:
                np.copyto(dest, array, casting="no")
        return layout.total


class Decoder:
    """Reads payloads as ndarray views into the buffer (no copy)."""

    def __init__(self, max_layouts: int = 256):
        self._layouts: dict = {}
        self._views: dict = {}
        self._max = max_layouts
        # slot -> (buf, descriptor view, descriptor bytes, views, min length): the layout
        # last read from that slot; the same descriptor again returns the same views.
        self._last: dict = {}

    def decode(self, buf: memoryview, length: int, slot=None) -> dict:
        """ndarray views of the payload in ``buf``.

        With ``slot`` (a key naming a buffer that lives as long as this decoder), the views
        are cached: the next payload of the same layout in that slot reuses them.
        """
        last = self._last.get(slot) if slot is not None else None
        if (
            last is not None
            and last[0] is buf
            and last[4] <= length <= len(buf)
            and last[1] == last[2]  # u32 length and descriptor bytes, as cached
        ):
            return last[3]
        if length < 6 or length > len(buf):
            raise PayloadError(f"payload length {length} is outside the slot (0..{len(buf)})")
        (header_len,) = _U32.unpack_from(buf, 0)
        if header_len < 2 or 4 + header_len > length:
            raise PayloadError(f"descriptor length {header_len} does not fit the payload")
        header = bytes(buf[4 : 4 + header_len])
        if slot is not None:
            views = self._views.get((slot, header))
            if views is not None and length >= views[1]:
                prefix = bytes(buf[: 4 + header_len])
                self._last[slot] = (buf, buf[: 4 + header_len], prefix, views[0], views[1])
                return views[0]
        known = self._layouts.get(header)
        if known is not None and length >= known[1]:
            entries = known[0]
        else:
            # Parsed afresh also when the payload is shorter than the one this descriptor
            # was seen in: the same bytes describe arrays past a shorter payload's end.
            entries = self._parse(header, length)
            if len(self._layouts) >= self._max:
                self._layouts.clear()
            end = max(
                [4 + len(header)]
                + [
                    offset + math.prod(shape) * dtype.itemsize
                    for _, dtype, shape, offset in entries
                ]
            )
            self._layouts[header] = (entries, end)
        try:
            views = {
                name: np.ndarray(shape, dtype=dtype, buffer=buf, offset=offset)
                for name, dtype, shape, offset in entries
            }
        except (ValueError, TypeError, OverflowError) as exc:  # checked already; belt and braces
            raise PayloadError(f"payload does not describe arrays in its buffer: {exc}") from None
        if slot is not None:
            if len(self._views) >= 4 * self._max:
                self._views.clear()
            self._views[(slot, header)] = (views, length)
            if len(self._last) >= 4 * self._max:
                self._last.clear()
            # Keyed on the whole prefix (u32 length + descriptor): a different length word
            # with the same bytes after it is a different payload.
            prefix = bytes(buf[: 4 + header_len])
            self._last[slot] = (buf, buf[: 4 + header_len], prefix, views, length)
        return views

    def cached(self, buf: memoryview, slot):
        """(prefix, minimum length, views) the next :meth:`decode` of ``slot`` returns the
        views for, when ``buf`` starts with ``prefix`` (the u32 descriptor length and the
        descriptor bytes) and its length is at least the minimum; None if none is cached."""
        last = self._last.get(slot)
        if last is None or last[0] is not buf:
            return None
        return last[2], last[4], last[3]

    @staticmethod
    def _parse(header: bytes, length: int):
        """Entries of a descriptor that come from an untrusted peer: every count, size, code
        and offset is checked against the payload with exact integer arithmetic."""
        try:
            (count,) = struct.unpack_from("<H", header, 0)
            if count > MAX_ARRAYS:
                raise PayloadError(f"{count} arrays in one payload (at most {MAX_ARRAYS})")
            pos = 2
            entries = []
            names = set()
            for _ in range(count):
                n = header[pos]
                name = header[pos + 1 : pos + 1 + n].decode()
                if len(name.encode()) != n or not name.isprintable() or name in names:
                    raise PayloadError("malformed payload descriptor: bad or repeated array name")
                names.add(name)
                pos += 1 + n
                n = header[pos]
                code = header[pos + 1 : pos + 1 + n].decode("ascii")
                if len(code) != n:
                    raise PayloadError(f"array {name!r}: dtype code {code!r} refused")
                dtype = _dtype(name, code)
                pos += 1 + n
                ndim = header[pos]
                pos += 1
                if ndim > MAX_DIMS:
                    raise PayloadError(f"array {name!r}: {ndim} dimensions (at most {MAX_DIMS})")
                shape = struct.unpack_from(f"<{ndim}Q", header, pos)
                pos += 8 * ndim
                if any(d > MAX_DIM for d in shape):
                    raise PayloadError(f"array {name!r}: dimension over {MAX_DIM} refused")
                offset, nbytes = struct.unpack_from("<QQ", header, pos)
                pos += 16
                # Exact: Python ints do not wrap, so (2**32, 2**32) cannot pass as 0 bytes.
                want = math.prod(shape) * dtype.itemsize
                if (
                    nbytes != want
                    or offset % ALIGN
                    or offset + nbytes > length
                    or offset < 4 + len(header)
                ):
                    raise PayloadError(
                        f"array {name!r}: {nbytes} bytes at offset {offset} do not match "
                        f"shape {_short(shape)} {dtype} inside a {length}-byte payload"
                    )
                entries.append((name, dtype, shape, offset))
        except PayloadError:
            raise
        except (IndexError, struct.error, UnicodeDecodeError, TypeError, ValueError) as exc:
            raise PayloadError(f"malformed payload descriptor: {exc}") from None
        if pos != len(header):
            raise PayloadError("malformed payload descriptor: trailing bytes")
        return entries


def _short(shape) -> str:
    text = str(tuple(shape))
    return text if len(text) <= 80 else text[:77] + "..."
