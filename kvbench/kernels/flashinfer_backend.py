"""FlashInfer attention backend (CUDA only; imported only when chosen).

Context items run through `BatchPrefillWithPagedKVCacheWrapper` (causal), decode items through
`BatchDecodeWithPagedKVCacheWrapper`, both with `window_left = W - 1` for a sliding-window
pool. Cross-attention batches (`attention.CrossBatch`: decoder queries over the encoder's
pages) run through the same two wrappers on the cross pool's tensor, prefill with
`causal=False` (decode attends to its whole page table anyway), in wrappers of their own.
A batch is planned once per step for every layer of its pool at once: each (item, layer) is one entry of the plan with that layer's page
indices (`slot * L + l`, or the scratch page), so one kernel launch runs the whole step's
attention of that kind. New K/V go in with one scatter over all layers (`attention.write_kv`).
"""

from __future__ import annotations

import numpy as np
import torch

from .attention import PagedBatch
from .staging import ring
from .step import BackendUnavailable, ModelShape
from .storage import QUERY_DTYPES, STORAGE_DTYPES

WORKSPACE_BYTES = 128 * 1024 * 1024
SUPPORTED_DTYPES = ("float16", "bfloat16", "fp8")


def flashinfer_problem(dtype: str) -> str | None:
    """Why the FlashInfer backend cannot run here, or None when it can."""
    if not torch.cuda.is_available():
        return "flashinfer needs a CUDA GPU and torch sees none (use torch or auto)"
    if dtype not in SUPPORTED_DTYPES:
        return f"flashinfer has no {dtype} KV cache kernels (use float16, bfloat16 or fp8)"
    try:
        import flashinfer  # noqa: F401
    except ImportError as exc:
        return f"the flashinfer package cannot be imported ({exc}); pip install flashinfer-python"
    return None


