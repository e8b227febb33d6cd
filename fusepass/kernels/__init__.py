"""Triton kernels behind the fusepass ops, their launch wrappers and configurations."""

from .scaled_mm import launch_scaled_mm, scaled_mm_kernel

__all__ = ["launch_scaled_mm", "scaled_mm_kernel"]
