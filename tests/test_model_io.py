"""Weight I/O: the original .npz layout, timm interop, safetensors, load_weights, errors."""

from __future__ import annotations

import os
import pickle

import numpy as np
import pytest
import timm
import torch
from safetensors.torch import save_file
from timm.models.vision_transformer import VisionTransformer as TimmVisionTransformer
from timm.models.vision_transformer import _load_weights as timm_load_npz

from vitray.models import (
    create_model,
    load_npz,
    load_safetensors,
    load_timm_state_dict,
    load_weights,
    resample_posemb,
    save_npz,
    save_safetensors,
    to_timm_state_dict,
)
from vitray.models.io_safetensors import read_safetensors_metadata
from vitray.models.whole_file import UnreadableWeights

# These models are tiny: one thread avoids OpenMP contention on a busy 2-core machine.
pytestmark = pytest.mark.usefixtures("single_thread")


def randomized(name: str, seed: int = 0, **kwargs):
    """A model with random values in every parameter (zero heads would hide mistakes)."""
    kwargs.setdefault("num_classes", 10)
    model = create_model(name, **kwargs)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)
    return model.eval()


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key


def timm_vit(model, **kwargs) -> TimmVisionTransformer:
    return TimmVisionTransformer(
        img_size=model.img_size,
        patch_size=model.patch_size,
        embed_dim=model.width,
        depth=model.depth,
        num_heads=model.num_heads,
        mlp_ratio=model.mlp_dim / model.width,
        num_classes=model.num_classes,
        **kwargs,
    ).eval()


IMAGES = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(1))


# -- the .npz layout ---------------------------------------------------------------------------


def test_npz_layout_names_and_shapes(tmp_path):
    model = randomized("Ti/16", img_size=64, representation_size=32)
    save_npz(model, tmp_path / "w.npz")
    with np.load(tmp_path / "w.npz") as file:
        arrays = {key: file[key] for key in file.files}
    block = "Transformer/encoderblock_11/"
    expected_shapes = {
        "embedding/kernel": (16, 16, 3, 192),  # HWIO
        "embedding/bias": (192,),
        "cls": (1, 1, 192),
        "Transformer/posembed_input/pos_embedding": (1, 17, 192),
        f"{block}LayerNorm_0/scale": (192,),
        f"{block}MultiHeadDotProductAttention_1/query/kernel": (192, 3, 64),
        f"{block}MultiHeadDotProductAttention_1/value/bias": (3, 64),
        f"{block}MultiHeadDotProductAttention_1/out/kernel": (3, 64, 192),
        f"{block}LayerNorm_2/bias": (192,),
        f"{block}MlpBlock_3/Dense_0/kernel": (192, 768),
        f"{block}MlpBlock_3/Dense_1/kernel": (768, 192),
        "Transformer/encoder_norm/scale": (192,),
        "pre_logits/kernel": (192, 32),
        "head/kernel": (32, 10),
        "head/bias": (10,),
    }
    for key, shape in expected_shapes.items():
        assert arrays[key].shape == shape, key
    # 4 top-level embedding tensors, 16 per block (q/k/v/out kernels and biases split), 2 norm,
    # 2 pre-logits, 2 head.
    assert len(arrays) == 4 + 12 * 16 + 2 + 2 + 2
    # The query kernel is the first third of the fused qkv projection, transposed to (in, out).
    query = torch.from_numpy(arrays["Transformer/encoderblock_0/MultiHeadDotProductAttention_1/query/kernel"])
    assert torch.equal(query.reshape(192, 192), model.blocks[0].attn.qkv.weight[:192].t())


@pytest.mark.parametrize("kwargs", [{}, {"representation_size": 24}, {"head": "gap"}])
def test_npz_round_trip_is_bit_exact(tmp_path, kwargs):
    model = randomized("Ti/16", img_size=64, **kwargs)
    save_npz(model, tmp_path / "w.npz")
    restored = create_model("Ti/16", num_classes=10, img_size=64, **kwargs)
    load_npz(restored, tmp_path / "w.npz")
    assert_same_weights(model, restored)
    assert torch.equal(restored.eval()(IMAGES), model(IMAGES))


