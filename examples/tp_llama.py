"""A small Llama-style W8A8 model under tensor parallelism, compiled with fusepass.

    torchrun --nproc-per-node 2 examples/tp_llama.py              # gloo on CPU, nccl on CUDA

Builds the model (torchtitan's layout: attention wq/wk/wv/wo, feed-forward w1/w2/w3, a
static KV cache), quantizes every linear with the plain-PyTorch W8A8 linears of
``fusepass/demo/handwritten.py`` (``--quant int8``, ``int8-asym``) or with torchao's fp8
(``--quant torchao-fp8``, a GPU of compute capability >= 8.9), shards it with
``parallelize_module`` (column-wise wq, wk, wv, w1, w3 and the output head, row-wise wo and
w2, as torchtitan does), compiles it with
``backend="fusepass"``, and reports per rank how many quantized linears fused, the error
against the same model on one process and against the unquantized model, and the prefill and
decode times against the unquantized model sharded the same way with PyTorch's own styles and
compiled by stock ``torch.compile`` (on a CPU, labelled CPU timings). Exits non-zero where the
sharded model breaks the numerics policy (``Result.ok``). ``--help`` lists the flags.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import fusepass
from fusepass.demo.handwritten import quantize
from fusepass.distributed import (QuantColwiseParallel, QuantRowwiseParallel, TorchaoColwiseParallel,
                                  TorchaoRowwiseParallel)

TORCHAO = "torchao-fp8"  # the --quant of torchao's Float8DynamicActivationFloat8WeightConfig, per row


@dataclass(frozen=True)
class Config:
    dim: int = 256
    layers: int = 2
    heads: int = 8
    kv_heads: int = 4
    ffn: int = 512
    vocab: int = 512
    max_len: int = 64


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps).to(x.dtype) * self.weight


def rotate(x, cos, sin):
    x1, x2 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), -1).flatten(-2).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.head_dim, self.rep = c.dim // c.heads, c.heads // c.kv_heads
        self.wq = nn.Linear(c.dim, c.heads * self.head_dim, bias=False)
        self.wk = nn.Linear(c.dim, c.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(c.dim, c.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(c.heads * self.head_dim, c.dim, bias=False)
        self.register_buffer("cache_k", None, persistent=False)  # setup_cache makes them
        self.register_buffer("cache_v", None, persistent=False)

    def setup_cache(self, batch: int, max_len: int, kv_heads: int, dtype, device) -> None:
        shape = (batch, kv_heads, max_len, self.head_dim)
        self.cache_k = torch.zeros(shape, dtype=dtype, device=device)
        self.cache_v = torch.zeros(shape, dtype=dtype, device=device)

    def forward(self, x, cos, sin, pos, mask):
        B, S, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds heads / world of them.
        q = rotate(self.wq(x).view(B, S, -1, self.head_dim), cos, sin).transpose(1, 2)
        k = rotate(self.wk(x).view(B, S, -1, self.head_dim), cos, sin).transpose(1, 2)
        v = self.wv(x).view(B, S, -1, self.head_dim).transpose(1, 2)
        self.cache_k.index_copy_(2, pos, k)
        self.cache_v.index_copy_(2, pos, v)
        k, v = (c.repeat_interleave(self.rep, 1) for c in (self.cache_k, self.cache_v))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.wo(y.transpose(1, 2).reshape(B, S, -1))


class FeedForward(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.w1, self.w3 = nn.Linear(c.dim, c.ffn, bias=False), nn.Linear(c.dim, c.ffn, bias=False)
        self.w2 = nn.Linear(c.ffn, c.dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.attention_norm, self.attention = RMSNorm(c.dim), Attention(c)
        self.ffn_norm, self.feed_forward = RMSNorm(c.dim), FeedForward(c)

    def forward(self, x, cos, sin, pos, mask):
        x = x + self.attention(self.attention_norm(x), cos, sin, pos, mask)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.config = c
        self.tok_embeddings = nn.Embedding(c.vocab, c.dim)
        self.layers = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.norm, self.output = RMSNorm(c.dim), nn.Linear(c.dim, c.vocab, bias=False)
        hd = c.dim // c.heads
        freqs = torch.outer(torch.arange(c.max_len).float(), 10000.0 ** (-torch.arange(0, hd, 2).float() / hd))
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def setup_cache(self, batch: int, world: int = 1) -> None:
        """A static KV cache of ``max_len`` positions; ``world``: the tensor-parallel size
        (each rank caches kv_heads / world heads)."""
        c, p = self.config, self.tok_embeddings.weight
        for layer in self.layers:
            layer.attention.setup_cache(batch, c.max_len, c.kv_heads // world, p.dtype, p.device)

    def forward(self, tokens, pos):
        """``tokens`` [B, S] at positions ``pos`` [S] (an int64 tensor: one graph for every step)."""
        x = self.tok_embeddings(tokens)
        cos, sin = self.cos[pos][None, :, None, :], self.sin[pos][None, :, None, :]
        mask = pos[:, None] >= torch.arange(self.config.max_len, device=pos.device)
        for layer in self.layers:
            x = layer(x, cos, sin, pos, mask)
        return self.output(self.norm(x))


def build(c: Config, quant: str | None, dtype, device, seed: int = 0) -> Transformer:
    """The model, the same on every rank: W8A8 (every nn.Linear a hand-written QuantLinear
    of scheme ``quant``, or torchao's fp8 for ``TORCHAO``), or unquantized for ``quant=None``."""
    torch.manual_seed(seed)
    model = Transformer(c).to(device=device, dtype=dtype).eval()
    for lin in model.modules():  # a trained model's scale: unit-variance outputs of each linear
        if isinstance(lin, nn.Linear):
            nn.init.normal_(lin.weight, std=lin.in_features ** -0.5)
    if quant == TORCHAO:
        from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_

        # set_inductor_config=False: torchao's default turns on Inductor options for every
        # compile in the process, the unquantized baseline's too.
        quantize_(model, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow(), set_inductor_config=False))
        return model
    return model if quant is None else quantize(model, quant)


