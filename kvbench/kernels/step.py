"""The data plane's value types: what a step is made of and what checking it found.

Nothing here imports torch, so engine code can build step items (and a `backend: none` run can
import this module) without paying for torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

DTYPES = ("float32", "float16", "bfloat16", "fp8")
"""KV storage types (`model.dtype`)."""


class BackendUnavailable(Exception):
    """The requested attention backend cannot run here (no CUDA, package missing, dtype)."""


def sequence_tokens(request, end: int) -> np.ndarray:
    """Token ids of positions `[0, end)` of a request's sequence: its prompt, then the tokens
    it generates (`request.output_tokens` when the traffic knows them; otherwise ids below
    zero, unique per request and position, which no prompt holds)."""
    prompt = request.prompt_tokens(0, min(end, request.input_length))
    n = end - request.input_length
    if n <= 0:
        return prompt
    known = request.output_tokens
    if known is not None and len(known) >= n:
        generated = np.asarray(known[:n], dtype=np.int64)
    else:
        generated = -1 - (request.id << 24) - np.arange(n, dtype=np.int64)
    return np.concatenate([np.asarray(prompt, dtype=np.int64), generated])


def beam_tokens(request, beam: int, context: int, end: int) -> np.ndarray:
    """Token ids of positions `[0, end)` of beam `beam` of a beam-search sequence whose beams
    share their first `context` tokens: beam 0's are `sequence_tokens`; another beam's differ
    past the shared context (ids below zero, unique per request, beam and position)."""
    if beam == 0 or end <= context:
        return sequence_tokens(request, end)
    offsets = np.arange(context, end, dtype=np.int64) - request.input_length
    own = -1 - (request.id << 24) - offsets - (beam << 56)
    return np.concatenate([sequence_tokens(request, context), own])


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The attention shape the KV tensors and the synthetic model are built for."""

    num_layers: int
    num_kv_heads: int
    num_q_heads: int
    head_dim: int
    tokens_per_block: int
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        if min(self.num_layers, self.num_kv_heads, self.num_q_heads, self.head_dim,
               self.tokens_per_block) <= 0:
            raise ValueError("every ModelShape dimension must be positive")
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError("num_q_heads must be a multiple of num_kv_heads")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES} (got {self.dtype!r})")

    @classmethod
    def of(cls, model, tokens_per_block: int) -> ModelShape:
        """From anything shaped like the workload's `model:` section (duck-typed, so this
        module needs no pydantic)."""
        return cls(model.num_layers, model.num_kv_heads, model.num_q_heads, model.head_dim,
                   tokens_per_block, model.dtype)


@dataclass(frozen=True, slots=True)
class PoolSpec:
    """One block pool (one life cycle): the layers it serves and its tiers' sizes.

    Its GPU tensor holds `(num_gpu_slots + num_scratch_slots) * len(layers)` pages; block `b`
    of the pool's `i`-th layer is page `b * len(layers) + i`. Scratch slots follow the pool's
    own slots, so scratch slot `k` holds pages from `(num_gpu_slots + k) * len(layers)`. Host
    blocks carry ids `host_first + j` (one id space for both tiers, as in `cache/`) and live in
    row `j` of the host tensor.
    """

    layers: tuple[int, ...]
    num_gpu_slots: int
    window: int | None = None
    """Sliding window W (a query attends to the W most recent tokens, itself included)."""
    num_host_slots: int = 0
    host_first: int | None = None
    """Id of host block 0; None means right after the GPU ids (`num_gpu_slots`)."""
    num_scratch_slots: int = 0

    def __post_init__(self) -> None:
        if not self.layers or self.num_gpu_slots <= 0:
            raise ValueError("a pool needs layers and GPU slots")
        if self.window is not None and self.window <= 0:
            raise ValueError("window must be positive")

    @property
    def first_host_id(self) -> int:
        return self.num_gpu_slots if self.host_first is None else self.host_first


