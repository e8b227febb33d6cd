"""``fusepass.prepare`` of a compressed-tensors FP8_DYNAMIC mixture-of-experts checkpoint (Qwen3-MoE,
Mixtral, OLMoE, tiny), written as llm-compressor writes one (``demo.models.save_compressed_moe``:
compressed-tensors quantizes and compresses each expert's linears) and loaded by
``from_pretrained``, which dequantizes the experts to bf16: prepare reads the checkpoint's values
back, bit for bit, runs them on ``fusepass.scaled_grouped_mm``, and leaves what it cannot read
or what changed since loading, saying why."""

import shutil

import pytest
import torch
from safetensors import safe_open

import fusepass
from fusepass.demo.models import save_compressed_moe
from fusepass.integrations.experts import W8A8Experts
from tests.integrations.test_experts import ARCHS, _routed_inputs, _simulated, moe_model

# the checkpoint's names of an expert's gate, up and down linears, by architecture
NAMES = {"qwen3_moe": ("mlp", "gate_proj", "up_proj", "down_proj"), "olmoe": ("mlp", "gate_proj", "up_proj", "down_proj"),
         "mixtral": ("mlp", "w1", "w3", "w2")}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    paths = {}
    for arch in ARCHS:
        paths[arch] = tmp_path_factory.mktemp(arch)
        save_compressed_moe(moe_model(arch), "FP8_DYNAMIC", paths[arch])
    return paths


def _load(path, **kwargs):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, **kwargs).eval()


def _stored(path, arch, layer):
    """The checkpoint's gate/up and down of ``layer``: values and scales as stored."""
    _, gate, up, down = NAMES[arch]
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        keys = [k for k in f.keys() if f"layers.{layer}." in k and ".experts." in k]
        E = len({k.split(".experts.")[1].split(".")[0] for k in keys})
        prefix = keys[0].split(".experts.")[0] + ".experts"

        def stack(proj, what):
            return torch.stack([f.get_tensor(f"{prefix}.{e}.{proj}.{what}") for e in range(E)])

        gate_up = torch.cat([stack(gate, "weight"), stack(up, "weight")], 1)
        gate_up_scale = torch.cat([stack(gate, "weight_scale"), stack(up, "weight_scale")], 1).float().squeeze(-1)
        return gate_up, gate_up_scale, stack(down, "weight"), stack(down, "weight_scale").float().squeeze(-1)


@pytest.mark.parametrize("arch", ARCHS)
def test_the_experts_run_the_checkpoints_values(arch, checkpoints):
    model = _load(checkpoints[arch])
    ids = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids).logits.float()  # (a first forward: transformers' experts set their forward on themselves)
        report = fusepass.prepare(model)
        out = model(ids).logits.float()
    names = [f"model.layers.{i}.mlp.experts" for i in range(2)]
    assert report.experts == {n: "experts fp8" for n in names} and not report.experts_left
    assert len(report.converted) == 8 and not report.left  # (attention's linears, as before)
    assert "2 experts modules converted, 0 left as they are" in str(report)
    for layer, name in enumerate(names):
        module = model.get_submodule(name)
        assert isinstance(module, W8A8Experts) and module.act.kind == "fp8"
        for got, want in zip((module.gate_up, module.gate_up_scale, module.down, module.down_scale),
                             _stored(checkpoints[arch], arch, layer)):
            assert got.dtype == want.dtype and torch.equal(got, want)  # bit for bit
    x, index, weights = _routed_inputs(5, 128, module.num_experts, 2, seed=1)
    with torch.no_grad():
        got = module(x, index, weights)
    want = _simulated(module, x, index, weights)
    assert ((got.double() - want).norm() / want.norm()).item() < 1e-2
    # fp8 activations through two random layers (attention's too), routing flips included: 17-33% here
    assert torch.isfinite(out).all() and ((out - ref).norm() / ref.norm()).item() < 0.5


def test_weights_changed_since_loading_are_left_with_the_reason(checkpoints):
    model = _load(checkpoints["qwen3_moe"])
    with torch.no_grad():
        model.model.layers[1].mlp.experts.down_proj[3, 5, 7] += 1.0
    report = fusepass.prepare(model)
    assert list(report.experts) == ["model.layers.0.mlp.experts"]
    assert report.experts_left == {"model.layers.1.mlp.experts": (
        "its weights are not the checkpoint's values times their scales (changed since loading?): prepare keeps the "
        "checkpoint's values, and would undo the change")}
    assert type(model.model.layers[1].mlp.experts).__name__ == "Qwen3MoeExperts"


