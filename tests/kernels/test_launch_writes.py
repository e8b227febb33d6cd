"""Every dense launch (the tiles, split or not; the M = 1 kernel plain, quantizing and gating its
row; the block-wise kernels; the grouped siblings) passes every argument by name and, by
Inductor's analysis of the kernel (``tests/support/helpers.written_arguments``), writes only
its outputs: an input counted as written is copied by functionalization at every call of a
traced launch (the experts' kernels copied their weights so, 240 us a layer on an H200,
``test_grouped_kernel.py``). Triton's interpreter on CPU, the GPU when there is one."""

import torch

from fusepass.kernels import blockwise_launch, configs, group_launch, launch
from fusepass.kernels.blockwise_launch import gemv_blocks, launch_gemv_quantized_groups, launch_scaled_mm_blockwise
from fusepass.kernels.configs import Config
from fusepass.kernels.group_launch import launch_scaled_mm_group
from fusepass.kernels.launch import launch_gemv_quantized, launch_scaled_mm
from tests.support.helpers import make_problem, recording_launches, written_arguments

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BF16 = torch.bfloat16
SPLIT = {"out_ptr", "partial_ptr", "tickets_ptr"}  # (a split K's partial sums and its tiles' tickets)


def _launches(monkeypatch) -> list:
    """The launches of each dense launch path on small problems, recorded."""
    monkeypatch.setattr(configs, "sm_count", lambda device: configs.DEFAULT_SMS)
    launches = recording_launches(monkeypatch, launch, blockwise_launch, group_launch)
    wide = make_problem(1, 1056, 128, device=DEVICE, seed=1)  # (the M = 1 kernel: N >= 1056 on 132 SMs)
    launch_scaled_mm(wide.a, wide.b, wide.scale_a, wide.scale_b, BF16)
    tiles = make_problem(20, 40, 96, device=DEVICE, seed=2)
    for split in (1, 2):
        cfg = Config(block_m=16, block_n=32, block_k=32, num_warps=4, num_stages=2, split_k=split)
        launch_scaled_mm(tiles.a, tiles.b, tiles.scale_a, tiles.scale_b, BF16, config=cfg)
    x = torch.randn(1, 128, device=DEVICE).to(BF16)
    launch_gemv_quantized(x, wide.b, wide.scale_b, BF16, None, 127.5, 1e-8)
    launch_gemv_quantized(x, wide.b, wide.scale_b, BF16, None, 127.5, 1e-8, gate=torch.randn_like(x))
    w8 = (torch.randn(1056, 256, device=DEVICE) / 4).to(torch.float8_e4m3fn)
    blocks = torch.rand(2, 9, device=DEVICE) + 0.5  # ([K / 128, N / 128] of b = w.t())
    groups = torch.rand(1, 2, device=DEVICE) + 0.5
    launch_scaled_mm_blockwise(x.new_zeros(1, 256).to(torch.float8_e4m3fn), w8.t(), groups, blocks, BF16,
                               config=gemv_blocks(1056, 256, DEVICE))
    launch_scaled_mm_blockwise(torch.zeros(20, 256, device=DEVICE).to(torch.float8_e4m3fn), w8.t(),
                               torch.rand(20, 2, device=DEVICE), blocks, BF16,
                               config=Config(block_m=16, block_n=32, block_k=128, num_warps=4, num_stages=2))
    launch_gemv_quantized_groups(torch.randn(1, 256, device=DEVICE).to(BF16), w8.t(), blocks, BF16, None, 1e-8)
    sib = make_problem(20, 48, 96, device=DEVICE, seed=3)
    launch_scaled_mm_group(tiles.a, [tiles.b, sib.b], tiles.scale_a, [tiles.scale_b, sib.scale_b], BF16, [None, None])
    joined = make_problem(1, 1024, 128, device=DEVICE, seed=4)  # (M = 1, 2048 joined: the M = 1 loop)
    launch_scaled_mm_group(wide.a, [wide.b[:, :1024], joined.b], wide.scale_a, [wide.scale_b[:, :1024], joined.scale_b],
                           BF16, [None, None])
    return launches


def test_every_dense_launch_names_every_argument_and_writes_only_its_outputs(monkeypatch):
    launches = _launches(monkeypatch)
    names = [getattr(k, "fn", k).__name__ for k, _ in launches]
    assert {"scaled_gemv_kernel", "scaled_mm_kernel", "blockwise_gemv_kernel", "blockwise_mm_kernel",
            "scaled_mm_group_kernel"} <= set(names), names
    assert [kw["GEMV"] for k, kw in launches if "GEMV" in kw] == [False, True]  # (the group's tiles, its M = 1 loop)
    assert sorted((kw["QUANT"], kw["GATED"]) for k, kw in launches if "GATED" in kw) == [
        (False, False), (True, False), (True, True)]  # (the M = 1 kernel: plain, quantizing, gated)
    for (kernel, kwargs), written in zip(launches, written_arguments(launches)):
        split = kwargs.get("SPLIT_K", 1) > 1
        outputs = {n for n, v in kwargs.items() if n.startswith("out") and n.endswith("_ptr") and v is not None}
        outputs |= SPLIT - {"out_ptr"} if split else set()
        assert written == outputs, (getattr(kernel, "fn", kernel).__name__, kwargs.get("QUANT"), kwargs.get("GATED"))
