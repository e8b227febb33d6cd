"""One module per pattern family; each opens with what it matches and what it becomes.

A module has ``ANCHORS`` (the matmul ops it starts from), ``NAMES`` (its counter names)
and ``match(node, config)``, which returns a Candidate, None for a node that is not a
quantized matmul, or raises Rejected with the reason it must stay as it is.
"""

from . import blockwise, dequant_mm, int_mm, scaled_mm

# Tried in this order; the first that recognizes a matmul decides about it (blockwise before
# scaled_mm and dequant_mm, which refuse block-wise scales; it leaves them the others).
PATTERNS = {"int_mm": int_mm, "blockwise": blockwise, "scaled_mm": scaled_mm, "dequant_mm": dequant_mm}