def tp_plan(model: Transformer, quant: str | None) -> dict:
    """torchtitan's plan: column-wise into a block's attention and feed-forward, row-wise out
    of them (one all-reduce each); the output head column-wise, gathered. fusepass's styles
    for the quantized linears (hand-written or torchao's), PyTorch's own for the unquantized
    model."""
    colwise, rowwise = {None: (ColwiseParallel, RowwiseParallel),
                        TORCHAO: (TorchaoColwiseParallel, TorchaoRowwiseParallel)}.get(
                            quant, (QuantColwiseParallel, QuantRowwiseParallel))
    plan = {"output": colwise(output_layouts=Replicate())}
    for i in range(len(model.layers)):
        plan |= {f"layers.{i}.attention.{n}": colwise() for n in ("wq", "wk", "wv")}
        plan |= {f"layers.{i}.feed_forward.{n}": colwise() for n in ("w1", "w3")}
        plan |= {f"layers.{i}.attention.wo": rowwise(), f"layers.{i}.feed_forward.w2": rowwise()}
    return plan


def shard(model: Transformer, mesh, batch: int, quant: str | None) -> Transformer:
    """``model`` (built with ``quant``) sharded over ``mesh``, its cache set up for ``batch``."""
    # src_data_rank=None: every rank built the same model, so each takes its shard locally
    # (no scatter from rank 0).
    model = parallelize_module(model, mesh, tp_plan(model, quant), src_data_rank=None)
    model.setup_cache(batch, mesh.size())
    return model


def step(model, tokens, pos):
    """One call of a compiled model. A new step for CUDA graphs (mode="reduce-overhead"; a
    no-op otherwise): a replay overwrites the outputs of the last one, so callers copy what
    they keep."""
    torch.compiler.cudagraph_mark_step_begin()
    return model(tokens, pos)


