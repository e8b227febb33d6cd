"""Run the fusion pass on the graph Inductor would give it, without Inductor codegen."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch._dynamo.utils import counters

from fusepass.backend import capture_backend
from fusepass.passes import FusePass, PassConfig

_DTYPE = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16", torch.int8: "i8",
          torch.int32: "i32", torch.uint8: "u8", torch.float8_e4m3fn: "f8e4m3", torch.int64: "i64"}


def _fmt_arg(a) -> str:
    if isinstance(a, fx.Node):
        return a.name
    if isinstance(a, (list, tuple)):
        return "[" + ", ".join(_fmt_arg(x) for x in a) + "]"
    if isinstance(a, torch.dtype):
        return _DTYPE.get(a, str(a))
    return repr(a)


def _fmt_val(v) -> str:
    if isinstance(v, torch.Tensor):
        return f"{_DTYPE.get(v.dtype, v.dtype)}{list(v.shape)}"
    if isinstance(v, (list, tuple)) and v and all(isinstance(t, torch.Tensor) for t in v):
        return "(" + ", ".join(map(_fmt_val, v)) + ")"
    return ""


def format_graph(gm: fx.GraphModule, names=()) -> str:
    """One line per op: ``name: dtype[shape] = op(args)``; inputs renamed to ``names``."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    rename = {node.name: name for node, name in zip(placeholders, names)}
    lines = []
    for n in gm.graph.nodes:
        if n.op == "call_function":
            args = [_fmt_arg(a) for a in n.args] + [f"{k}={_fmt_arg(v)}" for k, v in n.kwargs.items()]
            v = n.meta.get("val")
            ty = _fmt_val(v)
            target = n.target.__name__ if n.target.__module__ == "_operator" else str(n.target)
            target = target.replace(".default", "").replace("torch.ops.", "")
            lines.append(f"{n.name}: {ty} = {target}({', '.join(args)})")
        elif n.op == "output":
            lines.append(f"return {_fmt_arg(n.args[0])}")
    text = "\n".join(lines)
    for old, new in sorted(rename.items(), key=lambda kv: -len(kv[0])):
        text = re.sub(rf"\b{old}\b", new, text)
    # Symbol numbering differs between torch versions: number them by first appearance.
    symbols = list(dict.fromkeys(re.findall(r"\bs\d+\b", text)))
    return re.sub(r"\bs\d+\b", lambda m: f"S{symbols.index(m.group(0))}", text)


@dataclass
class Result:
    before: str  # the graph the pass saw
    after: str  # the graph it left
    out: object  # the compiled function's output on the example inputs
    decisions: list
    compiles: int  # graphs traced (1 unless something recompiled)

    @property
    def counts(self) -> dict:
        return dict(counters["fusepass"])


def run_pass(fn, *args, dynamic=None, config: PassConfig | None = None, calls=None) -> Result:
    """Compile ``fn`` with the capture backend, run the pass, call it on ``args`` (then on
    each argument tuple in ``calls``) and report what happened."""
    torch._dynamo.reset()
    counters["fusepass"].clear()
    state = {"before": "", "after": "", "decisions": [], "compiles": 0, "names": []}
    pass_ = FusePass(config)

    def on_graph(gm):
        state["compiles"] += 1
        names = state["names"]
        state["before"] = format_graph(gm, names)
        state["decisions"] += pass_.run(gm.graph)
        gm.recompile()
        state["after"] = format_graph(gm, names)

    def backend(gm, example_inputs):
        # AOT keeps Dynamo's input order; Dynamo names inputs after the user's ("l_sa_").
        state["names"] = [re.sub(r"^l_|_$", "", n.name) for n in gm.graph.nodes if n.op == "placeholder"]
        return capture_backend(on_graph)(gm, example_inputs)

    compiled = torch.compile(fn, backend=backend, dynamic=dynamic, fullgraph=True)
    with torch.no_grad():
        out = compiled(*args)
        for more in calls or ():
            compiled(*more)
    return Result(state["before"], state["after"], out, state["decisions"], state["compiles"])


def assert_policy(fused, eager, ref) -> None:
    """DESIGN.md's numerics policy: the fused result is at least as close to the float64
    reference as the unfused graph's (norm-wise, up to a few fp32 roundings)."""
    ref = ref.double()
    assert fused.shape == eager.shape == ref.shape and fused.dtype == eager.dtype
    assert torch.isfinite(fused).all()
    scale = ref.norm().item()
    e_fused = (fused.double() - ref).norm().item()
    e_eager = (eager.double() - ref).norm().item()
    assert e_fused <= e_eager + 4 * 2.0**-24 * scale, (
        f"fused error {e_fused / scale:.3g} > unfused {e_eager / scale:.3g} (relative)"
    )


def fused_calls(after: str) -> int:
    """Fused matmuls in a rewritten graph (``format_graph``): scaled_mm / scaled_mm_azp calls,
    and each member of a scaled_mm_group call (its list of weights)."""
    calls = len(re.findall(r"= fusepass\.scaled_mm(?:_azp)?\(", after))
    members = re.findall(r"= fusepass\.scaled_mm_group\([^,]+, \[([^\]]*)\]", after)
    return calls + sum(len(m.split(", ")) for m in members)
