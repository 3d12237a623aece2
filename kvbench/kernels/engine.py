"""The linear layers an engine runs in every step, at the model's shape (CUDA only).

A measured clock (`run.clock: measured`) times a step as the GPU work an engine does for it:
these GEMMs, plus the data plane's K/V writes, attention and host copies. Per layer: the fused
QKV projection `h -> q + 2 kv`, the output projection `q -> h`, the gated MLP's up projection
`h -> 2 f` and its down projection `f -> h`, on random bf16 weights (random because matrix
units run measurably faster on zeros). Steps of up to `max_graph_tokens` tokens replay CUDA
graphs captured for padded sizes, as engines capture decode batches (vLLM's cudagraph capture
sizes); larger steps run eagerly. Norms, rotary embedding, activation and sampling are left
out: small memory-bound kernels next to these.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

GRAPH_TOKENS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)
"""Token counts CUDA graphs are captured for (up to the largest batch a run can decode)."""
WEIGHT_SCALE = 0.02


@dataclass(frozen=True, slots=True)
class LinearShape:
    """Sizes of the linear layers: `q` and `kv` are heads x head_dim."""

    num_layers: int
    hidden: int
    q: int
    kv: int
    intermediate: int

    @property
    def weight_bytes(self) -> int:
        h, f = self.hidden, self.intermediate
        per_layer = h * (self.q + 2 * self.kv) + self.q * h + h * 2 * f + f * h
        return 2 * self.num_layers * per_layer

    def activation_bytes(self, tokens: int) -> int:
        """bf16 outputs of one layer's GEMMs for `tokens` tokens (freed layer by layer)."""
        h, f = self.hidden, self.intermediate
        return 2 * tokens * (2 * h + self.q + 2 * self.kv + 2 * f)


def graph_sizes(max_tokens: int) -> tuple[int, ...]:
    """The capture sizes a run whose decode batches reach `max_tokens` uses."""
    sizes = [t for t in GRAPH_TOKENS if t < max_tokens]
    return (*sizes, min(max_tokens, GRAPH_TOKENS[-1]))


class LinearWork:
    """Random bf16 weights of one model's linear layers on the GPU, and captured graphs."""

    __slots__ = ("shape", "device", "weights", "sizes", "graphs", "_x", "_pool")

    def __init__(self, shape: LinearShape, device: torch.device, max_graph_tokens: int,
                 seed: int = 0) -> None:
        self.shape = shape
        self.device = device
        gen = torch.Generator(device=device).manual_seed(seed)
        h, q, kv, f = shape.hidden, shape.q, shape.kv, shape.intermediate

        def w(rows: int, cols: int) -> torch.Tensor:
            t = torch.randn((rows, cols), generator=gen, device=device, dtype=torch.bfloat16)
            return t.mul_(WEIGHT_SCALE)

        self.weights = [(w(h, q + 2 * kv), w(q, h), w(h, 2 * f), w(f, h))
                        for _ in range(shape.num_layers)]
        self.sizes = graph_sizes(max_graph_tokens)
        self._x = torch.randn((self.sizes[-1], h), generator=gen, device=device,
                              dtype=torch.bfloat16)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._pool = torch.cuda.graph_pool_handle()
        for t in reversed(self.sizes):  # largest first, so smaller graphs reuse its pool
            x = self._x[:t]
            self._layers(x)  # warm-up outside capture (cuBLAS handles, workspaces)
            torch.cuda.synchronize(device)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self._pool):
                self._layers(x)
            self.graphs[t] = g
        torch.cuda.synchronize(device)

    def padded(self, tokens: int) -> int:
        """Tokens the GPU computes for a `tokens`-token step (a graph's size, or itself)."""
        if tokens > self.sizes[-1]:
            return tokens
        return self.sizes[bisect.bisect_left(self.sizes, tokens)]

    def prepare(self, tokens: int) -> None:
        """Make room for an eager step of `tokens` tokens (untimed: random inputs)."""
        if tokens > self._x.shape[0]:
            self._x = torch.randn((tokens, self.shape.hidden), device=self.device,
                                  dtype=torch.bfloat16)

    def run(self, tokens: int) -> None:
        """Enqueue the linear layers of a `tokens`-token step on the current stream."""
        if tokens <= 0:
            return
        if tokens <= self.sizes[-1]:
            self.graphs[self.padded(tokens)].replay()
        else:
            self.prepare(tokens)
            self._layers(self._x[:tokens])

    def _layers(self, x: torch.Tensor) -> None:
        q, f = self.shape.q, self.shape.intermediate
        for wqkv, wo, wgu, wd in self.weights:
            a = x @ wqkv
            a[:, :q] @ wo
            g = x @ wgu
            g[:, :f] @ wd
