import pytest

from fusepass import cli


def test_check_runs_and_reports(capsys):
    assert cli.main(["check", "-m", "5", "-n", "64", "-k", "96"]) == 0
    out = capsys.readouterr().out
    assert "scaled_mm int8" in out and "scaled_mm_azp int8" in out and out.rstrip().endswith("OK")


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