def test_a_checkpoint_no_longer_on_disk_is_left_with_the_reason(checkpoints, tmp_path):
    path = tmp_path / "moved"
    shutil.copytree(checkpoints["olmoe"], path)
    model = _load(path)
    shutil.rmtree(path)
    report = fusepass.prepare(model)
    assert not report.experts and set(report.experts_left) == {f"model.layers.{i}.mlp.experts" for i in range(2)}
    assert all(why.startswith("its checkpoint's files are not on this machine") for why in report.experts_left.values())


def test_save_pretrained_of_converted_experts_is_refused(checkpoints, tmp_path):
    model = _load(checkpoints["mixtral"])
    fusepass.prepare(model)
    with pytest.raises(NotImplementedError, match="no checkpoint format holds W8A8Experts yet"):
        model.save_pretrained(tmp_path / "out")


def test_a_bf16_moe_model_has_no_experts_to_read():
    report = fusepass.prepare(moe_model("qwen3_moe"))
    assert not report.experts and not report.experts_left and "experts" not in str(report)


# transformers' native FP8 MoE checkpoints (Qwen3-30B-A3B-FP8's format: FP8Experts, 128x128 blocks):
# the tiny model saved in bf16, loaded with FineGrainedFP8Config (transformers quantizes it), saved
# again, loaded back; on a CPU the FP8 quantizer's GPU gate is skipped, in these tests only
# (tests/support/fp8_checkpoints.py).


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    """arch -> (the native FP8 checkpoint, the bf16 model's directory)."""
    paths = {}
    for arch in ARCHS:
        root = tmp_path_factory.mktemp(f"native-{arch}")
        moe_model(arch, blocks=True).save_pretrained(root / "bf16")
        _quantized_by_transformers(root / "bf16").save_pretrained(root / "fp8")
        paths[arch] = root / "fp8", root / "bf16"
    return paths


def _quantized_by_transformers(path):
    from transformers import FineGrainedFP8Config

    from tests.support.fp8_checkpoints import gpu_gate_skipped

    with gpu_gate_skipped():
        return _load(path, quantization_config=FineGrainedFP8Config(weight_block_size=(128, 128)))


def _stored_native(path, arch, name):
    """A native FP8 checkpoint's experts at ``name`` as its file holds them: each expert's fp8
    linears apart (stacked here, gate then up), the scales per 128x128 block of all of them or of
    each (under the checkpoint's own names: Mixtral's ``block_sparse_moe.experts.<e>.w1``)."""
    _, gate, up, down = NAMES[arch]
    layer = name.split(".layers.")[1].split(".")[0]
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        keys = [k for k in f.keys() if f".layers.{layer}." in k and ".experts." in k]
        prefix = keys[0].split(".experts.")[0] + ".experts"
        E = len({k.split(".experts.")[1].split(".")[0] for k in keys if "_scale" not in k})

        def stack(proj, what="weight"):
            return torch.stack([f.get_tensor(f"{prefix}.{e}.{proj}.{what}") for e in range(E)])

        def scales(projs, stacked):  # transformers 5.24 writes them stacked, 5.17 per expert
            if stacked in keys:
                return f.get_tensor(stacked)
            return torch.cat([stack(p, "weight_scale_inv") for p in projs], 1)

        return (torch.cat([stack(gate), stack(up)], 1), scales((gate, up), f"{prefix}.gate_up_proj_scale_inv"),
                stack(down), scales((down,), f"{prefix}.down_proj_scale_inv"))


def _load_native(path):
    from tests.support.fp8_checkpoints import gpu_gate_skipped

    with gpu_gate_skipped():
        return _load(path)


