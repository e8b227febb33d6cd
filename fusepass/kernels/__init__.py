"""Triton kernels behind the fusepass ops, their launcher and configurations."""

from .blockwise import blockwise_mm_kernel
from .gemv import blockwise_gemv_kernel, scaled_gemv_kernel
from .group import scaled_mm_group_kernel
from .grouped import grouped_gemv_kernel, grouped_mm_kernel, route_count_kernel, route_kernel
from .launch import launch_scaled_mm
from .persistent import scaled_mm_persistent_kernel
from .quantize import quantize_rows_kernel
from .scaled_mm import scaled_mm_kernel

# Every Triton kernel the ops launch (what Inductor compiles where the pass lowers them).
KERNELS = (scaled_mm_kernel, scaled_mm_persistent_kernel, scaled_gemv_kernel, blockwise_mm_kernel,
           blockwise_gemv_kernel, scaled_mm_group_kernel, grouped_gemv_kernel, grouped_mm_kernel, route_count_kernel,
           route_kernel, quantize_rows_kernel)
# Those of them that are GEMMs (the others order a mixture of experts' rows for one, or quantize them)
GEMM_KERNELS = tuple(k for k in KERNELS if k not in (route_count_kernel, route_kernel, quantize_rows_kernel))

__all__ = ["GEMM_KERNELS", "KERNELS", "launch_scaled_mm", "scaled_mm_kernel"]
