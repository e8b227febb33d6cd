"""The FX pass that rewrites quantized matmul epilogues into the fusepass ops."""

from .fuse_pass import Decision, FusePass, PassConfig, RewritePass

__all__ = ["Decision", "FusePass", "PassConfig", "RewritePass"]
