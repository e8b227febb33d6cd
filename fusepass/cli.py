"""The ``fusepass`` command line (also ``python -m fusepass``)."""

from __future__ import annotations

import argparse
import sys

import torch


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
        out = fn(lambda t: t.to(device)).cpu()
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


def _demo(args: argparse.Namespace) -> int:
    """Build, quantize, compile and report on a Llama-style model (see fusepass/demo)."""
    from .demo import run
    from .demo.model import Shape

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    defaults = run.CUDA_DEFAULTS if device.type == "cuda" else run.CPU_DEFAULTS
    size = {k: getattr(args, k) if getattr(args, k) is not None else v for k, v in defaults.items()}
    shape = Shape(**{k: size[k] for k in ("layers", "dim", "hidden", "heads", "kv_heads")})
    try:
        shape.check()
    except ValueError as e:
        args.parser.error(str(e))
    if size["tokens"] < 1 or size["decode_batch"] < 1:
        args.parser.error("--tokens and --decode-batch must be >= 1")
    return run.run(args.scheme, device, shape, size["tokens"], size["decode_batch"], args.seed)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fusepass", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="compile a W8A8 Llama-style model with fusepass: fusion report, accuracy, "
                                    "and on CUDA the latency against stock torch.compile and bf16")
    d.add_argument("--scheme", choices=["int8", "int8-azp", "fp8"], default="int8",
                   help="int8: per-token symmetric activations; int8-azp: per-token asymmetric (zero point); "
                        "fp8: row-wise e4m3 (CUDA only). Weights: per-channel symmetric.")
    d.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda if available")
    for flag, what in (("layers", "decoder layers"), ("dim", "model dim"), ("hidden", "MLP hidden size"),
                       ("heads", "attention heads"), ("kv-heads", "key/value heads"),
                       ("tokens", "prefill tokens"), ("decode-batch", "decode batch (one token each)")):
        d.add_argument(f"--{flag}", type=int, help=f"{what} (default: small on CPU, Llama-3-8B on CUDA)")
    d.add_argument("--seed", type=int, default=0)
    d.set_defaults(run=_demo, parser=d)
    p = sub.add_parser("check", help="run the fused ops on random W8A8 data and print their error")
    p.add_argument("-m", type=int, default=33, help="tokens (rows of the activations)")
    p.add_argument("-n", type=int, default=256, help="output features")
    p.add_argument("-k", type=int, default=512, help="input features")
    p.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda if available")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(run=_check)
    args = parser.parse_args(argv)
    for dim in ("m", "n", "k"):
        if getattr(args, dim, 1) < 1:
            parser.error(f"-{dim} must be >= 1")
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
