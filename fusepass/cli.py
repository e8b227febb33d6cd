"""The ``fusepass`` command's commands (``check``, ``demo``), run on the arguments that
``fusepass_cli`` (the script's entry point) parsed without importing torch."""

from __future__ import annotations

import argparse
import importlib.util
import os

import torch

import fusepass_cli
from fusepass_cli import CPU_DEFAULTS, CUDA_DEFAULTS, SIZES, STEPS


def _implementation(device: torch.device) -> str:
    """Which implementation the ops run on ``device``, in a user's words."""
    if device.type == "cuda":
        return f"the fused Triton kernels on {torch.cuda.get_device_name(device)} (fp8 above 64 rows: cuBLAS)"
    return "the CPU reference (fusepass/ops/reference.py: exact sums, one rounding; the Triton kernels run on CUDA only)"


def _check_cases(M: int, N: int, K: int, seed: int, fp8: bool) -> list:
    """(name, run(to_device), float64 reference) for every op: int8 and, with ``fp8``, e4m3
    operands; each reference computed from the same quantized values (dynamic ops: quantized by
    the op's own recipe)."""
    import fusepass
    from fusepass.kernels.policy import GROUPED_BLOCK_M, grouped_block_m
    from fusepass.ops.blockwise import quantize_groups
    from fusepass.ops.dynamic import quantize_rows

    bf16, e4m3 = torch.bfloat16, torch.float8_e4m3fn
    g = torch.Generator().manual_seed(seed)
    w, w2 = torch.randn(N, K, generator=g), torch.randn(N, K, generator=g)  # float weights being quantized
    x, bias = torch.randn(M, K, generator=g), torch.randn(N, generator=g)
    xb = x.to(bf16)

    def rows(t, dtype):  # per-row symmetric: (q, scale [rows, 1])
        q, s = quantize_rows(t, dtype, 127.0 if dtype == torch.int8 else 448.0, 1e-12, floor_first=True)
        return q, s

    def ref(qa, sa, qb, sb, z=0):  # dequantize, then matmul, in float64
        return ((qa.double() - z) * sa.double()) @ (qb.double() * sb.double()).t() + bias.double()

    (a, sa), (b, sb), (b2, sb2) = rows(x, torch.int8), rows(w, torch.int8), rows(w2, torch.int8)
    experts = torch.arange(M) % 2
    lo, hi = x.amin(1, keepdim=True), x.amax(1, keepdim=True)
    s_az = (hi - lo) / 255
    azp = torch.round(-128 - lo / s_az).to(torch.int32)
    a_az = torch.clamp(torch.round(x / s_az) + azp, -128, 127).to(torch.int8)
    qd, sd = quantize_rows(xb, torch.int8, 127.5, torch.finfo(torch.float32).eps)  # scaled_mm_dynamic's recipe

    def routed(t, sorted_rows, block_experts):  # (scaled_grouped_mm's case below, its rows sorted first)
        return fusepass.scaled_grouped_mm(
            t(a), t(torch.stack([b.t(), b2.t()])), t(sa), t(torch.stack([sb.flatten(), sb2.flatten()])), t(experts),
            bf16, t(torch.stack([bias, bias])), sorted_rows=sorted_rows, block_experts=block_experts)
    cases = [
        ("scaled_mm int8", lambda t: fusepass.scaled_mm(t(a), t(b.t()), t(sa), t(sb.t()), bf16, t(bias)),
         ref(a, sa, b, sb)),
        ("scaled_mm_azp int8", lambda t: fusepass.scaled_mm_azp(
            t(a_az), t(b.t()), t(s_az), t(sb.t()), bf16, t(b.sum(1, dtype=torch.int32)), t(azp), t(bias)),
         ref(a_az, s_az, b, sb, azp)),
        ("int_mm", lambda t: fusepass.int_mm(t(a), t(b.t())), a.double() @ b.double().t()),
        ("scaled_mm_group int8", lambda t: torch.cat(fusepass.scaled_mm_group(
            t(a), [t(b.t()), t(b2.t())], t(sa), [t(sb.t()), t(sb2.t())], bf16, [t(bias), t(bias)]), 1),
         torch.cat([ref(a, sa, b, sb), ref(a, sa, b2, sb2)], 1)),
        ("scaled_mm_dynamic int8", lambda t: fusepass.scaled_mm_dynamic(t(xb), t(b.t()), t(sb.t()), bf16, t(bias)),
         ref(qd, sd, b, sb)),
        # two experts, rows alternating between them (a router's top-1)
        ("scaled_grouped_mm int8", lambda t: fusepass.scaled_grouped_mm(
            t(a), t(torch.stack([b.t(), b2.t()])), t(sa), t(torch.stack([sb.flatten(), sb2.flatten()])), t(experts),
            bf16, t(torch.stack([bias, bias]))),
         torch.where(experts[:, None] == 0, ref(a, sa, b, sb), ref(a, sa, b2, sb2))),
        # (the same with the rows sorted by expert first, as a layer's two matmuls share them)
        ("route_experts + scaled_grouped_mm int8", lambda t: routed(
            t, *fusepass.route_experts(t(experts), 2, grouped_block_m(M, 2) or GROUPED_BLOCK_M)),
         torch.where(experts[:, None] == 0, ref(a, sa, b, sb), ref(a, sa, b2, sb2))),
        # (the experts' weights as stored, [E, N, K], transposed: on a GPU the kernel quantizes the rows)
        ("scaled_grouped_mm_dynamic int8", lambda t: fusepass.scaled_grouped_mm_dynamic(
            t(xb), t(torch.stack([b, b2])).transpose(1, 2), t(torch.stack([sb.flatten(), sb2.flatten()])), t(experts), bf16,
            t(torch.stack([bias, bias]))),
         torch.where(experts[:, None] == 0, ref(qd, sd, b, sb), ref(qd, sd, b2, sb2))),
    ]
    if fp8:
        (af, saf), (bf, sbf) = rows(x, e4m3), rows(w, e4m3)
        blocks = -(-K // 128)
        wg = torch.nn.functional.pad(w, (0, blocks * 128 - K)).reshape(N, blocks, 128)
        sw = wg.abs().amax(-1).clamp(min=1e-12) / 448.0  # per row and 128-wide group of K
        xg = torch.nn.functional.pad(x, (0, blocks * 128 - K))
        qg, sg = quantize_groups(xg, 1e-12)
        qg, sg_cols = qg[:, :K], sg.repeat_interleave(128, 1)[:, :K]
        # 128x128 weight blocks: the block's scale is the largest of its rows' groups
        n_blocks = -(-N // 128)
        sblk = torch.nn.functional.pad(sw, (0, 0, 0, n_blocks * 128 - N)).reshape(n_blocks, 128, blocks).amax(1)
        wb = (w / sblk.repeat_interleave(128, 0)[:N].repeat_interleave(128, 1)[:, :K]).to(e4m3)
        sb_el = sblk.repeat_interleave(128, 0)[:N].repeat_interleave(128, 1)[:, :K]
        cases += [
            ("scaled_mm fp8", lambda t: fusepass.scaled_mm(t(af), t(bf.t()), t(saf), t(sbf.t()), bf16, t(bias)),
             ref(af, saf, bf, sbf)),
            ("scaled_mm_blockwise fp8", lambda t: fusepass.scaled_mm_blockwise(
                t(qg), t(wb.t()), t(sg), t(sblk.t()), bf16, t(bias)),
             (qg.double() * sg_cols.double()) @ (wb.double() * sb_el.double()).t() + bias.double()),
        ]
        if K % 128 == 0:
            cases.append(("scaled_mm_blockwise_dynamic fp8", lambda t: fusepass.scaled_mm_blockwise_dynamic(
                t(x), t(wb.t()), t(sblk.t()), bf16, t(bias), 1e-12),
                (qg.double() * sg_cols.double()) @ (wb.double() * sb_el.double()).t() + bias.double()))
    return cases


def _check(args: argparse.Namespace) -> int:
    """Run every op on random W8A8 data; print which implementation ran, the results and their
    error against float64."""
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("fusepass check: --device cuda given but no CUDA GPU is available")
    from .ops.checks import gpu_too_old

    fp8 = gpu_too_old(device, torch.float8_e4m3fn) is None
    M, N, K = args.m, args.n, args.k
    cases = _check_cases(M, N, K, args.seed, fp8)
    print(f"fusepass check on {device}: M={M} N={N} K={K}, out bf16, per-token (or per-group) x per-channel "
          f"(or per-block) scales, bias; running {_implementation(device)}")
    skipped = [] if fp8 else ["fp8 ops (this GPU is older than sm_89)"]
    if fp8 and K % 128:
        skipped.append(f"scaled_mm_blockwise_dynamic (K = {K} is not whole 128-wide groups)")
    worst = 0.0
    for name, fn, ref in cases:
        try:
            out = fn(lambda t: t.to(device)).cpu()
        except (ValueError, TypeError) as e:  # the ops' own input checks, e.g. K too large for int8
            raise SystemExit(f"fusepass check: error: {e}") from None
        err = (out.double() - ref).abs().max().item()
        rel = ((out.double() - ref).norm() / ref.norm()).item()
        worst = max(worst, rel)
        print(f"  {name:<32} out[0, :3] = {[round(v, 3) for v in out[0, :3].tolist()]}; "
              f"vs float64 of the same quantized values: max abs {err:.3g}, rel {rel:.2e}")
    for what in skipped:
        print(f"  skipped: {what}")
    # One bf16 rounding of the result is 2**-8 relative at worst; anything above is a bug.
    ok = worst < 2.0**-8
    print("OK" if ok else "FAILED: error above one bf16 rounding")
    return 0 if ok else 1


def _demo(args: argparse.Namespace) -> int:
    """Check the flags (before the slow imports), then run the demo (fusepass/demo/run.py)."""
    from .demo import run

    return run.run(_demo_options(args))


def _demo_options(args: argparse.Namespace):
    """The demo's options from its flags, with the device's defaults; a clear error (exit
    status 2, or 1 for what is missing on the machine) for anything that would not run."""
    from .demo import models, run

    error = args.parser.error
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("fusepass demo: --device cuda given but no CUDA GPU is available")
    needed = ("transformers",) + {"torchao": ("torchao",), "compressed-tensors": ("compressed_tensors",)}.get(
        args.quantizer, ())
    missing = [m for m in needed if importlib.util.find_spec(m) is None]
    if missing:
        names = [m.replace("_", "-") for m in missing]
        raise SystemExit(f"fusepass demo needs {' and '.join(names)}: pip install 'fusepass[demo]' "
                         f"(or: pip install {' '.join(names)})")
    if args.quant == "fp8":
        if device.type != "cuda":
            error("--quant fp8 needs a CUDA GPU (fp8 matmuls run on GPUs only); use --quant int8 or int8-asym on CPU")
        from .ops.checks import gpu_too_old

        old = gpu_too_old(device, torch.float8_e4m3fn)
        if old is not None:
            (need, cap) = old
            error(f"--quant fp8 needs compute capability >= {need[0]}.{need[1]}; "
                  f"{torch.cuda.get_device_name(device)} has {cap[0]}.{cap[1]}")
    defaults = CUDA_DEFAULTS if device.type == "cuda" else CPU_DEFAULTS
    value = {k: v if getattr(args, k) is None else getattr(args, k) for k, v in defaults.items()}
    sizes = None
    if args.model is not None:
        given = [f"--{flag}" for flag, _ in SIZES if getattr(args, flag.replace("-", "_")) is not None]
        if given:
            error(f"{', '.join(given)} set the random model's sizes; --model {args.model} has its own")
        try:
            models.checkpoint(args.model)
        except ValueError as e:
            error(str(e))
    else:
        sizes = models.Sizes(*(value[flag.replace("-", "_")] for flag, _ in SIZES))
        for problem in sizes.problems():
            error(problem)
    for flag, _ in STEPS:
        if value[flag.replace("-", "_")] < 1:
            error(f"--{flag} must be >= 1")
    speed = device.type == "cuda" if args.speed is None else args.speed
    if args.plot:
        from .demo.plot import INSTALL_HINT, available

        if not speed:
            error("--plot draws the speed table, which runs on CUDA only (or add --speed for CPU timings: "
                  "slow, one compile per model, mode and step)")
        if not available():
            error(INSTALL_HINT)
        if not os.path.isdir(os.path.dirname(os.path.abspath(args.plot))):
            error(f"--plot {args.plot}: no such directory")
    return run.Options(device=device, model=args.model, sizes=sizes, quant=args.quant, quantizer=args.quantizer,
                       prompt_len=value["prompt_len"], new_tokens=value["new_tokens"], batch=value["batch"],
                       speed=speed, plot=args.plot, seed=args.seed, verbose=args.verbose)


COMMANDS = {"demo": _demo, "check": _check}


def run(args: argparse.Namespace) -> int:
    """Run the command that ``fusepass_cli.parse`` read."""
    return COMMANDS[args.command](args)


def main(argv: list[str] | None = None) -> int:
    """The ``fusepass`` command (as ``fusepass_cli.main``; for ``python -m fusepass`` and callers)."""
    return fusepass_cli.main(argv)
