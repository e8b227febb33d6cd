"""What replacing a module in its parent would lose (``prepare``'s linears, the experts of
``quantize_experts`` and ``prepare``): the module's hooks, or a forward set on the instance."""

from __future__ import annotations

from torch import nn


def replacing_loses(module: nn.Module, new: str, call: str, own_forward: bool = False) -> str | None:
    """What replacing ``module`` by ``new`` (in ``call``) would not run, or None: its hooks, or a
    forward replaced on the instance (unless ``own_forward``: one the caller takes apart)."""
    hooks = [kind for kind, held in (("forward pre-hooks", module._forward_pre_hooks), ("forward hooks", module._forward_hooks),
                                     ("backward pre-hooks", module._backward_pre_hooks),
                                     ("backward hooks", module._backward_hooks)) if held]
    if hooks:
        return f"it has {' and '.join(hooks)}, which {new} would not run; register them after {call}, on the new module"
    if "forward" in module.__dict__ and not own_forward and not _own_method(module, module.__dict__["forward"]):
        return f"its forward is replaced on the instance (an offload or dispatch hook, a wrapper), which {new} would not run"
    return None


def _own_method(module: nn.Module, forward) -> bool:
    """``forward`` is the class's own forward bound to ``module`` (what transformers' experts
    set on themselves at their first call): nothing of the module's would be lost."""
    return getattr(forward, "__func__", None) is type(module).forward and getattr(forward, "__self__", None) is module
