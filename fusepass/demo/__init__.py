"""``fusepass demo``: a W8A8 transformers model, compiled with fusepass, reported on.

models.py (the model, its W8A8 copy, the step inputs), handwritten.py (W8A8 linears in plain
PyTorch), fusion.py (the fusion report), accuracy.py (greedy generation and logits),
timing.py (the speed table), plot.py (its PNG), run.py (the run, in that order).
"""
