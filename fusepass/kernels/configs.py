"""Launch configurations of the fused GEMM: a tuned table per GPU architecture, and defaults.

``select_config`` looks up ``tuned/<arch>.json`` (written offline by
``benchmarks/tune.py``) by (dtype, M bucket, N, K); an unseen (N, K) takes the bucket's
tuned default (the config with the best geomean over the tuned shapes), and an
architecture without a table takes the built-in defaults below; either way a decode
bucket then splits K to fill the GPU (``derive_split``), and above the pointer-load buckets
a narrow weight takes smaller tiles where the default's leave SMs idle (``fill_large_m``, at
a static M). A tuned or derived decode split is
dropped for compiled code outside CUDA graphs (``decode_unsplit``). ``bucket_choices`` gives
every bucket's config for one (N, K), for a launch whose M is only known at run time.
Nothing is timed at run time, so the ops stay cheap to call and capture into CUDA graphs.
"""

from __future__ import annotations

import bisect
import functools
import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import triton
from torch.fx.experimental.symbolic_shapes import is_concrete_int

TABLE_DIR = Path(__file__).with_name("tuned")

# Upper bounds of the M buckets; the last bucket takes every larger M.
# M=1 has its own bucket: Triton specializes an argument equal to 1, so M=1 compiles to
# another kernel, and the M<=16 choice ran it 1.39x slower (fp8, N=10240, K=8192, H100).
M_BUCKETS = (1, 16, 64, 256, 1024, 4096, None)


@dataclass(frozen=True)
class Config:
    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 1  # programs along K; > 1: slices summed by each tile's last program
    tma: bool = False  # TMA loads (device-made descriptors) where the operand layout allows them
    # With tma and split_k 1: the persistent kernel (persistent.py: one program per SM, TMA
    # stores) where TMA can also write the output; else scaled_mm_kernel with these tiles.
    persistent: bool = False
    # M = 1 only: the CUDA-core kernel (gemv.py), block_n rows of b.T a program (gemv_config).
    gemv: bool = False

    def as_dict(self) -> dict:
        return asdict(self)


# Buckets up to this M load through pointers, never TMA. A TMA launch costs more host time
# (Triton allocates scratch memory for the device-made descriptors: +1.1 us a compiled
# call, +8 us an eager one, H200 host, benchmarks/bench_host.py --parts configs), which
# decode launches cannot hide, and on the H200 the pointer-load retune beat the H100
# table's TMA configs at every decode shape compared.
POINTER_LOADS_MAX_M = 64

# Decode buckets read each weight once, so a shape the table has not seen whose tiles leave
# SMs idle is split along K: the largest power of two up to MOST_SPLITS (and one K block a
# program) that keeps within DECODE_PROGRAMS_PER_SM programs per SM. The tuner's splits at
# decode give 1.0-4.8 programs per SM; on an H200, int8, at 16 points (M = 1 and 16, 8 (N, K)
# with N in 512..128256) the rule is within 1.23x of the best of
# 15 (block_n, split) configs, where the unsplit bucket default was up to 2.14x slower
# (k_proj at M = 1, N = 1024, K = 4096: 12.8 us unsplit, 7.6 us in 8 splits). Measured on
# int8; fp8 and zero-point launches read the same bytes and take the same rule.
DERIVED_SPLIT_MAX_M = 16
DECODE_PROGRAMS_PER_SM = 2
MOST_SPLITS = 8
DEFAULT_SMS = 132  # an H100/H200 where there is no CUDA device to ask (the interpreter)

# Above decode sizes, a shape the table has not seen takes the bucket's default tiles, tuned
# on wide weights; on a narrow one they can leave SMs idle (Llama-3-8B's unjoined k_proj,
# N = 1024, K = 4096, at M = 2048: 64 tiles of 256x128 on 132 SMs). At a static M where the
# default's tiles are fewer than the SMs and these take less time by rounds of the SMs
# (``fill_large_m``), these: the best of tune.py's search there, a third faster on that k_proj
# (docs/PERFORMANCE.md, "Why the code is as it is": "Large-M fill"). A symbolic M keeps its bucket's tiles.
LARGE_M_FILL = Config(128, 128, 128, num_warps=4, num_stages=4, tma=True)