def generate(model, prompt, new_tokens: int):
    """Greedy: the prefill logits, and the tokens of ``new_tokens`` decode steps."""
    S, device = prompt.shape[1], prompt.device
    logits = step(model, prompt, torch.arange(S, device=device)).clone()
    tok, out = logits[:, -1:].argmax(-1), []
    for i in range(new_tokens):
        out.append(tok)
        tok = step(model, tok, torch.tensor([S + i], device=device))[:, -1:].argmax(-1)
    return logits, torch.cat(out, 1) if out else prompt[:, :0]


def rel_err(x, ref) -> float:
    return ((x.double() - ref.double()).norm() / ref.double().norm()).item()


def timed(fn, device, reps: int) -> float:
    """Median wall time of ``reps`` calls (after one warm-up), in ms."""
    fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    return sorted(times)[len(times) // 2]


def time_steps(compiled, prompt, reps: int) -> tuple[float, float]:
    """(prefill, decode step) median ms of a compiled model: the prompt, then one token at the
    position after it (a slot the cache has; rewriting it changes nothing timed)."""
    S, device = prompt.shape[1], prompt.device
    pos = torch.arange(S, device=device)
    prefill = timed(lambda: step(compiled, prompt, pos), device, reps)
    at = torch.tensor([S], device=device)
    return prefill, timed(lambda: step(compiled, prompt[:, :1], at), device, reps * 4)


@dataclass
class Result:
    """One rank's outcome."""

    linears: int  # quantized linears in the model
    counters: dict  # counters["fusepass"] after compiling the prefill (and decode) graphs
    report: fusepass.Report  # fusepass.explain of the sharded model's prefill
    decode_report: fusepass.Report | None  # and of its decode step (with new_tokens)
    err_single: float  # relative error of the prefill logits vs the 1-process W8A8 model
    err_float: tuple  # (1-process, tensor-parallel) relative error vs the unquantized model
    agree: int  # decoded tokens (all rows) the 1-process model picks too, given the same prefix
    compile_s: float
    times: dict | None = None  # {"fusepass": (prefill ms, decode ms), "unquantized": (...)}

    @property
    def ok(self) -> bool:
        """The numerics policy (DESIGN.md), the 1-process model standing for the unfused
        graph: the sharded, fused model is as close to the unquantized one, but for the
        rounding of each rank's part of a row-wise linear's output (5%)."""
        single, tp = self.err_float
        return tp <= single * 1.05 + 1e-6


def _quantized(module: nn.Module) -> bool:
    """A hand-written QuantLinear, or an nn.Linear whose (sharded) weight torchao quantized
    (torchao leaves a linear whose sizes do not suit fp8 in bf16)."""
    if type(module).__name__ == "QuantLinear":
        return True
    w = getattr(module, "weight", None) if isinstance(module, nn.Linear) else None
    local = w.to_local() if isinstance(w, DTensor) else w
    return isinstance(local, torch.Tensor) and type(local) not in (torch.Tensor, nn.Parameter)


def progress(msg: str, since: float) -> None:
    """Rank 0's stages on stderr (compiling Llama-3-8B-sized layers takes minutes)."""
    if dist.get_rank() == 0:
        print(f"[rank 0] {msg} ({time.perf_counter() - since:.0f} s)", file=sys.stderr, flush=True)


def run(mesh, c: Config, quant: str, prompt, new_tokens: int, reps: int, dtype, mode: str | None = None) -> Result:
    """Build, shard, compile and check the model on this rank (the group is up); with
    ``reps``, time it and the unquantized model, both compiled in ``mode``."""
    device, (B, S) = prompt.device, prompt.shape
    pos, t0 = torch.arange(S, device=device), time.perf_counter()
    with torch.no_grad():
        model = shard(build(c, quant, dtype, device), mesh, B, quant)
        progress("built and sharded; compiling with fusepass and generating", t0)
        torch._dynamo.utils.counters["fusepass"].clear()
        # dynamic=False for both timed models: Dynamo's automatic dynamic shapes are kept per
        # code object, which they share (a symbolic prompt length would reach only the second).
        compiled = torch.compile(model, backend="fusepass", mode=mode, dynamic=False)
        t = time.perf_counter()
        logits, tokens = generate(compiled, prompt, new_tokens)
        compile_s = time.perf_counter() - t
        counters = dict(torch._dynamo.utils.counters["fusepass"])
        progress("generated; the references and fusepass.explain", t0)

        # The references run eagerly, in one forward over the prompt and the tokens the
        # sharded model chose (teacher-forced: on CUDA torch._int_mm needs M > 16).
        seq = torch.cat([prompt, tokens[:, :-1]], 1)
        single = build(c, quant, dtype, device)  # the 1-process model, on every rank
        single.setup_cache(B)
        ref = single(seq, torch.arange(seq.shape[1], device=device))
        unquantized = build(c, None, dtype, device)
        unquantized.setup_cache(B)
        float_logits = unquantized(prompt, pos)
        result = Result(
            linears=sum(map(_quantized, model.modules())),
            counters=counters,
            # dynamic=False, as compiled: Dynamo has seen two prompt lengths by now, so explain
            # would otherwise trace a symbolic M. (The decode one rewrites the cache at S.)
            report=fusepass.explain(model, prompt, pos, dynamic=False),
            decode_report=(fusepass.explain(model, tokens[:, -1:], torch.tensor([S], device=device), dynamic=False)
                           if new_tokens else None),
            err_single=rel_err(logits, ref[:, :S]),
            err_float=(rel_err(ref[:, :S], float_logits), rel_err(logits, float_logits)),
            agree=int((ref[:, S - 1:S - 1 + new_tokens].argmax(-1) == tokens).sum()),
            compile_s=compile_s,
        )
        if reps:
            progress("timing the fused model, then compiling and timing the unquantized one", t0)
            baseline = torch.compile(shard(build(c, None, dtype, device), mesh, B, None), mode=mode,
                                     dynamic=False)
            result.times = {"fusepass": time_steps(compiled, prompt, reps),
                            "unquantized": time_steps(baseline, prompt, reps)}
        progress("done", t0)
    return result


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cuda: nccl, one GPU per rank; cpu: gloo (default: cuda where there is one)")
    p.add_argument("--quant", choices=("int8", "int8-asym", TORCHAO), default="int8",
                   help=f"hand-written W8A8 int8 (-asym: with zero points), or {TORCHAO}: torchao's fp8 per row")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default=None,
                   help="activations (default: bfloat16 on cuda, float32 on cpu)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--ffn", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--reps", type=int, default=5, help="timed calls (median; decode: 4x as many); 0: no timing")
    p.add_argument("--mode", choices=("default", "reduce-overhead"), default="default",
                   help="torch.compile mode of both timed models (reduce-overhead: CUDA graphs)")
    args = p.parse_args(argv)
    if args.device == "cuda" and args.quant != TORCHAO and args.batch * args.prompt_len <= 16:
        p.error("on cuda --batch x --prompt-len must be > 16: the eager 1-process reference runs torch._int_mm")
    if args.quant == TORCHAO and args.device == "cpu":
        p.error(f"--quant {TORCHAO} needs --device cuda: torchao quantizes to fp8 only on GPUs of compute "
                "capability >= 8.9")
    if args.quant == TORCHAO and args.dtype == "float32":
        p.error(f"--quant {TORCHAO} needs bfloat16 activations: torchao's per-row fp8 takes bf16 weights only")

    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)  # (else barrier() guesses the device, and warns)
    else:
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.kv_heads % world or args.heads % args.kv_heads or args.dim % args.heads:
        raise SystemExit(f"{world} ranks, {args.heads} heads, {args.kv_heads} kv heads, dim {args.dim}: the kv heads "
                         "must divide among the ranks, the heads among the kv heads, and dim among the heads")
    # Each rank's slice of a sharded dim is an N or a K of its matmuls: 16-aligned for the
    # int8 / fp8 kernels (torch._int_mm, torch._scaled_mm and ours).
    sharded = {"--dim": args.dim, "--ffn": args.ffn, "--vocab": args.vocab,
               "--kv-heads x head dim": args.kv_heads * (args.dim // args.heads)}
    if bad := [f"{flag} / {world} = {size / world:g}" for flag, size in sharded.items() if size % (16 * world)]:
        raise SystemExit(f"each rank's slice must be a multiple of 16: {', '.join(bad)}")
    mesh = init_device_mesh(device.type, (world,))
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    # (one position more than generated: the decode timing runs a step at position prompt_len)
    c = Config(dim=args.dim, layers=args.layers, heads=args.heads, kv_heads=args.kv_heads, ffn=args.ffn,
               vocab=args.vocab, max_len=args.prompt_len + max(args.new_tokens, 1))
    prompt = torch.randint(0, c.vocab, (args.batch, args.prompt_len), generator=torch.Generator().manual_seed(1))
    mode = None if args.mode == "default" else args.mode
    r = run(mesh, c, args.quant, prompt.to(device), args.new_tokens, args.reps, dtype, mode)

    lines = [
        f"{args.quant} W8A8, {str(dtype).replace('torch.', '')} activations, {c.layers} layers: {r.linears} "
        f"quantized linears, sharded over {world} ranks ({device.type}, {dist.get_backend()})",
        f"compiled with backend='fusepass' (prefill and decode graphs) in {r.compile_s:.1f} s; "
        f"counters['fusepass']: {r.counters}",
        f"prefill graph, fusepass.explain: {str(r.report).splitlines()[0]}",
        *([f"decode graph, fusepass.explain: {str(r.decode_report).splitlines()[0]}"] if r.decode_report else []),
        f"prefill logits vs the 1-process model: relative error {r.err_single:.2e}; vs the unquantized model: "
        f"{r.err_float[1]:.3e} (1 process: {r.err_float[0]:.3e}) -> {'OK' if r.ok else 'FAIL'}; greedy decode: "
        f"{r.agree} of {args.batch * args.new_tokens} tokens the 1-process model's",
    ]
    if r.times is not None:
        label = "CPU" if device.type == "cpu" else torch.cuda.get_device_name(device)
        lines.append(f"{label} timings, torch.compile {args.mode} mode, median: prefill {args.batch}x{args.prompt_len} "
                     "tokens / decode step")
        for name, (prefill, decode) in r.times.items():
            what = (f"W8A8 {args.quant}, fusepass" if name == "fusepass"
                    else f"unquantized {str(dtype).replace('torch.', '')}, stock torch.compile")
            lines.append(f"  {what}: {prefill:.2f} ms / {decode:.2f} ms ({args.batch * 1e3 / decode:.0f} tokens/s)")
        (fp, fd), (bp, bd) = r.times["fusepass"], r.times["unquantized"]
        lines.append(f"  fusepass speedup: prefill {bp / fp:.2f}x, decode {bd / fd:.2f}x")
    for i in range(world):  # one rank at a time, in order
        if i == rank:
            print("\n".join(f"[rank {rank}] {line}" for line in lines), flush=True)
        dist.barrier()
    ok = torch.tensor([float(r.ok)], device=device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    # Free the CUDA graphs of mode="reduce-overhead" first: they hold the NCCL communicator
    # (they captured its all-reduces), and destroying it waits for them: without this the
    # processes hung at exit on 2 H200s (pytorch/pytorch#115388).
    torch._dynamo.reset()
    dist.destroy_process_group()
    if not ok.item():
        raise SystemExit("the tensor-parallel model does not match the 1-process one (numerics policy)")


if __name__ == "__main__":
    main()