@pytest.mark.parametrize("arch", ARCHS)
def test_native_fp8_experts_run_their_values(arch, native):
    model = _load_native(native[arch][0])
    names = [f"model.layers.{i}.mlp.experts" for i in range(2)]
    assert all(type(model.get_submodule(n)).__name__ == "FP8Experts" for n in names)
    report = fusepass.prepare(model)
    assert report.experts == {n: "experts fp8-block" for n in names} and not report.experts_left
    assert len(report.converted) == 8 and not report.left
    for name in names:
        module = model.get_submodule(name)
        assert isinstance(module, W8A8Experts) and module.act.kind == "fp8-block"
        for got, want in zip((module.gate_up, module.gate_up_scale, module.down, module.down_scale),
                             _stored_native(native[arch][0], arch, name)):
            assert got.dtype == want.dtype and torch.equal(got, want)  # the checkpoint's, bit for bit
    x, index, weights = _routed_inputs(5, 256, module.num_experts, 2, seed=2)
    with torch.no_grad():
        got = module(x, index, weights)
    want = _simulated(module, x, index, weights)
    assert ((got.double() - want).norm() / want.norm()).item() < 1e-2
    ids = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # (transformers' own forward needs a downloaded kernel: the bf16 model is the reference)
        out, ref = model(ids).logits.float(), _load(native[arch][1])(ids).logits.float()
    # fp8 block weights and activations through two random layers, routing flips included: 12-35% here
    assert torch.isfinite(out).all() and ((out - ref).norm() / ref.norm()).item() < 0.5


def test_native_fp8_experts_in_part_bf16_are_left_with_the_reason(tmp_path):
    # Qwen3-MoE with experts 64 wide: transformers 5.24 leaves down_proj (K = 64) in bf16
    moe_model("qwen3_moe").save_pretrained(tmp_path)
    model = _quantized_by_transformers(tmp_path)
    report = fusepass.prepare(model)
    assert not report.experts and set(report.experts_left) == {f"model.layers.{i}.mlp.experts" for i in range(2)}
    if model.model.layers[0].mlp.experts.down_proj.dtype == torch.bfloat16:  # (transformers 5.24; 5.17 quantizes it)
        assert report.experts_left["model.layers.0.mlp.experts"] == (
            "FP8Experts down_proj of torch.bfloat16: float8_e4m3fn weights only")
    else:
        assert report.experts_left["model.layers.0.mlp.experts"] == (
            "FP8Experts of hidden size 128 and width 64: whole 128x128 blocks only (multiples of 128)")


def test_native_fp8_experts_with_other_scales_are_left_with_the_reason(native):
    model = _load_native(native["mixtral"][0])
    experts = model.model.layers[1].mlp.experts
    experts.down_proj_scale_inv = torch.nn.Parameter(experts.down_proj_scale_inv.data[:, :1], requires_grad=False)
    model.model.layers[0].mlp.experts.activation_scheme = "static"
    report = fusepass.prepare(model)
    assert report.experts_left == {
        "model.layers.0.mlp.experts": "FP8Experts with activation_scheme='static': W8A8Experts runs gated experts "
                                      "with dynamic activations and 128x128 block scales, act(gate) * up",
        "model.layers.1.mlp.experts": "FP8Experts scales of torch.float32 (8, 1, 2) for a (8, 256, 256) weight: fp32, "
                                      "one per 128x128 block ([8, 2, 2]) only"}


def test_native_fp8_experts_of_a_ragged_width_are_left_with_the_reason():
    from torch import nn
    from transformers import Qwen3MoeConfig
    from transformers.integrations.finegrained_fp8 import FP8Experts

    config = Qwen3MoeConfig(hidden_size=256, moe_intermediate_size=192, num_experts=4, num_experts_per_tok=2)
    holder = nn.Module()
    holder.experts = FP8Experts(config, block_size=(128, 128))  # (as transformers builds it for such a checkpoint)
    report = fusepass.prepare(holder)
    assert report.experts_left == {"experts": "FP8Experts of hidden size 256 and width 192: whole 128x128 blocks only "
                                              "(multiples of 128)"}


def test_a_sharded_checkpoint_is_read_through_its_index(checkpoints, tmp_path):
    # (the hub's MoE checkpoints come in shards: model-0000i-of-0000n.safetensors and an index)
    import json

    from safetensors.torch import save_file

    path = tmp_path / "sharded"
    shutil.copytree(checkpoints["olmoe"], path)
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    (path / "model.safetensors").unlink()
    keys = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
    for name, part in shards.items():
        save_file({k: tensors[k] for k in part}, str(path / name), metadata={"format": "pt"})
    (path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: name for name, part in shards.items() for k in part}}))
    model = _load(path)
    report = fusepass.prepare(model)
    assert report.experts == {f"model.layers.{i}.mlp.experts": "experts fp8" for i in range(2)}, report
    module = model.model.layers[1].mlp.experts
    for got, want in zip((module.gate_up, module.gate_up_scale, module.down, module.down_scale),
                         _stored(checkpoints["olmoe"], "olmoe", 1)):
        assert torch.equal(got, want)
