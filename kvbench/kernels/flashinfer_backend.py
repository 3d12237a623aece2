"""FlashInfer attention backend (CUDA only; imported only when chosen).

Context items run through `BatchPrefillWithPagedKVCacheWrapper` (causal), decode items through
`BatchDecodeWithPagedKVCacheWrapper`, both with `window_left = W - 1` for a sliding-window
pool; new K/V go in with `append_paged_kv_cache`. A plan is made once per batch per step and
reused for every layer of the pool: page indices are planned for the pool's first layer
(`slot * L`) and layer `l` runs on the cache tensor viewed from page `l` on, which shifts every
index by `l`. A batch with scratch pages (the same page in every layer) cannot shift that way,
so it is planned per layer.
"""

from __future__ import annotations

import torch

from .attention import PagedBatch
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
        ws = [torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device) for _ in range(2)]
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            ws[0], "NHD", backend=kernel_backend)
        # Tensor-core decode runs the prefill kernels' JIT module (one compile fewer) and is
        # FlashInfer's advice for grouped queries.
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            ws[1], "NHD", use_tensor_cores=True, backend=kernel_backend)
        self._planned: tuple[int, int] | None = None
        self._tables: dict[int, tuple[torch.Tensor, ...]] = {}

    def plan(self, batch: PagedBatch) -> None:
        self._tables = {}
        self._planned = None
        if not batch.has_scratch:
            self._plan(batch, 0)

    def write(self, kv: torch.Tensor, batch: PagedBatch, layer: int, k: torch.Tensor,
              v: torch.Tensor) -> None:
        cache, (indptr, indices, last, batch_idx, positions) = self._layer(kv, batch, layer)
        self._fi.append_paged_kv_cache(
            k.to(self.kv_dtype), v.to(self.kv_dtype), batch_idx, positions, cache, indices,
            indptr, last, kv_layout="NHD")

    def run(self, kv: torch.Tensor, batch: PagedBatch, layer: int, q: torch.Tensor
            ) -> torch.Tensor:
        cache, _ = self._layer(kv, batch, layer)
        wrapper = self._decode if batch.decode else self._prefill
        return wrapper.run(q.to(self.q_dtype), cache)

    def _layer(self, kv: torch.Tensor, batch: PagedBatch, layer: int):
        if batch.has_scratch:
            if self._planned != (id(batch), layer):
                self._plan(batch, layer)
            return kv, self._tables[layer]
        return kv[layer:], self._tables[0]

    def _plan(self, batch: PagedBatch, layer: int) -> None:
        s = self.shape

        def i32(a) -> torch.Tensor:
            return torch.as_tensor(a, dtype=torch.int32).to(batch.device, non_blocking=True)

        indptr = i32(batch.kv_indptr)
        indices = batch.layer_pages(layer).to(torch.int32)
        last = i32(batch.last_page_len)
        window_left = batch.window - 1 if batch.window is not None else -1
        if batch.decode:
            self._decode.plan(
                indptr, indices, last, s.num_q_heads, s.num_kv_heads, s.head_dim, batch.tpb,
                pos_encoding_mode="NONE", window_left=window_left, q_data_type=self.q_dtype,
                kv_data_type=self.kv_dtype)
        else:
            self._prefill.plan(
                i32(batch.qo_indptr), indptr, indices, last, s.num_q_heads, s.num_kv_heads,
                s.head_dim, batch.tpb, causal=True, window_left=window_left,
                q_data_type=self.q_dtype, kv_data_type=self.kv_dtype)
        self._tables[layer] = (indptr, indices, last, i32(batch.tok_batch), i32(batch.tok_rel))
        self._planned = (id(batch), layer)
