"""The ``fusepass`` command's front: its flags, their defaults and ``--help``, read without
importing torch (seconds on its own), so that ``fusepass demo --help`` answers at once; the
commands themselves run in ``fusepass.cli``. It imports nothing of fusepass at import time, and
the demo takes its vocabulary (``QUANTS``, ``QUANTIZERS``, the defaults) from here."""

from __future__ import annotations

import argparse
import sys

DESCRIPTION = "fusepass: fused W8A8 (int8 / fp8) quantized linear layers under torch.compile."
QUANTS = ("int8", "int8-asym", "fp8")
# (the demo's; the benchmark also has "transformers" and "fbgemm": transformers' FP8 modules)
QUANTIZERS = ("torchao", "handwritten", "compressed-tensors")
# Defaults by device: a tiny model on CPU (Inductor compiles C++ there, slowly); on CUDA,
# Llama-3-8B's full size: a cost per quantized weight shows only at full depth.
CPU_DEFAULTS = dict(layers=2, hidden_size=256, intermediate_size=512, heads=4, kv_heads=2, vocab_size=1024,
                    prompt_len=32, new_tokens=16, batch=4)
CUDA_DEFAULTS = dict(layers=32, hidden_size=4096, intermediate_size=14336, heads=32, kv_heads=8, vocab_size=128256,
                     prompt_len=2048, new_tokens=32, batch=16)


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


def parser() -> argparse.ArgumentParser:
    """The ``fusepass`` command's parser (``demo`` and ``check``)."""
    top = argparse.ArgumentParser(prog="fusepass", description=DESCRIPTION, formatter_class=_Formatter)
    top.add_argument("--version", action="version", version=f"fusepass {_version()}")
    sub = top.add_subparsers(dest="command", required=True)
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
    d.set_defaults(parser=d)
    check_help = "run every fused op on random W8A8 data and print which implementation ran and its error against float64"
    p = sub.add_parser("check", help=check_help, description=check_help[0].upper() + check_help[1:] + ".",
                       formatter_class=_Formatter)
    p.add_argument("-m", type=int, default=33, help="tokens (rows of the activations)")
    p.add_argument("-n", type=int, default=256, help="output features")
    p.add_argument("-k", type=int, default=512, help="input features")
    p.add_argument("--device", choices=["cpu", "cuda"], help="where to run (default: cuda if available)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random data")
    return top


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line's arguments, checked as far as they can be without torch."""
    top = parser()
    args = top.parse_args(argv)
    for dim in ("m", "n", "k"):
        if getattr(args, dim, 1) < 1:
            top.error(f"-{dim} must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    """The ``fusepass`` script: parse (``--help`` ends here, torch not imported), then run."""
    args = parse(argv)
    from fusepass import cli  # torch, the ops and the backend: the commands need them

    return cli.run(args)


if __name__ == "__main__":
    sys.exit(main())