def test_a_weights_file_whose_write_fails_leaves_the_old_one_and_no_part(tmp_path, monkeypatch):
    """save_npz / save_safetensors write beside the file and rename: a failure part-way (a full disk, an
    interrupt) leaves what was there, never a truncated file a later load would take for the model."""
    model = randomized("Ti/16", img_size=64)
    for save, name in ((save_npz, "w.npz"), (save_safetensors, "w.safetensors")):
        target = tmp_path / name
        target.write_bytes(b"the previous weights")
        real_replace = os.replace

        def full_disk(*args):
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(os, "replace", full_disk)
        with pytest.raises(OSError, match="No space left"):
            save(model, target)
        monkeypatch.setattr(os, "replace", real_replace)
        assert target.read_bytes() == b"the previous weights"
        assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # no part left behind
        save(model, target)
        assert target.stat().st_size > 100_000 and (target.stat().st_mode & 0o777) == 0o644


def test_npz_loads_into_timm_with_the_same_logits(tmp_path):
    model = randomized("Ti/16", img_size=64)
    save_npz(model, tmp_path / "w.npz")
    reference = timm_vit(model)
    timm_load_npz(reference, str(tmp_path / "w.npz"))
    logits = model(IMAGES)
    assert logits.std() > 0.05
    torch.testing.assert_close(reference(IMAGES), logits, atol=1e-5, rtol=1e-5)


def test_gap_npz_loads_into_timm_average_pooling_model(tmp_path):
    model = randomized("Ti/16", img_size=64, head="gap")
    save_npz(model, tmp_path / "w.npz")
    reference = timm_vit(model, class_token=False, global_pool="avg", fc_norm=False)
    timm_load_npz(reference, str(tmp_path / "w.npz"))
    torch.testing.assert_close(reference(IMAGES), model(IMAGES), atol=1e-5, rtol=1e-5)


def test_timm_state_dict_both_ways():
    model = randomized("Ti/16", img_size=64)
    reference = timm_vit(model)
    reference.load_state_dict(to_timm_state_dict(model), strict=True)
    torch.testing.assert_close(reference(IMAGES), model(IMAGES), atol=1e-5, rtol=1e-5)
    restored = create_model("Ti/16", num_classes=10, img_size=64)
    load_timm_state_dict(restored, reference.state_dict())
    assert_same_weights(model, restored)


def test_timm_export_refuses_pre_logits():
    model = create_model("Ti/4", num_classes=10, img_size=32, representation_size=16)
    with pytest.raises(ValueError, match="no pre-logits layer.*reset_head"):
        to_timm_state_dict(model)


# -- hybrid --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hybrid_npz(tmp_path_factory):
    model = randomized("R26+S/32", img_size=64)
    path = tmp_path_factory.mktemp("hybrid") / "r26_s32.npz"
    save_npz(model, path)
    return model, path


def test_hybrid_npz_round_trip_and_layout(hybrid_npz):
    model, path = hybrid_npz
    with np.load(path) as file:
        assert file["conv_root/kernel"].shape == (7, 7, 3, 64)
        assert file["gn_root/scale"].shape == (64,)
        assert file["block4/unit1/conv_proj/kernel"].shape == (1, 1, 1024, 2048)
        assert file["block4/unit2/gn3/bias"].shape == (2048,)
        assert "block4/unit2/conv_proj/kernel" not in file.files
        assert file["embedding/kernel"].shape == (1, 1, 2048, 384)
    restored = create_model("R26+S/32", num_classes=10, img_size=64)
    load_npz(restored, path)
    assert_same_weights(model, restored)
    assert torch.equal(restored.eval()(IMAGES), model(IMAGES))


