"""torch.export + AOTInductor with the pass: the package holds the fused kernels and runs
in a fresh process that never imports fusepass.

The pass lowers each fused op to what it runs (``fusepass/passes/lower.py``): Triton kernels
on CUDA, compiled into the package as cubins; ATen ops and Inductor's C++ kernels on CPU.
So the package calls no Python op, and loads where fusepass is not installed.
"""

import subprocess
import sys
import textwrap
import zipfile

import pytest
import torch
from torch._dynamo.utils import counters

import fusepass
from tests.support.models import MLP


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_export_aoti_package_runs_fused(tmp_path, device):
    counters["fusepass"].clear()
    model = MLP().to(device).eval()
    x = torch.randn(2, 12, 64, device=device)
    ep = torch.export.export(model, (x,))
    path = torch._inductor.aoti_compile_and_package(
        ep, package_path=str(tmp_path / "mlp.pt2"), inductor_configs=fusepass.inductor_options())
    assert counters["fusepass"] == {"int_mm_scaled": 2}
    with zipfile.ZipFile(path) as z:
        names = z.namelist()
        wrapper = "".join(z.read(n).decode() for n in names if n.endswith("wrapper.cpp"))
    assert "fusepass::" not in wrapper and "proxy_executor_call_function" not in wrapper
    assert "_int_mm" not in wrapper
    if device == "cuda":
        assert any(n.endswith(".cubin") for n in names) and "scaled_mm_kernel" in wrapper

    _assert_runs_in_a_fresh_process(tmp_path, path, [x], [model(x)], device)


def _assert_runs_in_a_fresh_process(tmp_path, package: str, xs, refs, device: str, tol=1e-5) -> None:
    """``package`` loads and matches ``refs`` on ``xs`` in a fresh Python without fusepass;
    skips where torch's loader dies on a plain nn.Linear package too (torch 2.11)."""
    run = _load_and_run(tmp_path, package, xs, refs, device, tol)
    if run.returncode < 0:  # killed by a signal: is it torch's loader or our package?
        x = xs[0].float()
        control = torch.nn.Linear(x.shape[-1], 64).to(device).eval()
        control_path = torch._inductor.aoti_compile_and_package(
            torch.export.export(control, (x,)), package_path=str(tmp_path / "linear.pt2"))
        if _load_and_run(tmp_path, control_path, [x], [control(x)], device).returncode == run.returncode:
            pytest.skip(f"torch {torch.__version__}: aoti_load_package dies by signal {-run.returncode} "
                        "on a plain nn.Linear package too (torch's loader, not the fused package)")
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]


def _load_and_run(tmp_path, package: str, xs, refs, device: str, tol=1e-5) -> subprocess.CompletedProcess:
    """Load ``package`` in a fresh Python that never imports fusepass; run it on each of ``xs``."""
    torch.save({"xs": [x.cpu() for x in xs], "refs": [r.detach().cpu() for r in refs]}, tmp_path / "io.pt")
    code = textwrap.dedent(f"""
        import sys
        import torch
        io = torch.load({str(tmp_path / 'io.pt')!r})
        model = torch._inductor.aoti_load_package({package!r})
        for x, ref in zip(io["xs"], io["refs"]):
            out = model(x.to({device!r})).cpu()
            torch.testing.assert_close(out.float(), ref.float(), rtol={tol!r}, atol={tol!r})
        assert "fusepass" not in sys.modules
        print("ok")
    """)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)


class _Fp8Linear(torch.nn.Module):
    """A hand-written fp8 linear that calls the op itself (per-token activation scales)."""

    def __init__(self, n=256, k=512):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.register_buffer("w", (torch.randn(n, k, generator=g) * 2).to(torch.float8_e4m3fn))
        self.register_buffer("sw", torch.rand(n, generator=g) * 0.01 + 0.001)

    def forward(self, x):
        sx = x.abs().amax(-1, keepdim=True).float() / 448
        xq = (x / sx).to(torch.float8_e4m3fn)
        return torch.ops.fusepass.scaled_mm(xq, self.w.t(), sx, self.sw, torch.bfloat16)


@pytest.mark.gpu
def test_export_aoti_fp8_dynamic_m_runs_kernel_and_cublas_branches(tmp_path):
    """A dynamic M through AOTInductor: on an sm90 GPU the package holds the kernel's M buckets
    and cuBLAS's _scaled_mm above FP8_CUBLAS_ABOVE_M (a cond), and runs both as the eager op."""
    from fusepass.kernels.policy import FP8_CUBLAS_ABOVE_M

    model = _Fp8Linear().cuda().eval()
    x = torch.randn(32, 512, device="cuda", dtype=torch.bfloat16)
    ep = torch.export.export(model, (x,), dynamic_shapes=({0: torch.export.Dim("m", min=2, max=8192)},))
    path = torch._inductor.aoti_compile_and_package(
        ep, package_path=str(tmp_path / "fp8.pt2"), inductor_configs=fusepass.inductor_options())
    with zipfile.ZipFile(path) as z:
        wrapper = "".join(z.read(n).decode() for n in z.namelist() if n.endswith("wrapper.cpp"))
    assert "fusepass::" not in wrapper and "scaled_mm_kernel" in wrapper
    sm90 = torch.cuda.get_device_capability() == (9, 0)
    assert ("_scaled_mm" in wrapper) == sm90
    xs = [torch.randn(M, 512, device="cuda", dtype=torch.bfloat16) for M in (FP8_CUBLAS_ABOVE_M, FP8_CUBLAS_ABOVE_M + 1, 1000)]
    # (Inductor's activation quantization may round a few fp8 values differently from eager)
    _assert_runs_in_a_fresh_process(tmp_path, path, xs, [model(x) for x in xs], "cuda", tol=2e-2)