# Without a table: small M (decode) is bound by reading the weight, so its tiles are short
# in M and wide in K; large M is compute-bound and takes 128x128 tiles.
BUILTIN = (
    Config(16, 64, 128, num_warps=4, num_stages=4),
    Config(16, 64, 128, num_warps=4, num_stages=4),
    Config(64, 64, 128, num_warps=4, num_stages=4),
    Config(64, 128, 128, num_warps=4, num_stages=3),
    Config(128, 128, 128, num_warps=8, num_stages=3),
    Config(128, 128, 128, num_warps=8, num_stages=3),
    Config(128, 128, 128, num_warps=8, num_stages=3),
)


def cdiv(a, b):
    """Ceiling division of ints or SymInts. ``triton.cdiv`` is a constexpr function in Triton
    3.9: 5.6 us a call on the host, 0.05 us this way (on the eager launch path)."""
    return (a + b - 1) // b


def m_bucket(M: int) -> int:
    """Index into M_BUCKETS of the bucket holding M."""
    return bisect.bisect_left(M_BUCKETS, M, hi=len(M_BUCKETS) - 1)


def bucket_name(bucket: int) -> str:
    top = M_BUCKETS[bucket]
    return f"M<={top}" if top is not None else f"M>{M_BUCKETS[bucket - 1]}"


def dtype_name(dtype: torch.dtype, azp: bool = False) -> str:
    """The table's name of an operand type; int8 with a zero point has entries of its own
    (its epilogue holds more registers), falling back to plain int8's."""
    return ("int8_azp" if azp else "int8") if dtype == torch.int8 else "fp8"


def table_key(dtype: str, bucket: int, N: int | None = None, K: int | None = None) -> str:
    """The table's key of one shape, or of a bucket's default when N and K are None."""
    key = f"{dtype},{bucket_name(bucket)}"
    return key if N is None else f"{key},{N},{K}"


@functools.cache
def load_table(arch: str) -> dict:
    """The tuned table of ``arch`` (e.g. "sm90"), or an empty one."""
    path = TABLE_DIR / f"{arch}.json"
    if not path.exists():
        return {"defaults": {}, "shapes": {}}
    return json.loads(path.read_text())


@functools.cache  # on every launch: ask the driver once per device
def device_arch(device: torch.device) -> str | None:
    """"sm90"-style name of a CUDA device; None elsewhere (Triton's CPU interpreter, or a
    fake CUDA graph traced on a machine without a GPU)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm{major}{minor}"


def device_properties(device: torch.device | None):
    """The properties of a CUDA device this process can see ("cuda" alone: the current one);
    None elsewhere (the interpreter, or fake CUDA tensors on a host without a GPU)."""
    if device is None or device.type != "cuda" or not torch.cuda.is_available():
        return None
    return _properties(torch.cuda.current_device() if device.index is None else device.index)


@functools.lru_cache(maxsize=None)  # on every launch: ask the driver once per device
def _properties(index: int):
    return torch.cuda.get_device_properties(index)


def sm_count(device: torch.device | None) -> int:
    """Streaming multiprocessors of a CUDA device; DEFAULT_SMS where ``device_properties`` has none."""
    props = device_properties(device)
    return DEFAULT_SMS if props is None else props.multi_processor_count


def select_config(M: int, N: int, K: int, dtype: torch.dtype = torch.int8, device=None, azp: bool = False,
                  split_decode: bool = True) -> Config:
    """The launch configuration for one (M, N, K) problem of ``dtype`` on ``device``;
    ``split_decode=False``: a decode launch runs unsplit (see ``decode_unsplit``)."""
    arch = device_arch(device) if device is not None else None
    # fill_large_m reads M only above the pointer-load buckets and through cdiv(M, block_m) of
    # tiles 64 rows or taller (smaller ones are never filled): M rounded up to 64 keeps every
    # decision and the cache small for eager calls of many M
    fill_m = cdiv(M, 64) * 64 if M > POINTER_LOADS_MAX_M else None
    return _config(m_bucket(M), N, K, dtype_name(dtype, azp), arch, sm_count(device), split_decode, fill_m)


def bucket_choices(N, K, dtype: torch.dtype, device, azp: bool = False, split_decode: bool = True) -> list:
    """``[(top, Config)]`` for every M bucket (``top`` its upper bound, None for the last),
    adjacent buckets with the same config merged. A symbolic N or K (a weight traced with
    dynamic shapes) takes the buckets' defaults, unshrunk. ``split_decode`` as in ``select_config``."""
    N, K = (int(v) if is_concrete_int(v) else None for v in (N, K))
    arch, sms = device_arch(device), sm_count(device)
    return merge_buckets((top, _config(bucket, N, K, dtype_name(dtype, azp), arch, sms, split_decode))
                         for bucket, top in enumerate(M_BUCKETS))


