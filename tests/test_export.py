"""torch.export + AOTInductor with the pass: the package holds the fused ops and runs.

Load-time requirement: the package calls ``fusepass::scaled_mm`` through AOTInductor's
proxy executor, so the loading process must ``import fusepass`` (Python ops, registered
on import) before ``torch._inductor.aoti_load_package``.

Runs the CPU package. On torch 2.11 the load itself segfaults in ``aoti_load_package``
(``_load_aoti``): a CUDA package on an H200 and the CPU package on an H100 machine
(exit -11, 2026-11-21); there the test checks the compiled package only. torch 2.13 loads
and runs it.
"""

import json
import os
import subprocess
import sys
import textwrap
import zipfile

import pytest
import torch
from torch._dynamo.utils import counters

import fusepass
from tests.models import MLP

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEVICE = "cpu"


def test_export_aoti_package_runs_fused(tmp_path):
    counters["fusepass"].clear()
    model = MLP().to(DEVICE).eval()
    x = torch.randn(2, 12, 64, device=DEVICE)
    ep = torch.export.export(model, (x,))
    path = torch._inductor.aoti_compile_and_package(
        ep, package_path=str(tmp_path / "mlp.pt2"), inductor_configs=fusepass.inductor_options())
    assert counters["fusepass"] == {"int_mm_scaled": 2}
    with zipfile.ZipFile(path) as z:
        graph = [json.loads(z.read(n)) for n in z.namelist() if n.endswith("wrapper.json")]
    targets = [node["node"]["target"] for g in graph for node in g["nodes"]]
    assert targets.count("fusepass::scaled_mm") == 2

    if torch.__version__ < (2, 12):
        pytest.skip("torch 2.11's aoti_load_package segfaults loading a package that calls a Python custom op")
    torch.save({"x": x.cpu(), "ref": model(x).detach().cpu()}, tmp_path / "io.pt")
    code = textwrap.dedent(f"""
        import torch
        import fusepass  # registers fusepass::scaled_mm for the package's proxy executor
        io = torch.load({str(tmp_path / 'io.pt')!r})
        model = torch._inductor.aoti_load_package({path!r})
        out = model(io["x"].to({DEVICE!r})).cpu()
        torch.testing.assert_close(out, io["ref"], rtol=1e-5, atol=1e-5)
        print("ok")
    """)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]
