"""Launch configurations of the fused GEMM, chosen by shape class.

A default per M bucket: small M (decode) is bound by reading the weight, so its tiles are
short in M and wide in K; large M is compute-bound and takes 128x128 tiles. Tiles shrink
to the problem for small N and K so that ragged shapes do not waste whole tiles.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import triton


@dataclass(frozen=True)
class Config:
    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3


# (largest M of the bucket, config); the last bucket takes every larger M.
_DEFAULTS = (
    (16, Config(16, 64, 128, num_warps=4, num_stages=4)),
    (64, Config(64, 64, 128, num_warps=4, num_stages=4)),
    (256, Config(64, 128, 128, num_warps=4, num_stages=3)),
    (None, Config(128, 128, 128, num_warps=8, num_stages=3)),
)


def select_config(M: int, N: int, K: int) -> Config:
    """The launch configuration for one (M, N, K) problem."""
    bucket = next(i for i, (max_m, _) in enumerate(_DEFAULTS) if max_m is None or M <= max_m)
    return _config(bucket, N, K)


@functools.lru_cache(maxsize=1024)  # on the launch path: 6 us uncached, 0.3 us cached
def _config(bucket: int, N: int, K: int) -> Config:
    cfg = _DEFAULTS[bucket][1]
    # tl.dot needs every block dim >= 16 (>= 32 along K for 8-bit inputs).
    block_n = min(cfg.block_n, max(16, triton.next_power_of_2(N)))
    block_k = min(cfg.block_k, max(32, triton.next_power_of_2(K)))
    if (block_n, block_k) == (cfg.block_n, cfg.block_k):
        return cfg
    return Config(cfg.block_m, block_n, block_k, cfg.group_m, cfg.num_warps, cfg.num_stages)
