"""Kernels for the model's hot ops. `kernels.ref` is the specification; the names exported here are the one
dispatch point the models call. Until the Triton kernels land they are the reference ops on every device."""

from .ref import apply_rope, attention, rms_norm, silu_mul

__all__ = ["apply_rope", "attention", "rms_norm", "silu_mul"]
