"""The data plane: paged KV tensors, copy executor, synthetic model, attention backends
(torch reference, FlashInfer) and verifier.

`step` holds the torch-free values (`StepItem`, `PoolSpec`, `StepCheck`, ...); everything else
imports torch, so engine code imports `kvbench.kernels.dataplane` only once a backend is asked
for (a `backend: none` run never pays for torch).
"""
