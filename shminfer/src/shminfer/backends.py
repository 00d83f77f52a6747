"""Inference backends. A backend loads one model and runs batches of ndarray dicts.

Add one by subclassing :class:`Backend` and registering it in :data:`BACKENDS`; the worker
calls ``load`` once (after pinning, with the thread limit set) and ``infer_into`` per batch
(``infer`` unless a backend overrides it).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np


class BackendError(RuntimeError):
    pass


class Backend:
    name = "base"
    # Whether requests of one signature are worth merging into one model call (one call's
    # fixed cost shared, as an engine's is). False: the worker serves READY requests one at
    # a time, oldest first, each answered in place when the backend can (infer_into).
    merge = True

    def load(self, model: str | None, threads: int = 1) -> None:
        raise NotImplementedError

    def describe(self) -> dict:
        """{"inputs": {name: {"shape": [...], "dtype": "float32"}}, "outputs": {...}}."""
        raise NotImplementedError

    def infer(self, inputs: dict) -> dict:
        raise NotImplementedError

    def infer_into(self, inputs: dict, out: dict | None) -> dict:
        """``infer``, with the chance to write the outputs where the worker sends them.

        ``out`` is None or {name: array}: views of the response slot, laid out as the last
        answer in that slot was (same names, dtypes and shapes, every first dimension the
        batch's). A backend whose outputs for ``inputs`` have exactly that layout may write
        them into those arrays and return ``out`` itself, unchanged as a dict: the worker
        then writes only the response header, no copy. Anything else it returns is copied
        into the slot as ``infer``'s outputs are. The slot is shared memory: a peer may
        scribble on it, so a backend never reads back from ``out`` what it needs intact.
        """
        return self.infer(inputs)


class EchoBackend(Backend):
    """Returns each input twice along the last axis: 16 KiB in, 32 KiB out (the IPC bench)."""

    name = "echo"
    merge = False  # an echo costs the same per row: merging would only add two copies

    def __init__(self):
        self._cached = None
        # id(out array) -> (out array, input view, its halves): the slot arrays and the
        # request views live as long as the worker, so both are kept and compared by identity.
        self._by_out = {}

    def load(self, model=None, threads=1):
        self._width = 4096 if not model else int(model)

    def describe(self):
        return {
            "inputs": {"x": {"shape": [-1, self._width], "dtype": "float32"}},
            "outputs": {"y": {"shape": [-1, 2 * self._width], "dtype": "float32"}},
        }

    def infer(self, inputs):
        return self._echo(inputs, None)

    def infer_into(self, inputs, out):
        return self._echo(inputs, out)

    def _echo(self, inputs, out):
        try:
            x = inputs["x"]
        except KeyError:
            raise BackendError(f"input 'x' missing (got {sorted(inputs)})") from None
        if out is not None and len(out) == 1:
            # The response slot's own array, when its layout is this answer's: one copy.
            y = out.get("y")
            pair = self._by_out.get(id(y))
            if pair is None or pair[0] is not y or pair[1] is not x:
                pair = self._pair(y, x)
            if pair is not None:
                pair[2][...] = pair[3]  # both halves in one numpy assignment
                return out
        # Reuse the output buffer, as an inference engine reuses its output tensors: the
        # same input shape and dtype again costs the one assignment only.
        cached = self._cached
        if cached is None or cached[0] != x.shape or cached[1] is not x.dtype:
            y = np.empty((*x.shape[:-1], 2 * x.shape[-1]) if x.ndim else (2,), x.dtype)
            cached = self._cached = [x.shape, x.dtype, y, *self._halves(y, x), x]
        elif cached[5] is not x:
            cached[4], cached[5] = self._halves(cached[2], x)[1], x
        cached[3][...] = cached[4]
        return {"y": cached[2]}

    @staticmethod
    def _halves(y, x):
        """(y as [..., 2, width], x as [..., 1, width]): one broadcast assignment of the
        second into the first writes both halves of the echo (views: no copy here)."""
        if not x.ndim:
            return y.reshape(2, 1), x.reshape(1, 1)
        return y.reshape(*x.shape[:-1], 2, x.shape[-1]), x[..., None, :]

    def _pair(self, y, x):
        """(y, x, y's halves view, x's broadcast view) when ``y`` is the echo of ``x``'s
        shape and dtype (cached by ``y``: the slot's arrays live as long as the worker),
        else None. ``y`` is the response slot's C-contiguous array (Encoder.out_views)."""
        if type(y) is not np.ndarray or type(x) is not np.ndarray or y.dtype != x.dtype:
            return None
        if y.shape != ((*x.shape[:-1], 2 * x.shape[-1]) if x.ndim else (2,)):
            return None
        if not y.flags.c_contiguous:
            return None
        if len(self._by_out) >= 4096:
            self._by_out.clear()
        self._by_out[id(y)] = entry = (y, x, *self._halves(y, x))
        return entry


def _milliseconds(backend, model):
    """The drill backends' --model: milliseconds (1 without one)."""
    try:
        return float(1.0 if model is None else model)
    except ValueError:
        raise BackendError(
            f"the {backend} backend takes --model MILLISECONDS, got {model!r}"
        ) from None


class BurnBackend(EchoBackend):
    """Burns a fixed amount of CPU per batch (``--model MS``), then echoes.

    A model with a known, single-threaded cost: for load tests, fault drills and nodes
    where no real model is deployed yet.
    """

    name = "burn"
    merge = True  # a fixed CPU cost per model call, as an engine's

    def load(self, model=None, threads=1):
        self._burn_ns = int(_milliseconds(self.name, model) * 1e6)
        self._width = 4096

    def infer(self, inputs):
        return self.infer_into(inputs, None)

    def infer_into(self, inputs, out):
        until = time.thread_time_ns() + self._burn_ns
        while time.thread_time_ns() < until:
            pass
        return self._echo(inputs, out)


class SleepBackend(EchoBackend):
    """Copies its inputs first, then sleeps ``--model MS`` of wall time (no CPU), then echoes
    the copy: a slow or hung engine for fault drills (``--model 1e9`` never answers)."""

    name = "sleep"
    merge = True

    def load(self, model=None, threads=1):
        self._sleep_s = _milliseconds(self.name, model) / 1e3
        self._width = 4096

    def infer(self, inputs):
        copied = {name: np.array(value) for name, value in inputs.items()}
        time.sleep(self._sleep_s)
        return {name: np.array(value) for name, value in self._echo(copied, None).items()}

    def infer_into(self, inputs, out):
        return self.infer(inputs)  # fresh arrays, always: what a slow engine's copy-out is


class NumpyMLPBackend(Backend):
    """Reference backend: a dense MLP (ReLU) whose weights are an .npz file.

    ``shminfer make-model`` writes the same network as .npz and as OpenVINO IR, so the two
    backends can be compared output for output.
    """

    name = "numpy"

    def load(self, model=None, threads=1):
        if not model:
            raise BackendError("the numpy backend needs --model FILE.npz (shminfer make-model)")
        path = Path(model).with_suffix(".npz")
        try:
            with np.load(path) as data:
                self._layers = [(data[f"w{i}"], data[f"b{i}"]) for i in range(len(data.files) // 2)]
        except (OSError, KeyError, ValueError) as exc:
            raise BackendError(f"{path}: cannot load MLP weights ({exc})") from None

    def describe(self):
        first, last = self._layers[0][0], self._layers[-1][0]
        return {
            "inputs": {"obs": {"shape": [-1, first.shape[0]], "dtype": "float32"}},
            "outputs": {"logits": {"shape": [-1, last.shape[1]], "dtype": "float32"}},
        }

    def _checked(self, inputs):
        try:
            x = inputs["obs"]
        except KeyError:
            raise BackendError(f"input 'obs' missing (got {sorted(inputs)})") from None
        expected = self._layers[0][0].shape[0]
        if x.ndim != 2 or x.shape[1] != expected or x.dtype != np.float32:
            raise BackendError(
                f"'obs' must be float32 [batch, {expected}], got {x.dtype} {list(x.shape)}"
            )
        return x

    def _hidden(self, x):
        for w, b in self._layers[:-1]:
            x = np.maximum(x @ w + b, 0.0)
        return x

    def infer(self, inputs):
        w, b = self._layers[-1]
        return {"logits": self._hidden(self._checked(inputs)) @ w + b}

    def infer_into(self, inputs, out):
        x = self._checked(inputs)
        w, b = self._layers[-1]
        logits = out.get("logits") if out is not None and len(out) == 1 else None
        if (
            type(logits) is not np.ndarray
            or logits.dtype != np.float32
            or logits.shape != (x.shape[0], w.shape[1])
        ):
            return {"logits": self._hidden(x) @ w + b}
        # infer's last layer (x @ w, then + b), computed into the response slot.
        np.matmul(self._hidden(x), w, out=logits)
        logits += b
        return out


class OpenVINOBackend(Backend):
    """OpenVINO on the CPU with one inference thread and no hidden helper threads."""

    name = "openvino"

    def load(self, model=None, threads=1):
        if not model:
            raise BackendError("the openvino backend needs --model FILE.xml (shminfer make-model)")
        try:
            import openvino as ov  # noqa: PLC0415 - optional dependency, loaded in the worker
        except ImportError:
            raise BackendError(
                "OpenVINO is not installed: pip install 'shminfer[openvino]'"
            ) from None
        path = Path(model).with_suffix(".xml")
        if not path.exists():
            raise BackendError(f"{path}: no such model file")
        core = ov.Core()
        compiled = core.compile_model(
            core.read_model(str(path)),
            "CPU",
            {
                "INFERENCE_NUM_THREADS": threads,
                "NUM_STREAMS": 1,
                "PERFORMANCE_HINT": "LATENCY",
                "ENABLE_CPU_PINNING": False,  # we pin the whole process ourselves
                # OpenVINO picks bf16 by itself on CPUs with AVX512-BF16 or AMX: the same
                # policy would answer differently from node to node (seen: 1e-2 off numpy).
                "INFERENCE_PRECISION_HINT": "f32",
            },
        )
        self._request = compiled.create_infer_request()
        self._inputs = [p.get_any_name() for p in compiled.inputs]
        self._outputs = [p.get_any_name() for p in compiled.outputs]
        self._compiled = compiled
        self.threads = int(compiled.get_property("INFERENCE_NUM_THREADS"))

    def describe(self):
        def spec(ports):
            return {
                p.get_any_name(): {
                    "shape": [d.get_length() if d.is_static else -1 for d in p.get_partial_shape()],
                    "dtype": str(p.get_element_type().to_dtype()),
                }
                for p in ports
            }

        return {"inputs": spec(self._compiled.inputs), "outputs": spec(self._compiled.outputs)}

    def infer(self, inputs):
        missing = [n for n in self._inputs if n not in inputs]
        if missing:
            raise BackendError(f"inputs {missing} missing (got {sorted(inputs)})")
        try:
            self._request.infer({n: inputs[n] for n in self._inputs})
        except RuntimeError as exc:
            raise BackendError(
                f"OpenVINO rejected the request: {str(exc).splitlines()[0]}"
            ) from None
        return {n: self._request.get_tensor(n).data.copy() for n in self._outputs}


BACKENDS = {
    b.name: b for b in (EchoBackend, BurnBackend, SleepBackend, NumpyMLPBackend, OpenVINOBackend)
}


def check_model(backend: str, model: str | None) -> None:
    """Refuse, before anything starts, a backend or model the worker could not load."""
    make_backend(backend)
    if backend in ("numpy", "openvino"):
        if not model:
            raise BackendError(f"the {backend} backend needs --model (shminfer make-model)")
        suffixes = (".npz",) if backend == "numpy" else (".xml", ".bin")
        for suffix in suffixes:
            path = Path(model).with_suffix(suffix)
            try:
                with open(path, "rb") as handle:
                    handle.read(1)
            except OSError as exc:
                raise BackendError(
                    f"--model {model}: cannot read {path} ({exc.strerror})"
                ) from None
    elif backend in ("burn", "sleep"):
        _milliseconds(backend, model)


def make_backend(name: str) -> Backend:
    try:
        return BACKENDS[name]()
    except KeyError:
        raise BackendError(f"unknown backend {name!r}; choose from {sorted(BACKENDS)}") from None


def make_model(path: str, inputs: int = 64, hidden: int = 256, outputs: int = 16, seed: int = 0):
    """Write a small MLP as PATH.npz (numpy backend) and PATH.xml/.bin (OpenVINO IR).

    Built locally from a seeded random generator: no downloads.
    """
    rng = np.random.default_rng(seed)
    sizes = [inputs, hidden, hidden, outputs]
    layers = []
    for i in range(len(sizes) - 1):
        w = (rng.standard_normal((sizes[i], sizes[i + 1])) / np.sqrt(sizes[i])).astype(np.float32)
        b = (rng.standard_normal(sizes[i + 1]) * 0.01).astype(np.float32)
        layers.append((w, b))
    base = Path(path).with_suffix("")
    base.parent.mkdir(parents=True, exist_ok=True)
    np.savez(
        base.with_suffix(".npz"),
        **{
            key: value
            for i, (w, b) in enumerate(layers)
            for key, value in ((f"w{i}", w), (f"b{i}", b))
        },
    )
    written = [str(base.with_suffix(".npz"))]
    try:
        import openvino as ov  # noqa: PLC0415
        from openvino import opset13 as ops  # noqa: PLC0415
    except ImportError:
        return written
    x = ops.parameter([-1, inputs], np.float32, name="obs")
    node = x
    for i, (w, b) in enumerate(layers):
        node = ops.add(ops.matmul(node, ops.constant(w), False, False), ops.constant(b))
        if i < len(layers) - 1:
            node = ops.relu(node)
    node.output(0).get_tensor().set_names({"logits"})
    model = ov.Model([node], [x], "shminfer-mlp")
    ov.save_model(model, str(base.with_suffix(".xml")), compress_to_fp16=False)
    written += [str(base.with_suffix(".xml")), str(base.with_suffix(".bin"))]
    meta = {"inputs": inputs, "hidden": hidden, "outputs": outputs, "seed": seed}
    base.with_suffix(".json").write_text(json.dumps(meta) + "\n")
    written.append(str(base.with_suffix(".json")))
    return written
