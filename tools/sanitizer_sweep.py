"""A sweep of ragged shapes over every tile path and epilogue variant, for compute-sanitizer.

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --error-exitcode 1 \\
        python -m tools.sanitizer_sweep [ops | paths | group]    # every part by default

Without the caching allocator every tensor is its own allocation, so a read or write one
element past an edge is reported. Each case is also checked against the float64 oracle.
"""

import itertools
import sys

import torch

import fusepass
from fusepass.kernels import launch_scaled_mm
from fusepass.kernels.configs import Config, gemv_config
from fusepass.kernels.direct import release_scratch
from fusepass.kernels.group_launch import launch_scaled_mm_group
from tests.support.helpers import assert_matches_oracle, make_problem, quantized_row_bound, quantizing_launch_and_reference

# M: every bucket and its edges (1100: the persistent kernel's buckets); N and K: below one
# block, ragged, multiples of the blocks.
MS = [1, 7, 16, 17, 64, 65, 256, 257, 300, 1100]
NK = [(17, 33), (100, 17), (129, 128), (1000, 1001), (64, 256)]
VARIANTS = [
    dict(dtype=torch.int8, sa_shape=(), sb_shape=()),
    dict(dtype=torch.int8, bias_dtype=torch.bfloat16),
    dict(dtype=torch.float8_e4m3fn, bias_dtype=torch.float32),
    dict(dtype=torch.float8_e4m3fn, sa_shape=(1,), sb_shape=(1, 1)),
    dict(azp="tensor", bias_dtype=torch.float32),
    dict(azp="token", azp_dtype=torch.float32),
]
# Main-loop paths the tuned table may pick, forced on every shape (the ops above take the
# table's choice): TMA loads, split-K (its slices, tickets and last-program sum), both, wide
# tiles, and the persistent kernel's TMA stores (persistent.py).
PATHS = [
    Config(16, 64, 128, tma=True),
    Config(16, 32, 128, split_k=4),
    Config(64, 128, 128, split_k=2, tma=True),
    Config(128, 256, 64, num_warps=8, num_stages=4, tma=True),
    Config(128, 128, 128, num_warps=4, num_stages=4, tma=True, persistent=True),
    Config(256, 128, 128, num_warps=8, num_stages=4, tma=True, persistent=True),
]


def ops_cases() -> int:
    """Every shape and variant through the ops (the tuned configs); returns the case count."""
    n = 0
    for (M, (N, K)), variant in itertools.product(itertools.product(MS, NK), VARIANTS):
        p = make_problem(M, N, K, device="cuda", seed=n, **variant)
        out_dtype = (torch.bfloat16, torch.float16, torch.float32)[n % 3]
        if p.azp_adj is None:
            out = fusepass.scaled_mm(p.a, p.b, p.scale_a, p.scale_b, out_dtype, p.bias)
        else:
            out = fusepass.scaled_mm_azp(p.a, p.b, p.scale_a, p.scale_b, out_dtype, p.azp_adj, p.azp, p.bias)
        torch.cuda.synchronize()
        assert_matches_oracle(out, p, out_dtype)
        n += 1
    return n


# The M = 1 kernel's too: K over several blocks, ragged (int8 rows of whole blocks, (129, 128) and (64, 256),
# take dp4a where compiled).
GEMV_NK = NK + [(100, 5000)]


