"""The ``fusepass`` command line (also ``python -m fusepass``)."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

import torch

DESCRIPTION = "fusepass: fused W8A8 (int8 / fp8) quantized linear layers under torch.compile."


def _check(args: argparse.Namespace) -> int:
    """Run both ops on random W8A8 data; print the result and its error vs float64."""
    import fusepass

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("fusepass check: --device cuda given but no CUDA GPU is available")
    g = torch.Generator().manual_seed(args.seed)
    M, N, K = args.m, args.n, args.k
    w = torch.randn(N, K, generator=g)  # the float weight and activations being quantized
    x = torch.randn(M, K, generator=g)
    bias = torch.randn(N, generator=g)
    # Per-channel symmetric int8 weight, per-token activations (symmetric and asymmetric).
    scale_b = w.abs().amax(1) / 127
    b = torch.round(w / scale_b[:, None]).to(torch.int8).t()
    scale_a = x.abs().amax(1, keepdim=True) / 127
    a = torch.round(x / scale_a).to(torch.int8)
    lo, hi = x.amin(1, keepdim=True), x.amax(1, keepdim=True)
    scale_az = (hi - lo) / 255
    azp = torch.round(-128 - lo / scale_az).to(torch.int32)
    a_az = torch.clamp(torch.round(x / scale_az) + azp, -128, 127).to(torch.int8)
    azp_adj = b.sum(0, dtype=torch.int32)

    def dequant_ref(q, s, z=0):  # what the fused op must equal: dequantize, then matmul
        return ((q.double() - z) * s.double()) @ (b.double() * scale_b.double()) + bias.double()

    def run(fn, t):
        try:
            return fn(t)
        except (ValueError, TypeError) as e:  # the ops' own input checks, e.g. K too large for int8
            raise SystemExit(f"fusepass check: error: {e}") from None

    runs = [
        ("scaled_mm int8", lambda t: fusepass.scaled_mm(t(a), t(b), t(scale_a), t(scale_b), torch.bfloat16, t(bias)),
         dequant_ref(a, scale_a)),
        ("scaled_mm_azp int8", lambda t: fusepass.scaled_mm_azp(
            t(a_az), t(b), t(scale_az), t(scale_b), torch.bfloat16, t(azp_adj), t(azp), t(bias)),
         dequant_ref(a_az, scale_az, azp)),
    ]
    print(f"fusepass check on {device}: M={M} N={N} K={K}, out bf16, per-token x per-channel scales, bias")
    exact = x.double() @ w.double().t() + bias.double()
    worst = 0.0
    for name, fn, ref in runs:
        out = run(fn, lambda t: t.to(device)).cpu()
        err = (out.double() - ref).abs().max().item()
        rel = ((out.double() - ref).norm() / ref.norm()).item()
        qerr = ((out.double() - exact).norm() / exact.norm()).item()
        worst = max(worst, rel)
        print(f"  {name:<20} out[0, :4] = {[round(v, 4) for v in out[0, :4].tolist()]}")
        print(f"  {'':<20} vs dequantized float64: max abs {err:.3g}, rel {rel:.2e}; "
              f"vs unquantized float: rel {qerr:.2e}")
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
    check_help = "run the fused ops on random W8A8 data and print their error against float64"
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
