"""Inference backends. A backend loads one model and runs batches of ndarray dicts.

Add one by subclassing :class:`Backend` and registering it in :data:`BACKENDS`; the worker
calls ``load`` once (after pinning, with the thread limit set) and ``infer`` per batch.
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

    def load(self, model: str | None, threads: int = 1) -> None:
        raise NotImplementedError

    def describe(self) -> dict:
        """{"inputs": {name: {"shape": [...], "dtype": "float32"}}, "outputs": {...}}."""
        raise NotImplementedError

    def infer(self, inputs: dict) -> dict:
        raise NotImplementedError


class EchoBackend(Backend):
    """Returns each input twice along the last axis: 16 KiB in, 32 KiB out (the IPC bench)."""

    name = "echo"

    def load(self, model=None, threads=1):
        self._width = 4096 if not model else int(model)

    def describe(self):
        return {
            "inputs": {"x": {"shape": [-1, self._width], "dtype": "float32"}},
            "outputs": {"y": {"shape": [-1, 2 * self._width], "dtype": "float32"}},
        }

    def infer(self, inputs):
        try:
            x = inputs["x"]
        except KeyError:
            raise BackendError(f"input 'x' missing (got {sorted(inputs)})") from None
        # Reuse the output buffer (and its two halves), as an inference engine reuses its
        # output tensors: the same input shape and dtype again costs the two copies only.
        cached = getattr(self, "_cached", None)
        if cached is None or cached[0] != x.shape or cached[1] is not x.dtype:
            shape = (*x.shape[:-1], 2 * x.shape[-1]) if x.ndim else (2,)
            out = np.empty(shape, x.dtype)
            width = x.shape[-1] if x.ndim else 1
            cached = self._cached = (x.shape, x.dtype, out, out[..., :width], out[..., width:])
        cached[3][...] = x
        cached[4][...] = x
        return {"y": cached[2]}


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

    def load(self, model=None, threads=1):
        self._burn_ns = int(_milliseconds(self.name, model) * 1e6)
        self._width = 4096

    def infer(self, inputs):
        until = time.thread_time_ns() + self._burn_ns
        while time.thread_time_ns() < until:
            pass
        return super().infer(inputs)


class SleepBackend(EchoBackend):
    """Copies its inputs first, then sleeps ``--model MS`` of wall time (no CPU), then echoes
    the copy: a slow or hung engine for fault drills (``--model 1e9`` never answers)."""

    name = "sleep"

    def load(self, model=None, threads=1):
        self._sleep_s = _milliseconds(self.name, model) / 1e3
        self._width = 4096

    def infer(self, inputs):
        copied = {name: np.array(value) for name, value in inputs.items()}
        time.sleep(self._sleep_s)
        return {name: np.array(value) for name, value in super().infer(copied).items()}


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

    def infer(self, inputs):
        try:
            x = inputs["obs"]
        except KeyError:
            raise BackendError(f"input 'obs' missing (got {sorted(inputs)})") from None
        expected = self._layers[0][0].shape[0]
        if x.ndim != 2 or x.shape[1] != expected or x.dtype != np.float32:
            raise BackendError(
                f"'obs' must be float32 [batch, {expected}], got {x.dtype} {list(x.shape)}"
            )
        for i, (w, b) in enumerate(self._layers):
            x = x @ w + b
            if i < len(self._layers) - 1:
                x = np.maximum(x, 0.0)
        return {"logits": x}


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
                "OpenVINO is not installed: pip install 'rtfleet[openvino]'"
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