@dataclass(frozen=True, slots=True, eq=False)
class CrossKV:
    """A request's encoder KV in the data plane's cross pool (encoder-decoder models): every
    query of the request's step items attends to all of it, non-causally, at each layer."""

    tokens: np.ndarray
    """The encoder input's token ids (its length is the number of keys)."""
    blocks: Sequence[int]
    """Cross page table: GPU block ids of the cross pool, covering every encoder position."""

    def __post_init__(self) -> None:
        if len(self.tokens) == 0:
            raise ValueError("an encoder input has at least one token")


@dataclass(frozen=True, slots=True, eq=False)
class StepItem:
    """One sequence's work in one step, for one pool: compute positions `[start, end)`.

    `blocks` is the sequence's page table from block `first_block` on (GPU block ids of the
    pool): blocks before `first_block` are out of window and may be gone. It must cover every
    position a query of this step attends to and every position it computes. `scratch` maps
    a block index (counted from the sequence's start) to an explicit page of the pool's GPU
    tensor used in every layer (a scratch slot's slice). `tokens` holds the token ids of at
    least positions `[0, end)`; the arrays are only read during the call. `cross`: the
    request's encoder KV, which the item's queries also attend to (cross-attention).
    """

    request_id: int
    tokens: np.ndarray
    blocks: Sequence[int]
    start: int
    end: int
    pool: int = 0
    first_block: int = 0
    scratch: Mapping[int, int] | None = None
    cross: CrossKV | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.end:
            raise ValueError(f"request {self.request_id}: empty or negative token range "
                             f"[{self.start}, {self.end})")
        if len(self.tokens) < self.end:
            raise ValueError(f"request {self.request_id}: tokens cover {len(self.tokens)} "
                             f"positions, the step needs {self.end}")


@dataclass(frozen=True, slots=True)
class Mismatch:
    """The first place where the paged computation disagreed with dense recomputation."""

    step: int
    request_id: int
    layer: int
    kind: str
    """`kv`: a page holds K/V other than the token's (wrong page, missed copy, overwritten
    block); `attention`: K/V were right but the kernel's output was not; `cross kv` and
    `cross attention`: the same for a cross page (position and block index are then the
    encoder's, except an attention mismatch's position: the decoder query's)."""
    position: int
    """Token position (kv: the key's; attention: the worst query's)."""
    block_index: int
    """Index of the block holding `position` in the sequence."""
    block_id: int | None
    """GPU block id the page table gave for it (None for a scratch page)."""
    page: int
    tier: str
    """Where the block lives (`GPU` or `scratch`) and, when known, the copy that last filled
    it, e.g. `GPU (onboarded from HOST block 12 at step 3)`."""
    error: float
    tolerance: float

    def __str__(self) -> str:
        where = "scratch" if self.block_id is None else f"block {self.block_id}"
        return (f"step {self.step}, request {self.request_id}, layer {self.layer}: {self.kind} "
                f"mismatch at position {self.position} (block #{self.block_index}, {where}, "
                f"page {self.page}, tier {self.tier}): error {self.error:.3g} > tolerance "
                f"{self.tolerance:.3g}")


@dataclass(frozen=True, slots=True)
class StepCheck:
    """What one `DataPlane.execute_step` did and found."""

    step: int
    verified: bool | None
    """True: every output and every page read matched; False: see `mismatch`; None: this
    step was not checked (`verify: off`, or not sampled)."""
    max_abs_err: float | None
    mismatch: Mismatch | None
    copied_blocks: int
    copy_bytes: int
    attention_ms: float | None
    """Kernel time of the attention calls; measured with CUDA events, None on CPU."""
    write_ms: float | None
    copy_ms: float | None
    linear_ms: float | None = None
    """The engine's linear layers (with a measured clock; 0 without)."""
    step_ms: float | None = None
    """The whole step's GPU time: copies overlapping the linear layers, then K/V writes and
    attention (what a measured clock takes as the step's duration)."""