def decode_unsplit(cfg: Config, top: int | None, split_decode: bool) -> Config:
    """``cfg`` unsplit at a decode bucket (M <= ``top``) unless ``split_decode``: False for
    compiled code that runs outside CUDA graphs (``policy.decode_splits``)."""
    # A split launch needs its per-tile counters zeroed first: in compiled code one more
    # launch, a fill kernel of Inductor's. Outside CUDA graphs a decode step is host-bound,
    # and pays for that launch with host time, while the GPU time the split saves is time the
    # step does not wait for. 4 Llama-3-8B layers, int8, batch 1, default
    # torch.compile, H200: split, 132 kernels a step, 0.52 ms of
    # GPU work, 1.24-1.49x bf16's step time; unsplit, 104 kernels, 0.62 ms, 0.93-1.19x.
    if split_decode or top is None or top > DERIVED_SPLIT_MAX_M:
        return cfg
    return replace(cfg, split_k=1)


# M = 1 with a K-contiguous b (``w.t()``): gemv.py's kernel, unsplit (a split's sum cost more than
# it saved), 2048 bytes a row at a time, and 4 rows a program where 8 would give fewer than
# GEMV_PROGRAMS_PER_SM programs a SM: the fastest of the sweeps
# (docs/PERFORMANCE.md, "Why the code is as it is": "The M = 1 config").
# A narrower weight (an unjoined k_proj, N = 1024: 256 programs of 4 rows on 132 SMs) keeps the
# tiles, whose split fills the GPU (``gemv_fills``).
GEMV = Config(block_m=1, block_n=8, block_k=2048, num_warps=4, num_stages=3, gemv=True)
GEMV_PROGRAMS_PER_SM = 4
# int8 rows summed by dp4a (gemv.py's DP4A) read 512 bytes a block where a program takes 8 (and
# 512 divides K), the faster there; fp8 and 4-row programs keep 2048
# (docs/PERFORMANCE.md, "Why the code is as it is": "dp4a").
GEMV_INT8_WIDE_BLOCK_K = 512


@functools.cache  # on the eager launch path: 5 us uncached
def gemv_config(N: int, K: int, sms: int, dtype: torch.dtype) -> Config:
    """The M = 1 kernel's config for an (N, K) weight of ``dtype`` on a GPU of ``sms`` SMs:
    GEMV's rows a program, half as many where that leaves fewer than GEMV_PROGRAMS_PER_SM
    programs a SM; int8 at GEMV's rows reads GEMV_INT8_WIDE_BLOCK_K bytes a block where they
    divide K (dp4a takes whole blocks: 512 was measured with it); a short K reads one shorter
    block."""
    wide = cdiv(N, GEMV.block_n) >= GEMV_PROGRAMS_PER_SM * sms
    words = wide and dtype == torch.int8 and K % GEMV_INT8_WIDE_BLOCK_K == 0
    block_k = GEMV_INT8_WIDE_BLOCK_K if words else GEMV.block_k
    return replace(GEMV, block_n=GEMV.block_n if wide else GEMV.block_n // 2,
                   block_k=min(block_k, triton.next_power_of_2(K)))


@functools.cache  # on the eager launch path
def gemv_gated_config(N: int, K: int, sms: int) -> Config:
    """The M = 1 kernel's config where it also gates its row (``gemv.py``'s GATED): 16 rows a
    program of GEMV's bytes, 8 where 16 would leave fewer than a program a SM. Each program reads
    the row and its gate twice and computes the SiLU, so fewer programs do less of it: 16 rows
    was the fastest of 4 to 32 at 256 programs (docs/PERFORMANCE.md, "Why the code is as it
    is": "The gated M = 1 config")."""
    return replace(GEMV, block_n=16 if cdiv(N, 16) >= sms else 8, block_k=min(GEMV.block_k, triton.next_power_of_2(K)))


