"""Triton kernels behind the fusepass ops, their launcher and configurations."""

from .launch import launch_scaled_mm
from .scaled_mm import scaled_mm_kernel

__all__ = ["launch_scaled_mm", "scaled_mm_kernel"]