def path_cases() -> int:
    """Each of PATHS forced on every shape, the variants in turn, the M = 1 kernel
    (``gemv.py``) on every GEMV_NK in each variant, and the grouped kernel on its rows;
    returns the case count."""
    n = 0
    # (on one SM's count: 4 rows a program at N = 17, 8 at the other widths)
    gemv = [(1, nk, gemv_config(*nk, 1, variant.get("dtype", torch.int8)), variant)
            for nk, variant in itertools.product(GEMV_NK, VARIANTS)]
    paths = [(M, nk, cfg, VARIANTS[i % len(VARIANTS)])
             for i, ((M, nk), cfg) in enumerate(itertools.product(itertools.product(MS, NK), PATHS))]
    for M, (N, K), cfg, variant in paths + gemv:
        p = make_problem(M, N, K, device="cuda", seed=n, **variant)
        out = launch_scaled_mm(p.a, p.b, p.scale_a, p.scale_b, torch.float32, p.bias, p.azp_adj, p.azp, config=cfg)
        torch.cuda.synchronize()
        assert_matches_oracle(out, p, torch.float32)
        n += 1
    for (N, K), variant in itertools.product(GEMV_NK, VARIANTS[:4]):  # (no zero points in groups)
        members = [make_problem(1, w, K, device="cuda", seed=n + i, **variant) for i, w in enumerate((N, 17, 24))]
        a, scale_a = members[0].a, members[0].scale_a
        outs = launch_scaled_mm_group(a, [p.b for p in members], scale_a, [p.scale_b for p in members],
                                      torch.float32, [p.bias for p in members], config=gemv_config(N + 41, K, 1, members[0].b.dtype))
        torch.cuda.synchronize()
        for out, p in zip(outs, members):
            p.a, p.scale_a = a, scale_a
            assert_matches_oracle(out, p, torch.float32)
        n += 1
    for N, K in GEMV_NK:  # the row quantized to int8 in the kernel, then gated: silu(gate) * x
        p = make_problem(1, N, K, device="cuda", seed=n, bias_dtype=torch.bfloat16)
        x = torch.randn((1, K), device="cuda", generator=torch.Generator("cuda").manual_seed(n)).to(torch.bfloat16)
        for gate in (None, torch.randn_like(x)):
            out, ref, row, s = quantizing_launch_and_reference(x, p.b, p.scale_b, p.bias, gate)
            torch.cuda.synchronize()
            # gated: Triton's exp is not CUDA's, so a few values may round to a neighbour (a step
            # of their weight each, as test_scaled_mm_dynamic's kernel test allows)
            few = 0 if gate is None else \
                s.flatten() * p.scale_b.float().abs().flatten() * p.b.abs().float().max(0).values * max(2, K // 100)
            assert ((out - ref).abs().flatten() <= quantized_row_bound(row, s, p.b, p.scale_b, ref, p.bias) + few).all(), \
                (N, K, gate is not None)
            n += 1
    return n


# The grouped kernel's tiles at the M it groups (group_max_m: 64), unsplit and split (each
# member's slab of the partial buffer, its tiles' tickets; 4 splits of K = 33's one block: empty
# trailing slices).
GROUP_MS = [1, 7, 16, 17, 64]
GROUP_PATHS = [Config(16, 64, 128), Config(16, 32, 128, split_k=4), Config(64, 64, 64, split_k=3)]


def group_cases() -> int:
    """The grouped kernel's tiles (four members, the last three ragged) on every GROUP_MS x NK
    x GROUP_PATHS, the variants without zero points in turn; returns the case count."""
    n = 0
    for M, (N, K), cfg in itertools.product(GROUP_MS, NK, GROUP_PATHS):
        release_scratch()  # (eager splits share a partial buffer that only grows: one of this size)
        variant = VARIANTS[n % 4]
        members = [make_problem(M, w, K, device="cuda", seed=n + i, **variant) for i, w in enumerate((N, 17, 24, 9))]
        a, scale_a = members[0].a, members[0].scale_a
        outs = launch_scaled_mm_group(a, [p.b for p in members], scale_a, [p.scale_b for p in members],
                                      torch.float32, [p.bias for p in members], config=cfg)
        torch.cuda.synchronize()
        for out, p in zip(outs, members):
            p.a, p.scale_a = a, scale_a
            assert_matches_oracle(out, p, torch.float32)
        n += 1
    return n


def main() -> int:
    parts = list(dict.fromkeys(sys.argv[1:])) or ["ops", "paths", "group"]
    unknown = set(parts) - {"ops", "paths", "group"}
    if unknown:
        print(f"unknown part(s) {sorted(unknown)}: choose from ops, paths, group", file=sys.stderr)
        return 2
    n = ((ops_cases() if "ops" in parts else 0) + (path_cases() if "paths" in parts else 0)
         + (group_cases() if "group" in parts else 0))
    what = {"ops": f"{len(MS)} M x {len(NK)} (N, K) x {len(VARIANTS)} variants through the ops",
            "paths": f"{len(PATHS)} forced kernel paths on {len(MS)} M x {len(NK)} (N, K), and the M = 1 kernel on each of "
                     f"{len(GEMV_NK)} (N, K) x variant, alone, grouped without zero points, and quantizing its "
                     f"own row, plain and gated (int8: the quantization then the kernel, to a step where the "
                     f"roundings differ)",
            "group": f"the grouped tiles on {len(GROUP_MS)} M x {len(NK)} (N, K) x {len(GROUP_PATHS)} configs, "
                     f"unsplit and split"}
    print(f"sanitizer sweep ({', '.join(parts)}): {n} cases ({'; '.join(what[p] for p in parts)}), all match")
    return 0


if __name__ == "__main__":
    sys.exit(main())