def gemv_fills(N: int, device) -> bool:
    """Whether the M = 1 kernel's programs (unsplit) fill ``device``: DECODE_PROGRAMS_PER_SM a SM
    at the narrower programs ``gemv_config`` takes where GEMV's leave too few (N = 2048, an
    o_proj of hidden 2048, runs it: docs/PERFORMANCE.md, "Why the code is as it is": "The M = 1
    config")."""
    return cdiv(N, GEMV.block_n // 2) >= DECODE_PROGRAMS_PER_SM * sm_count(device)


def merge_buckets(choices) -> list:
    """``[(top, Config)]`` with adjacent buckets of the same config merged into the upper one
    (``launch.by_m`` then has one ``cond`` branch per distinct config)."""
    merged = []
    for top, cfg in choices:
        if merged and merged[-1][1] == cfg:
            merged[-1] = (top, cfg)
        else:
            merged.append((top, cfg))
    return merged


@functools.lru_cache(maxsize=4096)  # on the eager launch path: 6 us uncached, 0.3 us cached
def _config(bucket: int, N: int | None, K: int | None, dtype: str, arch: str | None, sms: int = DEFAULT_SMS,
            split_decode: bool = True, M: int | None = None) -> Config:
    cfg, tuned = BUILTIN[bucket], False
    if arch is not None:
        table = load_table(arch)
        names = (dtype, "int8") if dtype == "int8_azp" else (dtype,)
        shapes = [table["shapes"].get(table_key(name, bucket, N, K)) for name in names] if N and K else []
        defaults = [table["defaults"].get(table_key(name, bucket)) for name in names]
        entry = next((e for e in shapes + defaults if e), None)
        tuned = any(shapes)
        if entry:
            cfg = Config(**entry["config"])
    if pointer_loads_only(bucket):
        cfg = replace(cfg, tma=False, persistent=False)
    if N is not None and K is not None:
        cfg = fit(cfg, N, K)
        cfg = cfg if tuned else fill_large_m(derive_split(cfg, bucket, N, K, sms), M, N, K, sms)
    return decode_unsplit(cfg, M_BUCKETS[bucket], split_decode)


def derive_split(cfg: Config, bucket: int, N: int, K: int, sms: int) -> Config:
    """``cfg`` split along K to fill ``sms`` SMs at a decode bucket (see DECODE_PROGRAMS_PER_SM)."""
    top = M_BUCKETS[bucket]
    if top is None or top > DERIVED_SPLIT_MAX_M:
        return cfg
    tiles = cdiv(top, cfg.block_m) * cdiv(N, cfg.block_n)
    most = min(MOST_SPLITS, cdiv(K, cfg.block_k))
    split = 1
    while split * 2 <= most and tiles * split * 2 <= DECODE_PROGRAMS_PER_SM * sms:
        split *= 2
    return replace(cfg, split_k=split)


def fill_large_m(cfg: Config, M: int | None, N: int, K: int, sms: int) -> Config:
    """``cfg``, or LARGE_M_FILL's smaller tiles (with ``cfg``'s TMA choice) where, at a static
    ``M`` above the pointer-load buckets, ``cfg``'s tiles leave SMs idle (fewer than ``sms``)
    and the smaller ones take less time by rounds of ``sms`` tiles, each round as long as its
    tile's elements."""
    if M is None or M <= POINTER_LOADS_MAX_M:
        return cfg
    fill = fit(replace(LARGE_M_FILL, tma=cfg.tma), N, K)

    def tiles(c: Config) -> int:
        return cdiv(M, c.block_m) * cdiv(N, c.block_n)

    def rounds(c: Config) -> int:  # (rounds of sms tiles x a tile's elements)
        return cdiv(tiles(c), sms) * c.block_m * c.block_n

    return fill if tiles(cfg) < sms and rounds(fill) < rounds(cfg) else cfg


def pointer_loads_only(bucket: int) -> bool:
    top = M_BUCKETS[bucket]
    return top is not None and top <= POINTER_LOADS_MAX_M


def fit(cfg: Config, N: int, K: int) -> Config:
    """``cfg`` with tiles shrunk to a small N or K (so ragged shapes waste no whole tile)."""
    # tl.dot needs every block dim >= 16 (>= 32 along K for 8-bit inputs).
    block_n = min(cfg.block_n, max(16, triton.next_power_of_2(N)))
    block_k = min(cfg.block_k, max(32, triton.next_power_of_2(K)))
    split_k = max(1, min(cfg.split_k, cdiv(K, block_k)))
    return replace(cfg, block_n=block_n, block_k=block_k, split_k=split_k)
