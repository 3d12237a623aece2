"""Hardware profiles: what `kvbench calibrate` measured on one GPU for one model shape, as YAML.

A profile holds measured tables, not datasheet figures: the linear layers' time over token
counts (captured graphs up to `linear.graph_tokens`' largest, eager beyond), the K/V write
time over token counts, prefill attention over (chunk, cached tokens), decode attention over
(batch, context), the per-step floor, and HBM and pinned host<->GPU bandwidths; plus what was
measured on what (card, driver, library versions, date). `hardware.profile: FILE` makes the
modeled clock interpolate these tables (`engine/clock.py: ProfileClock`), on any machine.

Torch-free: loading a profile costs no CUDA import.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from .errors import InputError
from .infile import read_input

FORMAT = 1
SHAPE_KEYS = ("num_layers", "num_q_heads", "num_kv_heads", "head_dim", "hidden_size",
              "intermediate_size", "dtype", "tokens_per_block")
"""The model shape a profile was measured for; a workload must match it."""


@dataclass(frozen=True, slots=True)
class Table1D:
    """Milliseconds at increasing x; linear between points and past the last one."""

    x: tuple[float, ...]
    ms: tuple[float, ...]


@dataclass(frozen=True, slots=True)
class Table2D:
    """Milliseconds on a grid: `ms[i][j]` at (`x[i]`, `y[j]`)."""

    x: tuple[float, ...]
    y: tuple[float, ...]
    ms: tuple[tuple[float, ...], ...]


@dataclass(frozen=True, slots=True)
class HardwareProfile:
    """One calibration (see the module docstring)."""

    device: str
    shape: dict[str, Any]
    measured: dict[str, Any]
    """Card, driver, versions, date: provenance, not used by the clock."""
    hbm_bytes_per_s: float
    h2d_bytes_per_s: float
    d2h_bytes_per_s: float
    step_floor_ms: float
    graph_tokens: tuple[int, ...]
    linear: Table1D
    kv_write: Table1D
    prefill: Table2D
    """x: chunk tokens, y: cached tokens before the chunk."""
    decode: Table2D
    """x: sequences in the batch, y: context tokens of each."""

    def to_yaml(self) -> str:
        doc = {
            "kvbench_profile": FORMAT,
            "device": self.device,
            "measured": self.measured,
            "model": self.shape,
            "bandwidth": {"hbm_bytes_per_s": self.hbm_bytes_per_s,
                          "host_to_device_bytes_per_s": self.h2d_bytes_per_s,
                          "device_to_host_bytes_per_s": self.d2h_bytes_per_s},
            "step_floor_ms": self.step_floor_ms,
            "linear": {"graph_tokens": list(self.graph_tokens), "tokens": list(self.linear.x),
                       "ms": list(self.linear.ms)},
            "kv_write": {"tokens": list(self.kv_write.x), "ms": list(self.kv_write.ms)},
            "prefill_attention": {"chunk": list(self.prefill.x), "cached": list(self.prefill.y),
                                  "ms": [list(r) for r in self.prefill.ms]},
            "decode_attention": {"batch": list(self.decode.x), "context": list(self.decode.y),
                                 "ms": [list(r) for r in self.decode.ms]},
        }
        head = (f"# kvbench hardware profile: {self.device}, measured by `kvbench calibrate`.\n"
                "# Times in ms for all layers of the model below; see kvbench/profile.py.\n")
        return head + yaml.safe_dump(doc, sort_keys=False, width=100)

    @property
    def link_ms_per_byte(self) -> float:
        """Host-link milliseconds per byte at the mean of the measured pinned bandwidths: the
        one figure behind the profile clock's copy time and `host_link_ms_modeled`."""
        return 2e3 / (self.h2d_bytes_per_s + self.d2h_bytes_per_s)

    def check_shape(self, shape: dict[str, Any], where: str) -> None:
        """InputError unless `shape` (a workload's) is the shape this profile measured."""
        diff = [f"{k} {shape[k]} (profile: {self.shape.get(k)})" for k in SHAPE_KEYS
                if shape[k] != self.shape.get(k)]
        if diff:
            raise InputError(
                f"{where}: hardware.profile was measured for another model shape: "
                f"{', '.join(diff)}; run `kvbench calibrate WORKLOAD.yaml` for this one")


def model_shape(model, tokens_per_block: int) -> dict[str, Any]:
    """The profile's `model:` section for a workload's model (sizes resolved as the clock
    resolves them)."""
    from .engine.clock import INTERMEDIATE_RATIO

    h = model.hidden_size or model.num_q_heads * model.head_dim
    return {"num_layers": model.num_layers, "num_q_heads": model.num_q_heads,
            "num_kv_heads": model.num_kv_heads, "head_dim": model.head_dim, "hidden_size": h,
            "intermediate_size": model.intermediate_size or int(INTERMEDIATE_RATIO * h),
            "dtype": model.dtype, "tokens_per_block": tokens_per_block}