class FlashInferBackend:
    """Plans and runs FlashInfer's paged prefill/decode wrappers for one model shape.

    `kernel_backend` is passed to both wrappers: `fa2` by default, because the first use of
    every kernel configuration is JIT-compiled and FA3's templates take minutes to build.
    """

    name = "flashinfer"

    def __init__(self, shape: ModelShape, device: torch.device, kernel_backend: str = "fa2"
                 ) -> None:
        problem = flashinfer_problem(shape.dtype)
        if problem is not None:
            raise BackendUnavailable(problem)
        import flashinfer

        self._fi = flashinfer
        self.shape = shape
        self.q_dtype = QUERY_DTYPES[shape.dtype]
        self.kv_dtype = STORAGE_DTYPES[shape.dtype]
        self.device = device
        self.kernel_backend = kernel_backend
        # One wrapper per batch of a step (plans must live until their batch runs): a step
        # has one context and one decode batch per pool, and as many cross batches; two sets
        # for alternate steps.
        self._wrappers: dict[tuple[int, bool, int, bool], object] = {}

    def warm_up(self, windows, cross: bool = False) -> None:
        """Build (JIT) and load the kernels a run needs, before anything is timed: the causal
        prefill and the tensor-core decode kernels, with and without a sliding window as the
        pools have them, and the non-causal prefill with a `cross` pool, on a one-page
        cache."""
        s = self.shape
        kv = torch.zeros((1, 2, s.tokens_per_block, s.num_kv_heads, s.head_dim),
                         dtype=self.kv_dtype, device=self.device)
        q = torch.zeros((1, s.num_q_heads, s.head_dim), dtype=self.q_dtype, device=self.device)
        one = torch.tensor([0, 1], dtype=torch.int32)
        kinds = [(w, d, True) for w in sorted(set(windows), key=lambda w: -1 if w is None else w)
                 for d in (False, True)]
        if cross:
            kinds.append((None, False, False))
        for window, decode, causal in kinds:
            window_left = window - 1 if window is not None else -1
            w = self._wrapper(0, decode, 0, causal)
            self._plan_tables(w, decode, one, one, torch.zeros(1, dtype=torch.int32,
                              device=self.device), torch.tensor([1], dtype=torch.int32),
                              s.tokens_per_block, window_left, causal)
            w.run(q, kv)
        torch.cuda.synchronize(self.device)

    def _wrapper(self, pool: int, decode: bool, buffer: int = 0, causal: bool = True):
        key = (pool, decode, buffer, causal)
        w = self._wrappers.get(key)
        if w is None:
            ws = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
            fi = self._fi
            if decode:
                # Tensor-core decode runs the prefill kernels' JIT module (one compile fewer)
                # and is FlashInfer's advice for grouped queries.
                w = fi.BatchDecodeWithPagedKVCacheWrapper(
                    ws, "NHD", use_tensor_cores=True, backend=self.kernel_backend)
            else:
                w = fi.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD",
                                                           backend=self.kernel_backend)
            self._wrappers[key] = w
        return w

    def _plan_tables(self, w, decode: bool, qo, kv_indptr, indices, last, tpb: int,
                     window_left: int, causal: bool = True, seq_lens=None,
                     max_q: int | None = None, max_kv: int | None = None) -> None:
        s = self.shape
        if decode:
            w.plan(kv_indptr, indices, last, s.num_q_heads, s.num_kv_heads, s.head_dim, tpb,
                   pos_encoding_mode="NONE", window_left=window_left,
                   q_data_type=self.q_dtype, kv_data_type=self.kv_dtype, non_blocking=True,
                   seq_lens=seq_lens)
        else:
            w.plan(qo, kv_indptr, indices, last, s.num_q_heads, s.num_kv_heads, s.head_dim,
                   tpb, causal=causal, window_left=window_left, q_data_type=self.q_dtype,
                   kv_data_type=self.kv_dtype, non_blocking=True, seq_lens=seq_lens,
                   max_token_per_sequence=max_q, max_sequence_kv=max_kv)

    def plan_tables(self, batch: PagedBatch) -> list[np.ndarray]:
        """The host tables `plan` hands FlashInfer (`PagedBatch.layer_tables`, int32), for the
        step's upload to stage with the batch's own: FlashInfer reads them on the host and
        copies them to the GPU, which from pageable memory would make the host wait."""
        return list(batch.layer_tables())

    def plan(self, pool: int, batch: PagedBatch, buffer: int = 0,
             tables: list[torch.Tensor] | None = None):
        """One plan for every layer of the batch: entry `l * n + i` is item `i` at layer `l`
        (`PagedBatch.layer_tables`), page indices are the layer's own (scratch pages the
        same in every layer). `buffer` picks one of the wrapper sets that consecutive steps
        alternate between; `pool` is the decoder pool's, for a cross batch too. `tables`:
        `plan_tables(batch)` already staged in pinned memory (the step's upload); without
        them, they are staged here. Returns the planned wrapper, for `run`."""
        slot = None
        if tables is None:
            staging = ring(self.device)
            slot, flat, layout = staging.stage(self.plan_tables(batch))
            tables = layout.views(flat)
        ptr, lens = tables
        # Passing the sequence lengths and maxima spares FlashInfer recomputing them.
        indices = batch.pages_dev.view(-1)
        if indices.dtype != torch.int32:  # a CrossBatch's pages are int64
            indices = indices.int()
        window_left = batch.window - 1 if batch.window is not None else -1
        w = self._wrapper(pool, batch.decode, buffer, batch.causal)
        # Only the prefill plan takes the maxima (decode: one query each, lengths known).
        max_q = max_kv = None
        if not batch.decode:
            max_q, max_kv = int(np.diff(batch.qo_indptr).max()), int(batch.kv_len.max())
        self._plan_tables(w, batch.decode, ptr[0], ptr[1], indices, lens[0], batch.tpb,
                          window_left, batch.causal, lens[1], max_q, max_kv)
        if slot is not None:
            staging.release(slot)
        return w

    def run(self, kv: torch.Tensor, batch: PagedBatch, q: torch.Tensor, plan) -> torch.Tensor:
        """Attention of every layer: q `[L, queries, q_heads, d]` (query type) -> same shape."""
        L, n = q.shape[:2]
        return plan.run(q.reshape(L * n, *q.shape[2:]), kv).view(q.shape)
