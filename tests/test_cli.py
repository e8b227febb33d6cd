import pytest

from fusepass import cli


def test_check_runs_every_op_and_says_which_implementation(capsys):
    assert cli.main(["check", "-m", "5", "-n", "64", "-k", "256"]) == 0
    out = capsys.readouterr().out
    ran = [line.split()[0] for line in out.splitlines() if "vs float64" in line]
    import fusepass.ops

    assert sorted(set(ran)) == sorted(fusepass.ops.__all__), out  # every op, int8 and fp8 forms
    assert "running the CPU reference" in out.splitlines()[0] and out.rstrip().endswith("OK")


def test_check_says_what_it_skips(capsys):
    assert cli.main(["check", "-m", "3", "-n", "64", "-k", "96"]) == 0
    assert "skipped: scaled_mm_blockwise_dynamic (K = 96 is not whole 128-wide groups)" in capsys.readouterr().out


@pytest.mark.parametrize("argv,message", [
    (["check", "-m", "0"], "-m must be >= 1"),
    (["check", "--device", "tpu"], "invalid choice: 'tpu'"),
    ([], "the following arguments are required: command"),
])
def test_bad_arguments(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_cuda_requested_without_gpu(monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(SystemExit, match="--device cuda given but no CUDA GPU is available"):
        cli.main(["check", "--device", "cuda"])


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0
    from importlib.metadata import version

    assert capsys.readouterr().out.strip() == f"fusepass {version('fusepass')}"


def test_version_from_a_source_tree(monkeypatch, capsys):
    import importlib.metadata

    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    with pytest.raises(SystemExit):
        cli.main(["--version"])
    assert capsys.readouterr().out.strip() == "fusepass unknown (source tree)"


def test_check_k_too_large_is_one_clear_line(capsys):
    """The op's own ValueError becomes the command's one-line error (exit status 1), not a traceback."""
    with pytest.raises(SystemExit) as e:
        cli.main(["check", "-k", "131072", "--device", "cpu"])
    message = str(e.value.code)  # SystemExit("...") prints it to stderr and exits 1
    assert isinstance(e.value.code, str) and "\n" not in message
    assert message.startswith("fusepass check: error: fusepass.scaled_mm: K = 131072 is too large for exact int32")


@pytest.mark.parametrize("argv", [[], ["demo"], ["check"]])
def test_help_shows_defaults_and_no_markup(argv, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main([*argv, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "``" not in out and "(default: None)" not in out
    if argv == ["demo"]:
        for shown in ("(default: int8)", "(default: torchao)", "(default: 2 on CPU, 32 on CUDA)",
                      "(default: 4 on CPU, 16 on CUDA)", "(default: 0)"):
            assert shown in " ".join(out.split()), out
    if argv == ["check"]:
        assert "(default: 33)" in out and "(default: 512)" in out


def test_import_fusepass_needs_neither_transformers_nor_torchao():
    import subprocess
    import sys

    code = "import sys, fusepass, fusepass.cli; print(sorted({'transformers', 'torchao'} & set(sys.modules)))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stderr


def test_help_answers_without_importing_torch():
    """``fusepass demo --help`` is read before torch is imported (torch alone takes seconds): the
    script's entry point, fusepass_cli, parses first."""
    import subprocess
    import sys

    code = ("import sys, fusepass_cli\ntry:\n    fusepass_cli.main(['demo', '--help'])\nexcept SystemExit as e:\n"
            "    assert e.code == 0\nprint(sorted(m for m in ('torch', 'fusepass') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "--quantizer" in r.stdout and r.stdout.strip().endswith("[]"), r.stdout


def test_the_script_runs_fusepass_cli():
    """pyproject's script entry point is the torch-free parser (the test above)."""
    import tomllib
    from pathlib import Path

    project = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())
    assert project["project"]["scripts"]["fusepass"] == "fusepass_cli:main"
    assert "fusepass_cli" in project["tool"]["setuptools"]["py-modules"]
