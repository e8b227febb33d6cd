"""``bench_model.py --guard-filter``: the guard filters it can compile with, by name.

A guard_filter_fn for torch.compile, for models whose modules do not change after the compile
("unsafe" by torch's name: a changed attribute goes unseen). One variant per process then: its
models' classes are alike, and filtered guards cannot tell one model's weights from another's.
"skip-nn-modules" is torch's own filter; the others drop one kind of guard under the model's
modules each (a guard's name holds its source, e.g. "L['args'][0]._modules['mlp']._buffers['weight']"),
to find which of them a step pays for; "skip-prepared-values" drops all but the tensor guards
under fusepass.prepare's modules.
"""

from __future__ import annotations

import torch

import fusepass

# DUPLICATE_INPUT: one object reached by two sources (a joint's tensors from each sibling,
# also a module or config); counted with the tensor guards, as it keeps inputs apart.
_TENSOR_GUARDS = ("TENSOR_MATCH", "DUPLICATE_INPUT")


def _under_modules(name: str) -> bool:
    return any(part in name for part in ("._modules[", "._parameters[", "._buffers["))


def _under_prepared(model):
    """Whether a guard's source lies under one of ``model``'s ``W8A8Linear`` modules."""
    paths = tuple("".join(f"._modules['{part}']" for part in name.split("."))
                  for name, m in model.named_modules() if isinstance(m, fusepass.W8A8Linear))

    def under(name: str) -> bool:  # the path from the model's root (the name's first _modules)
        start = name.find("._modules[")
        return start >= 0 and name[start:].startswith(paths)
    return under


def _dropping(drop, under=_under_modules):
    def guard_filter(entries):
        return [not (under(e.name) and drop(e.guard_type)) for e in entries]
    return guard_filter


GUARD_FILTERS = {  # name: the filter for a model
    "skip-nn-modules": lambda model: torch.compiler.skip_guard_on_all_nn_modules_unsafe,
    "skip-module-tensors": lambda model: _dropping(lambda kind: kind in _TENSOR_GUARDS),
    "skip-module-values": lambda model: _dropping(lambda kind: kind not in _TENSOR_GUARDS),
    "skip-duplicate-inputs": lambda model: _dropping(lambda kind: kind == "DUPLICATE_INPUT"),
    "skip-prepared-values": lambda model: _dropping(lambda kind: kind not in _TENSOR_GUARDS,
                                                    _under_prepared(model)),
}
