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
from tests.models import MLP


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

    run = _load_and_run(tmp_path, path, x, model(x), device)
    if run.returncode < 0:  # killed by a signal: is it torch's loader or our package?
        control = torch.nn.Linear(64, 64).to(device).eval()
        control_path = torch._inductor.aoti_compile_and_package(
            torch.export.export(control, (x,)), package_path=str(tmp_path / "linear.pt2"))
        if _load_and_run(tmp_path, control_path, x, control(x), device).returncode == run.returncode:
            pytest.skip(f"torch {torch.__version__}: aoti_load_package dies by signal {-run.returncode} "
                        "on a plain nn.Linear package too (torch's loader, not the fused package)")
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]


def _load_and_run(tmp_path, package: str, x, ref, device: str) -> subprocess.CompletedProcess:
    """Load ``package`` in a fresh Python that never imports fusepass; run it on ``x``."""
    torch.save({"x": x.cpu(), "ref": ref.detach().cpu()}, tmp_path / "io.pt")
    code = textwrap.dedent(f"""
        import sys
        import torch
        io = torch.load({str(tmp_path / 'io.pt')!r})
        model = torch._inductor.aoti_load_package({package!r})
        out = model(io["x"].to({device!r})).cpu()
        torch.testing.assert_close(out, io["ref"], rtol=1e-5, atol=1e-5)
        assert "fusepass" not in sys.modules
        print("ok")
    """)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
