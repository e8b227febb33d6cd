"""The ``fusepass`` command line (also ``python -m fusepass``)."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

import torch

DESCRIPTION = "fusepass: fused W8A8 (int8 / fp8) quantized linear layers under torch.compile."


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
    lo, hi = x.amin(1, keepdim=True), x.amax(1, keepdim=True)
    s_az = (hi - lo) / 255
    azp = torch.round(-128 - lo / s_az).to(torch.int32)
    a_az = torch.clamp(torch.round(x / s_az) + azp, -128, 127).to(torch.int8)
    qd, sd = quantize_rows(xb, torch.int8, 127.5, torch.finfo(torch.float32).eps)  # scaled_mm_dynamic's recipe
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


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("fusepass")
    except PackageNotFoundError:
        return "unknown (source tree)"


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each flag's default, except where there is none or its help already says it."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


SIZES = (("layers", "decoder layers"), ("hidden-size", "model width"), ("intermediate-size", "MLP width"),
         ("heads", "attention heads"), ("kv-heads", "key/value heads"), ("vocab-size", "vocabulary"))
STEPS = (("prompt-len", "prompt tokens (prefill)"), ("new-tokens", "tokens generated greedily"),
         ("batch", "the larger batch of the fusion report and the speed table (besides batch 1)"))


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
    defaults = run.CUDA_DEFAULTS if device.type == "cuda" else run.CPU_DEFAULTS
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


def main(argv: list[str] | None = None) -> int:
    from .demo.models import QUANTIZERS, QUANTS
    from .demo.run import CPU_DEFAULTS, CUDA_DEFAULTS

    parser = argparse.ArgumentParser(prog="fusepass", description=DESCRIPTION, formatter_class=_Formatter)
    parser.add_argument("--version", action="version", version=f"fusepass {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    demo_help = ("compile a W8A8 transformers model (Llama) with fusepass: fusion report, accuracy against "
                 "bf16, greedy-token agreement, and on CUDA the speed against stock torch.compile and bf16")
    d = sub.add_parser("demo", help=demo_help, description=demo_help[0].upper() + demo_help[1:] + ".",
                       formatter_class=_Formatter)
    d.add_argument("--model", metavar="PATH_OR_ID",
                   help="a checkpoint to load with from_pretrained: a local directory, or a Hugging Face Hub id "
                        "(needs the network); a W8A8 checkpoint runs as it is: compressed-tensors' (llm-compressor's), "
                        "transformers' native FP8 (on a GPU of compute capability 8.9 or newer) and FBGEMM FP8 "
                        "(default: a LlamaForCausalLM from a config, random weights, sized by the flags below)")
    d.add_argument("--quant", choices=QUANTS, default="int8",
                   help="int8: per-token symmetric activations; int8-asym: per-token asymmetric (zero point); "
                        "fp8: row-wise e4m3 (CUDA, compute capability 8.9 or newer). Weights: per-channel symmetric")
    d.add_argument("--quantizer", choices=QUANTIZERS, default="torchao",
                   help="who quantizes every linear: torchao (Int8DynamicActivationInt8WeightConfig, with "
                        "act_mapping_type=MappingType.ASYMMETRIC for int8-asym; "
                        "Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()) for fp8), or handwritten: "
                        "torch._int_mm / torch._scaled_mm and the dequantization written out in plain PyTorch "
                        "(fusepass/demo/handwritten.py), or compressed-tensors: as a W8A8 checkpoint of its "
                        "format loads (W8A8, W8A8 with asymmetric activations, FP8_DYNAMIC; lm_head left bf16). "
                        "torchao and compressed-tensors models go through fusepass.prepare. Ignored for a --model "
                        "that is a W8A8 checkpoint: it is its own W8A8 model")
    d.add_argument("--device", choices=["cpu", "cuda"], help="where to run (default: cuda if available)")
    for flag, what in SIZES + STEPS:
        key = flag.replace("-", "_")
        d.add_argument(f"--{flag}", type=int, metavar="N",
                       help=f"{what} (default: {CPU_DEFAULTS[key]} on CPU, {CUDA_DEFAULTS[key]} on CUDA)")
    d.add_argument("--speed", action=argparse.BooleanOptionalAction,
                   help="time prefill and decode of bf16, stock torch.compile and fusepass, in default mode and "
                        "with CUDA graphs (default: on with CUDA, off on a CPU, where the timings are labelled CPU "
                        "and take a slow compile each)")
    d.add_argument("--plot", metavar="FILE", help="write the speed table as a PNG bar chart (needs matplotlib)")
    d.add_argument("--seed", type=int, default=0, help="seed of the random weights and prompt")
    d.add_argument("--verbose", action="store_true", help="print each graph's fusion report in full")
    d.set_defaults(run=_demo, parser=d)
    check_help = "run every fused op on random W8A8 data and print which implementation ran and its error against float64"
    p = sub.add_parser("check", help=check_help, description=check_help[0].upper() + check_help[1:] + ".",
                       formatter_class=_Formatter)
    p.add_argument("-m", type=int, default=33, help="tokens (rows of the activations)")
    p.add_argument("-n", type=int, default=256, help="output features")
    p.add_argument("-k", type=int, default=512, help="input features")
    p.add_argument("--device", choices=["cpu", "cuda"], help="where to run (default: cuda if available)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random data")
    p.set_defaults(run=_check)
    args = parser.parse_args(argv)
    for dim in ("m", "n", "k"):
        if getattr(args, dim, 1) < 1:
            parser.error(f"-{dim} must be >= 1")
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
