"""Jagged (variable-length) self-attention for user-history sequence towers.

``jagged_attention(q, k, v, offsets, causal=False, impl="auto")`` is the entry point;
see ``dispatch``. Implementations, one per module:

- ``reference``: pad to the longest sequence, masked SDPA (baseline, tests).
- ``cpu``: length-bucketed SDPA, pads only within buckets of similar length.
- ``triton_kernel``: flash-style Triton forward/backward kernels (imported lazily).
"""

from trainer.attention.dispatch import IMPLS, jagged_attention, validate_inputs

__all__ = ["IMPLS", "jagged_attention", "validate_inputs"]