def test_hybrid_npz_loads_into_timm(hybrid_npz):
    model, path = hybrid_npz
    reference = timm.create_model("vit_small_r26_s32_224", pretrained=False, num_classes=10, img_size=64).eval()
    timm_load_npz(reference, str(path))
    # Every tensor lands where timm expects it ...
    ours = to_timm_state_dict(model)
    theirs = reference.state_dict()
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert torch.equal(ours[key], theirs[key]), key
    # ... and the logits agree up to timm's different normalisation epsilons (StdConv 1e-8 on
    # the variance, GroupNorm 1e-5; the authors' code uses 1e-5 on the std and 1e-6).
    torch.testing.assert_close(reference(IMAGES), model(IMAGES), atol=1e-4, rtol=1e-3)
    restored = create_model("R26+S/32", num_classes=10, img_size=64)
    load_timm_state_dict(restored, theirs)
    assert_same_weights(model, restored)


def test_old_hybrid_checkpoint_conventions_are_read(hybrid_npz, tmp_path):
    # Early releases nest everything under opt/target/ and store GroupNorm params as (1, 1, 1, C).
    model, path = hybrid_npz
    with np.load(path) as file:
        arrays = {
            f"opt/target/{key}": file[key].reshape(1, 1, 1, -1) if "/gn" in key or key.startswith("gn") else file[key]
            for key in file.files
        }
    np.savez(tmp_path / "old.npz", **arrays)
    restored = create_model("R26+S/32", num_classes=10, img_size=64)
    load_npz(restored, tmp_path / "old.npz")
    assert_same_weights(model, restored)


# -- resolution changes ------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", [".npz", ".safetensors", ".pt"])
def test_loading_at_a_new_resolution_resamples_the_posemb(tmp_path, suffix):
    model = randomized("Ti/4", img_size=32)  # grid 8
    path = tmp_path / f"w{suffix}"
    {".npz": save_npz, ".safetensors": save_safetensors}.get(suffix, lambda m, p: torch.save(m.state_dict(), p))(
        model, path
    )
    bigger = create_model("Ti/4", num_classes=10, img_size=48)  # grid 12
    load_weights(bigger, path)
    torch.testing.assert_close(bigger.pos_embed.detach(), resample_posemb(model.pos_embed.detach(), 12))
    assert torch.equal(bigger.blocks[3].mlp.fc2.weight, model.blocks[3].mlp.fc2.weight)
    assert bigger.eval()(torch.randn(1, 3, 48, 48)).shape == (1, 10)


# -- safetensors and load_weights -------------------------------------------------------------


def test_safetensors_round_trip_and_metadata(tmp_path):
    model = randomized("Ti/4", img_size=32, head="gap", representation_size=16)
    save_safetensors(model, tmp_path / "w.safetensors")
    metadata = read_safetensors_metadata(tmp_path / "w.safetensors")
    assert metadata == {
        "format": "vitray",
        "name": "Ti/4",
        "depth": "12",
        "img_size": "32",
        "head": "gap",
        "num_classes": "10",
        "representation_size": "16",
    }
    restored = create_model("Ti/4", num_classes=10, img_size=32, head="gap", representation_size=16)
    load_safetensors(restored, tmp_path / "w.safetensors")
    assert_same_weights(model, restored)


def test_load_weights_dispatches_on_suffix_and_name_style(tmp_path):
    model = randomized("Ti/4", img_size=32)
    save_npz(model, tmp_path / "a.npz")
    save_safetensors(model, tmp_path / "b.safetensors")
    torch.save(model.state_dict(), tmp_path / "c.pt")
    torch.save({"state_dict": to_timm_state_dict(model)}, tmp_path / "d.pth")  # timm names, wrapped
    save_file(to_timm_state_dict(model), str(tmp_path / "e.safetensors"))  # timm names
    for name in ("a.npz", "b.safetensors", "c.pt", "d.pth", "e.safetensors"):
        restored = create_model("Ti/4", num_classes=10, img_size=32)
        load_weights(restored, tmp_path / name)
        assert_same_weights(model, restored)