def load_profile(path: Path) -> HardwareProfile:
    """Read a profile; InputError naming the file and key for anything malformed."""
    raw = read_input(path, " the hardware profile")
    try:
        doc = yaml.safe_load(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise InputError(f"{path}: not UTF-8 text (byte {exc.start})") from None
    except RecursionError:
        raise InputError(f"{path}: nested too deeply to be a hardware profile") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f":{mark.line + 1}:{mark.column + 1}" if mark else ""
        raise InputError(f"{path}{at}: not valid YAML ({getattr(exc, 'problem', exc)})") from None
    r = _Reader(path, doc)
    if r.get("kvbench_profile", int) != FORMAT:
        raise InputError(f"{path}: kvbench_profile: expected {FORMAT}")
    shape = r.get("model", dict)
    for k in SHAPE_KEYS:
        r.get(f"model.{k}", str if k == "dtype" else int)
    graph_tokens = tuple(r.numbers("linear.graph_tokens", int))
    return HardwareProfile(
        device=r.get("device", str),
        shape=dict(shape),
        measured=dict(r.get("measured", dict)),
        hbm_bytes_per_s=r.positive("bandwidth.hbm_bytes_per_s"),
        h2d_bytes_per_s=r.positive("bandwidth.host_to_device_bytes_per_s"),
        d2h_bytes_per_s=r.positive("bandwidth.device_to_host_bytes_per_s"),
        step_floor_ms=r.number("step_floor_ms"),
        graph_tokens=graph_tokens,
        linear=r.table1d("linear", "tokens"),
        kv_write=r.table1d("kv_write", "tokens"),
        prefill=r.table2d("prefill_attention", "chunk", "cached"),
        decode=r.table2d("decode_attention", "batch", "context"),
    )


_KIND_NAMES = {int: "an integer", float: "a number", str: "a string", list: "a list",
               dict: "a mapping"}
"""What a profile key of each YAML type is called in an error."""


class _Reader:
    __slots__ = ("path", "doc")

    def __init__(self, path: Path, doc: Any) -> None:
        self.path = path
        self.doc = doc

    def fail(self, key: str, expected: str) -> InputError:
        return InputError(f"{self.path}: {key}: expected {expected}")

    def get(self, key: str, kind: type) -> Any:
        node = self.doc
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                raise self.fail(key, f"{_KIND_NAMES[kind]} (missing)")
            node = node[part]
        if kind in (int, float) and isinstance(node, bool) or not (
                isinstance(node, kind) or kind is float and isinstance(node, int)):
            raise self.fail(key, f"{_KIND_NAMES[kind]} (got {node!r:.40})")
        return node

    def number(self, key: str) -> float:
        value = float(self.get(key, float))
        if value < 0:
            raise self.fail(key, "a number >= 0")
        return value

    def positive(self, key: str) -> float:
        value = self.number(key)
        if value <= 0:
            raise self.fail(key, "a positive number")
        return value

    def numbers(self, key: str, kind: type = float) -> list:
        values = self.get(key, list)
        if not values or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                 and v >= 0 for v in values):
            raise self.fail(key, "a non-empty list of numbers >= 0")
        if kind is int and not all(isinstance(v, int) for v in values):
            raise self.fail(key, "a list of integers")
        return [kind(v) for v in values]

    def axis(self, key: str) -> tuple[float, ...]:
        values = self.numbers(key)
        if any(b <= a for a, b in zip(values, values[1:])):
            raise self.fail(key, "strictly increasing values")
        return tuple(values)

    def table1d(self, key: str, axis: str) -> Table1D:
        x = self.axis(f"{key}.{axis}")
        ms = self.numbers(f"{key}.ms")
        if len(ms) != len(x):
            raise self.fail(f"{key}.ms", f"{len(x)} values, one per {axis}")
        return Table1D(x, tuple(ms))

    def table2d(self, key: str, xa: str, ya: str) -> Table2D:
        x, y = self.axis(f"{key}.{xa}"), self.axis(f"{key}.{ya}")
        rows = self.get(f"{key}.ms", list)
        if len(rows) != len(x) or not all(isinstance(r, list) and len(r) == len(y)
                                          for r in rows):
            raise self.fail(f"{key}.ms", f"{len(x)} rows (one per {xa}) of {len(y)} values "
                                         f"(one per {ya})")
        flat = [v for r in rows for v in r]
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0
                   for v in flat):
            raise self.fail(f"{key}.ms", "numbers >= 0")
        return Table2D(x, y, tuple(tuple(float(v) for v in r) for r in rows))