class NotWeights:
    """Anything torch.load(weights_only=True) must refuse to unpickle."""


def test_load_weights_refuses_unsafe_pickles_and_unknown_formats(tmp_path):
    model = create_model("Ti/4", num_classes=10, img_size=32)
    torch.save({"model": model.state_dict(), "extra": NotWeights()}, tmp_path / "unsafe.pt")
    with pytest.raises(UnreadableWeights, match="unsafe.pt is not a torch state dict.*does not unpickle") as refused:
        load_weights(model, tmp_path / "unsafe.pt")
    assert "weights_only" not in str(refused.value) and isinstance(refused.value.__context__, pickle.UnpicklingError)
    torch.save([1, 2, 3], tmp_path / "list.pt")
    with pytest.raises(ValueError, match="does not hold a state dict"):
        load_weights(model, tmp_path / "list.pt")
    (tmp_path / "w.ckpt").write_bytes(b"")
    with pytest.raises(ValueError, match=r"cannot tell the weight format.*\.npz, \.safetensors, \.pt"):
        load_weights(model, tmp_path / "w.ckpt")


def test_a_damaged_or_misnamed_weights_file_is_refused_naming_it(tmp_path):
    """The readers' own errors name neither the file nor the format (BadZipFile, "header too large"),
    and NumPy's and torch's advise loading unsafely: one line naming both instead, no such advice."""
    model = create_model("Ti/4", num_classes=10, img_size=32)
    save_npz(model, tmp_path / "w.npz")
    whole = (tmp_path / "w.npz").read_bytes()
    save_safetensors(model, tmp_path / "w.safetensors")
    files = {
        "page.npz": b"<html>Not found</html>",  # a download that was an error page
        "cut.npz": whole[: len(whole) // 2],
        "npz.safetensors": whole,
        "safetensors.pt": (tmp_path / "w.safetensors").read_bytes(),
    }
    expected = {
        "npz": "a NumPy .npz archive of arrays",
        "safetensors": "a safetensors file",
        "pt": "a torch state dict",
    }
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(UnreadableWeights) as refused:
            load_weights(model, tmp_path / name)
        message = str(refused.value)
        assert message.startswith(f"{tmp_path / name} is not {expected[name.rsplit('.', 1)[1]]}"), message
        assert "damaged, cut short, or of another format" in message and "allow_pickle" not in message
        assert "weights_only" not in message and "\n" not in message


def test_load_weights_refuses_what_it_does_not_read_pointing_to_the_right_call(tmp_path):
    """A run or checkpoint folder, an s3:// URL, a state dict or swapped arguments gave pathlib's,
    torch's or a missing file's error (`No such file or directory: s3://...`)."""
    model = create_model("Ti/4", num_classes=10, img_size=32)
    save_safetensors(model, tmp_path / "w.safetensors")
    for path in (tmp_path, "s3://bucket/runs/mine", "s3://bucket/w.safetensors"):
        with pytest.raises(ValueError, match="reads a weights file on this machine.*vitray.runfolder.load_checkpoint"):
            load_weights(model, path)
    with pytest.raises(TypeError, match="takes a vitray model first"):
        load_weights(tmp_path / "w.safetensors", model)
    with pytest.raises(TypeError, match="path must be a file path, got OrderedDict"):
        load_weights(model, model.state_dict())


# -- mismatches are errors, never partial loads ------------------------------------------------


def saved_npz(tmp_path, name="Ti/4", **kwargs):
    kwargs.setdefault("img_size", 32)
    model = randomized(name, **kwargs)
    path = tmp_path / "w.npz"
    save_npz(model, path)
    return model, path


def test_other_variant_is_named_in_the_error(tmp_path):
    _, path = saved_npz(tmp_path, "S/16", img_size=64)
    target = create_model("Ti/16", num_classes=10, img_size=64)
    with pytest.raises(ValueError, match=r"holds weights of S/16 \(width 384.*but the model is Ti/16 \(width 192"):
        load_npz(target, path)


def test_a_mismatch_names_what_differs_and_the_fix(tmp_path):
    _, path = saved_npz(tmp_path, "S/16", img_size=32, depth=2)
    with pytest.raises(
        ValueError,
        match=r"of S/16 at depth 2 .*: depth 2 vs 12 \(checkpoint vs model\); create the model with depth=2$",
    ):
        load_npz(create_model("S/16", num_classes=10, img_size=32), path)
    with pytest.raises(
        ValueError,
        match=r": depth 2 vs 12, patch_size 16 vs 32 \(checkpoint vs model\); create the model as S/16 with depth=2$",
    ):
        load_npz(create_model("S/32", num_classes=10, img_size=32), path)


def test_a_hybrid_into_a_plain_vit_names_the_resnet_as_the_difference(tmp_path):
    _, path = saved_npz(tmp_path, "R50+Ti/16", img_size=32, depth=1)
    with pytest.raises(
        ValueError,
        match=r": resnet_stages \(3, 4, 9\) vs none \(checkpoint vs model\); create the model as R50\+Ti/16 with depth=1$",
    ):
        load_npz(create_model("Ti/16", num_classes=10, img_size=32, depth=1), path)
    plain = tmp_path / "plain.npz"
    save_npz(create_model("Ti/16", num_classes=10, img_size=32, depth=1), plain)
    with pytest.raises(
        ValueError, match=r": resnet_stages none vs \(3, 4, 9\) \(checkpoint vs model\); create the model as Ti/16"
    ):
        load_npz(create_model("R50+Ti/16", num_classes=10, img_size=32, depth=1), plain)


STEM_ONLY = r"holds a stem-only hybrid \(R\+Ti/16: a ResNet root without stages\), which is not supported"


@pytest.mark.parametrize("target", ["Ti/16", "Ti/8"])
def test_timms_stem_only_hybrid_is_refused_as_such(target):
    # timm's R+ViT-Ti/16: the ResNet's root, then 8x8 patches of its 64 channels
    stem_only = timm.create_model("vit_tiny_r_s16_p8_224", pretrained=False, num_classes=10, img_size=64, depth=1)
    with pytest.raises(ValueError, match=f"^timm state dict {STEM_ONLY}"):
        load_timm_state_dict(create_model(target, num_classes=10, img_size=64, depth=1), stem_only.state_dict())


def test_the_authors_stem_only_hybrid_npz_is_refused_as_such(tmp_path):
    # The authors' layout of R+ViT-Ti/16 (get_r_ti16_config: num_layers=()): conv_root and gn_root, no blockS/unitU
    _, path = saved_npz(tmp_path, "Ti/8", img_size=64, depth=1)
    with np.load(path) as file:
        arrays = {key: file[key] for key in file.files}
    arrays["embedding/kernel"] = np.zeros((8, 8, 64, 192), np.float32)
    arrays["conv_root/kernel"] = np.zeros((7, 7, 3, 64), np.float32)
    arrays["gn_root/scale"], arrays["gn_root/bias"] = np.ones(64, np.float32), np.zeros(64, np.float32)
    np.savez(tmp_path / "r_ti16.npz", **arrays)
    with pytest.raises(ValueError, match=STEM_ONLY):
        load_npz(create_model("Ti/8", num_classes=10, img_size=64, depth=1), tmp_path / "r_ti16.npz")


def test_timm_weights_with_register_tokens_are_refused_saying_why():
    timm_model = timm.create_model("vit_tiny_patch16_224", img_size=32, num_classes=10, reg_tokens=4)
    with pytest.raises(ValueError, match=r"position embedding of 9 tokens.*register tokens"):
        load_timm_state_dict(create_model("Ti/16", num_classes=10, img_size=32), timm_model.state_dict())


def test_other_head_type_is_an_error(tmp_path):
    _, path = saved_npz(tmp_path, head="gap")
    with pytest.raises(ValueError, match="trained with head='gap'.*model uses head='token'"):
        load_npz(create_model("Ti/4", num_classes=10, img_size=32), path)


def test_other_number_of_heads_is_an_error(tmp_path):
    _, path = saved_npz(tmp_path)
    with np.load(path) as file:
        arrays = {key: file[key] for key in file.files}
    for key, value in arrays.items():  # same width, 6 heads of 32 instead of 3 of 64
        if "MultiHeadDotProductAttention_1/" in key and "/out/bias" not in key:
            shape = {3: (192, 6, 32), 2: (6, 32)}[value.ndim] if "/out/" not in key else (6, 32, 192)
            arrays[key] = value.reshape(shape)
    np.savez(tmp_path / "heads.npz", **arrays)
    with pytest.raises(ValueError, match="6 heads.*but the model is Ti/4.*3 heads"):
        load_npz(create_model("Ti/4", num_classes=10, img_size=32), tmp_path / "heads.npz")


def test_other_num_classes_needs_load_head_false(tmp_path):
    source, path = saved_npz(tmp_path)
    target = create_model("Ti/4", num_classes=3, img_size=32)
    with pytest.raises(ValueError, match=r"head\.weight: checkpoint \(10, 192\) vs model \(3, 192\).*load_head=False"):
        load_npz(target, path)
    assert torch.count_nonzero(target.blocks[0].mlp.fc1.bias.abs() > 1e-4) == 0  # nothing was loaded
    load_npz(target, path, load_head=False)
    assert torch.equal(target.blocks[0].mlp.fc1.weight, source.blocks[0].mlp.fc1.weight)
    assert torch.count_nonzero(target.head.weight) == 0  # the model's own head is kept


def test_pre_logits_mismatch_names_representation_size(tmp_path):
    _, path = saved_npz(tmp_path, representation_size=16)
    with pytest.raises(
        ValueError, match=r"not in the model: \['pre_logits.bias', 'pre_logits.weight'\].*representation_size=16"
    ):
        load_npz(create_model("Ti/4", num_classes=10, img_size=32), path)
    target = create_model("Ti/4", num_classes=10, img_size=32)
    load_npz(target, path, load_head=False)  # the fine-tuning start: drop pre-logits and head
    assert target.pre_logits is None


def test_unknown_and_missing_npz_keys_are_named(tmp_path):
    _, path = saved_npz(tmp_path)
    with np.load(path) as file:
        arrays = {key: file[key] for key in file.files}
    np.savez(tmp_path / "extra.npz", **arrays, **{"Transformer/mystery/kernel": np.zeros(3)})
    with pytest.raises(ValueError, match=r"keys outside the ViT layout: \['Transformer/mystery/kernel'\]"):
        load_npz(create_model("Ti/4", num_classes=10, img_size=32), tmp_path / "extra.npz")
    del arrays["Transformer/encoderblock_3/MlpBlock_3/Dense_1/bias"]
    np.savez(tmp_path / "missing.npz", **arrays)
    with pytest.raises(ValueError, match="missing 'Transformer/encoderblock_3/MlpBlock_3/Dense_1/bias'"):
        load_npz(create_model("Ti/4", num_classes=10, img_size=32), tmp_path / "missing.npz")


def test_state_dict_key_problems_are_named(tmp_path):
    model = randomized("Ti/4", img_size=32)
    state = model.state_dict()
    state["blocks.0.extra"] = torch.zeros(1)
    del state["norm.bias"]
    target = create_model("Ti/4", num_classes=10, img_size=32)
    with pytest.raises(
        ValueError, match=r"missing from the checkpoint: \['norm.bias'\]; not in the model: \['blocks.0.extra'\]"
    ):
        load_timm_state_dict(target, state)
    with pytest.raises(ValueError, match="not a ViT"):
        load_timm_state_dict(target, {"foo": torch.zeros(1)})
