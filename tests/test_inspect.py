"""Inspection figures (paper section 4.5): the numbers against hand-computed cases, a model whose
attention is forced to the diagonal through its own inspection path, hybrid and GAP models, and
`vitray inspect` on a real pre-trained checkpoint writing every PNG with its numbers file."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image
from sklearn.decomposition import PCA
from typer.testing import CliRunner

from vitray.cli.main import app
from vitray.evaluation.checkpoint_inspection import InspectionInputError, validation_images
from vitray.evaluation.inspection_figures import FIGURES, inspect_model
from vitray.evaluation.inspection_math import (
    attention_rollout,
    attention_statistics,
    mean_attention_distance,
    patch_embedding_pcs,
    posemb_similarity,
)
from vitray.models import create_model
from vitray.runfolder.checkpoint_folders import load_checkpoint

NUMBERS = {
    "patch_embedding_pcs": "patch_embedding_pcs.json",
    "position_embedding_similarity": "position_embedding_similarity.parquet",
    "attention_distance": "attention_distance.json",
    "attention_rollout": "attention_rollout.json",
}


@pytest.fixture(autouse=True)
def _one_thread(single_thread):
    """Tiny models: one torch thread avoids contention on the shared 2-core machine."""


def _with_class_token(patch_attention: torch.Tensor, class_share: float = 0.0) -> torch.Tensor:
    """(B, H, P, P) attention among patches -> (B, H, 1+P, 1+P) with a class token that takes
    `class_share` of every patch query's attention (and attends uniformly itself)."""
    b, h, p, _ = patch_attention.shape
    full = torch.zeros(b, h, p + 1, p + 1, dtype=torch.float64)
    full[:, :, 0, :] = 1.0 / (p + 1)
    full[:, :, 1:, 0] = class_share
    full[:, :, 1:, 1:] = patch_attention * (1 - class_share)
    return full


# ---------------------------------------------------------------------------------------------
# Mean attention distance
# ---------------------------------------------------------------------------------------------


def test_attention_on_the_query_itself_is_distance_zero():
    attention = _with_class_token(torch.eye(9).expand(2, 3, 9, 9))
    assert torch.equal(
        mean_attention_distance(attention, grid_size=3, patch_size=16), torch.zeros(3, dtype=torch.float64)
    )


def test_uniform_attention_on_a_2x2_grid_is_the_mean_patch_distance():
    # 16 (query, key) pairs of a 2x2 grid: 4 at distance 0, 8 at one patch (16 px), 4 at the diagonal.
    expected = (4 * 0 + 8 * 16 + 4 * 16 * math.sqrt(2)) / 16
    attention = torch.full((3, 2, 4, 4), 0.25, dtype=torch.float64)
    np.testing.assert_allclose(mean_attention_distance(attention, 2, 16).numpy(), [expected, expected])
    with_cls = _with_class_token(attention, class_share=0.0)
    np.testing.assert_allclose(mean_attention_distance(with_cls, 2, 16).numpy(), [expected, expected])


def test_class_token_share_is_left_out_and_heads_are_kept_apart():
    # Head 0 looks at the top-left patch, head 1 at the query itself; half of every query's
    # attention goes to the class token, which has no place in the image.
    to_top_left = torch.zeros(4, 4, dtype=torch.float64)
    to_top_left[:, 0] = 1.0
    patch_attention = torch.stack([to_top_left, torch.eye(4, dtype=torch.float64)])[None]
    distance = mean_attention_distance(_with_class_token(patch_attention, class_share=0.5), 2, 8)
    np.testing.assert_allclose(distance.numpy(), [(0 + 8 + 8 + 8 * math.sqrt(2)) / 4, 0.0])


def test_attention_that_does_not_fit_the_grid_is_refused():
    with pytest.raises(ValueError, match="cannot cover a 4x4 patch grid"):
        mean_attention_distance(torch.full((1, 1, 5, 5), 0.2), grid_size=4, patch_size=16)
    with pytest.raises(ValueError, match=r"\(batch, heads, tokens, tokens\)"):
        mean_attention_distance(torch.full((1, 5, 5), 0.2), grid_size=2, patch_size=16)


# ---------------------------------------------------------------------------------------------
# Attention rollout
# ---------------------------------------------------------------------------------------------


def test_rollout_of_identity_attention():
    layers = [torch.eye(5).expand(2, 3, 5, 5)] * 4
    # Every token keeps to itself: the class token never reaches a patch ...
    torch.testing.assert_close(
        attention_rollout(layers, has_class_token=True), torch.zeros(2, 2, 2, dtype=torch.float64)
    )
    # ... and the mean of the 2x2 patch tokens (GAP) covers each patch equally.
    layers = [torch.eye(4).expand(2, 3, 4, 4)] * 4
    torch.testing.assert_close(
        attention_rollout(layers, has_class_token=False), torch.full((2, 2, 2), 0.25, dtype=torch.float64)
    )


def test_rollout_of_uniform_attention():
    # (U + I) / 2 with U = ones/N idempotent: two layers give I/4 + 3U/4, so the class token
    # row reaches each of the N - 1 = 4 patches with 3 / (4 * 5).
    layers = [torch.full((1, 2, 5, 5), 0.2)] * 2
    torch.testing.assert_close(
        attention_rollout(layers, has_class_token=True), torch.full((1, 2, 2), 0.15, dtype=torch.float64)
    )


def test_rollout_averages_heads_adds_the_residual_and_multiplies_in_layer_order():
    # One class token, one patch. Layer 1: heads [[1,0],[0,1]] and [[0,1],[0,1]] -> mean
    # [[.5,.5],[0,1]] -> with residual [[.75,.25],[0,1]]. Layer 2: [[0,1],[1,0]] -> [[.5,.5],[.5,.5]].
    # R = M2 @ M1 = [[.375, .625], ...]: the class token's share of the patch is 0.625 (M1 @ M2 gives 0.5).
    layer1 = torch.tensor([[[1.0, 0.0], [0.0, 1.0]], [[0.0, 1.0], [0.0, 1.0]]])[None]
    layer2 = torch.tensor([[[0.0, 1.0], [1.0, 0.0]]])[None]
    torch.testing.assert_close(
        attention_rollout([layer1, layer2], has_class_token=True), torch.tensor([[[0.625]]], dtype=torch.float64)
    )


def test_rollout_refuses_tokens_that_are_not_a_square_grid():
    with pytest.raises(ValueError, match="not a square grid"):
        attention_rollout([torch.full((1, 1, 5, 5), 0.2)], has_class_token=False)
    with pytest.raises(ValueError, match="at least one layer"):
        attention_rollout([], has_class_token=True)


# ---------------------------------------------------------------------------------------------
# Weights: patch-embedding PCA and position-embedding similarity
# ---------------------------------------------------------------------------------------------


def test_patch_embedding_pcs_match_scikit_learn_pca():
    weight = torch.randn(64, 3, 4, 4, generator=torch.Generator().manual_seed(0))
    components, explained = patch_embedding_pcs(weight, k=10)
    reference = PCA(n_components=10, svd_solver="full").fit(weight.reshape(64, -1).double().numpy())
    assert components.shape == (10, 3, 4, 4)
    flat = components.reshape(10, -1)
    signs = np.sign((flat * reference.components_).sum(axis=1))  # components are defined up to sign
    np.testing.assert_allclose(flat, reference.components_ * signs[:, None], atol=1e-10)
    np.testing.assert_allclose(explained, reference.explained_variance_ratio_, rtol=1e-10)
    assert np.all(np.abs(flat).max(axis=1) == flat[np.arange(10), np.abs(flat).argmax(axis=1)])  # sign rule


def test_patch_embedding_pcs_find_the_one_pattern_filters_vary_along():
    pattern = torch.zeros(3, 2, 2)
    pattern[0, 0, 0], pattern[2, 1, 1] = 3.0, -4.0  # unit norm after / 5
    weight = torch.arange(-8.0, 8.0)[:, None, None, None] * pattern + 7.0  # 16 filters along the pattern
    components, explained = patch_embedding_pcs(weight, k=50)
    assert components.shape == (12, 3, 2, 2)  # capped at min(16 filters, 3 * 2 * 2)
    np.testing.assert_allclose(np.abs(components[0]), np.abs(pattern.numpy()) / 5, atol=1e-12)
    assert explained[0] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="hybrid models embed ResNet features"):
        patch_embedding_pcs(torch.zeros(8, 64, 1, 1), 4)


def test_posemb_similarity_hand_computed():
    posemb = torch.tensor([[[5.0, 5.0], [1.0, 0.0], [0.0, 2.0], [1.0, 1.0], [-3.0, 0.0]]])  # class token first
    similarity = posemb_similarity(posemb, grid=2)
    assert similarity.shape == (2, 2, 2, 2)
    np.testing.assert_allclose([similarity[r, c, r, c] for r in range(2) for c in range(2)], 1.0)
    assert similarity[0, 0, 0, 1] == pytest.approx(0.0)
    assert similarity[0, 0, 1, 0] == pytest.approx(1 / math.sqrt(2))
    assert similarity[0, 0, 1, 1] == pytest.approx(-1.0)
    np.testing.assert_allclose(similarity.reshape(4, 4), similarity.reshape(4, 4).T)
    np.testing.assert_allclose(posemb_similarity(posemb[0, 1:], 2), similarity)  # without a class token
    with pytest.raises(ValueError, match="a 3x3 grid needs 9 patch embeddings"):
        posemb_similarity(posemb, grid=3)


# ---------------------------------------------------------------------------------------------
# A real model on its inspection path
# ---------------------------------------------------------------------------------------------


def _diagonal_attention_model() -> torch.nn.Module:
    """A Ti/4 at 16 px whose every head attends (almost) only to the query token itself.

    The tokens are the position embeddings alone (zero patch embedding), one-hot in every head's
    slice so they differ inside each head; queries = keys = 3 x LayerNorm(token), and the blocks
    add nothing to the residual stream, so every layer sees the same distinct tokens.
    """
    model = create_model("Ti/4", num_classes=10, img_size=16)
    width, heads, head_dim, tokens = model.width, model.num_heads, model.width // model.num_heads, 17
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        for norm in [model.norm, *(b.norm1 for b in model.blocks), *(b.norm2 for b in model.blocks)]:
            norm.weight.fill_(1.0)
        posemb = torch.zeros(1, tokens, width)
        for h in range(heads):
            posemb[0, torch.arange(tokens), h * head_dim + torch.arange(tokens)] = 10.0
        model.pos_embed.copy_(posemb)
        for block in model.blocks:
            block.attn.qkv.weight[: 2 * width] = 3.0 * torch.eye(width).repeat(2, 1)
    return model


def test_a_model_forced_to_diagonal_attention_has_distance_zero_and_a_silent_rollout():
    model = _diagonal_attention_model()
    images = torch.rand(5, 3, 16, 16) * 2 - 1
    _, attentions = model.forward_with_attention(images)
    assert torch.diagonal(attentions[0], dim1=-2, dim2=-1).min() > 1 - 1e-6
    stats = attention_statistics(model, images, batch_size=2)
    assert stats.mean_distance.shape == (12, 3)
    np.testing.assert_allclose(stats.mean_distance, 0.0, atol=1e-6)
    assert stats.rollout.shape == (5, 4, 4)
    np.testing.assert_allclose(stats.rollout, 0.0, atol=1e-6)  # the class token only ever sees itself
    assert stats.num_images == 5 and stats.predictions.shape == (5,)


def test_statistics_average_over_images_whatever_the_batching():
    model = create_model("Ti/4", num_classes=3, img_size=16).eval()
    images = torch.rand(7, 3, 16, 16, generator=torch.Generator().manual_seed(1)) * 2 - 1
    whole = attention_statistics(model, images, batch_size=7)
    pieces = attention_statistics(model, images, batch_size=3)
    np.testing.assert_allclose(pieces.mean_distance, whole.mean_distance, rtol=1e-9)
    np.testing.assert_allclose(pieces.rollout, whole.rollout, rtol=1e-9)
    assert whole.mean_distance.min() > 0 and whole.mean_distance.max() < 16 * math.sqrt(2)


def _random_images(n: int, size: int) -> torch.Tensor:
    return torch.randint(0, 256, (n, 3, size, size), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))


def test_gap_model_rollout_reads_the_mean_patch_token(tmp_path):
    model = create_model("Ti/4", num_classes=3, img_size=16, head="gap")
    files = inspect_model(model, _random_images(3, 16), tmp_path, rollout_images=2)
    assert set(files.figures) == set(FIGURES)
    rollout = json.loads((tmp_path / "attention_rollout.json").read_text())
    assert "GAP head: no class token" in rollout["readout"]
    assert len(rollout["images"]) == 2 and np.array(rollout["images"][0]["rollout"]).shape == (4, 4)
    assert "GAP head" in files.markdown()


def test_hybrid_model_skips_the_filter_pca_with_a_reason(tmp_path):
    model = create_model("R26+Ti/16", num_classes=3, img_size=32)
    files = inspect_model(model, _random_images(2, 32), tmp_path)
    assert "patch_embedding_pcs" not in files.figures and not (tmp_path / "patch_embedding_pcs.png").exists()
    assert "hybrid" in files.skipped["patch_embedding_pcs"]
    assert {"position_embedding_similarity", "attention_distance", "attention_rollout"} <= set(files.figures)
    distance = json.loads((tmp_path / "attention_distance.json").read_text())
    assert distance["patch_size"] == 16 and np.array(distance["mean_distance"]).shape == (12, 3)
    assert json.loads((tmp_path / "inspection.json").read_text())["skipped"] == files.skipped


def test_images_must_be_uint8_at_the_model_resolution(tmp_path):
    model = create_model("Ti/4", num_classes=3, img_size=16)
    with pytest.raises(ValueError, match="model takes"):
        inspect_model(model, _random_images(2, 24), tmp_path)
    with pytest.raises(ValueError, match="uint8"):
        inspect_model(model, torch.rand(2, 3, 16, 16), tmp_path)


# ---------------------------------------------------------------------------------------------
# `vitray inspect` on a real checkpoint
# ---------------------------------------------------------------------------------------------


def _assert_every_figure(out: Path) -> None:
    for name, numbers in NUMBERS.items():
        png = out / f"{name}.png"
        assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
        assert Image.open(png).size[0] > 200
        assert (out / numbers).is_file(), numbers


@pytest.mark.slow
def test_cli_inspects_a_checkpoint_on_its_own_validation_images(pretrained, tmp_path):
    out = tmp_path / "figures"
    result = CliRunner().invoke(app, ["inspect", pretrained, "--out", str(out), "--num-images", "40"])
    assert result.exit_code == 0, result.output
    _assert_every_figure(out)

    model, state = load_checkpoint(pretrained)
    summary = json.loads((out / "inspection.json").read_text())
    assert summary["checkpoint"] == state["checkpoint"] and summary["step"] == 8
    assert "40 images of" in summary["images"] and "split test" in summary["images"]

    pcs = json.loads((out / "patch_embedding_pcs.json").read_text())
    components, explained = patch_embedding_pcs(model.patch_embed.weight, 28)
    assert pcs["num_components"] == 28
    np.testing.assert_allclose(pcs["components"], components)
    np.testing.assert_allclose(pcs["explained_variance_ratio"], explained)

    table = pq.read_table(out / "position_embedding_similarity.parquet")
    assert table.num_rows == 4**4
    json.loads(table.schema.metadata[b"vitray"])  # the metadata is readable JSON

    rows = table.to_pandas()
    same = rows[(rows.query_row == rows.key_row) & (rows.query_col == rows.key_col)]
    np.testing.assert_allclose(same.cosine_similarity, 1.0, rtol=1e-6)
    similarity = posemb_similarity(model.pos_embed, 4)
    np.testing.assert_allclose(rows.cosine_similarity, similarity.ravel(), atol=1e-6)

    distance = json.loads((out / "attention_distance.json").read_text())
    # (blocks, heads): the pre-trained run's Ti/4 of 2 blocks
    assert distance["num_images"] == 40 and np.array(distance["mean_distance"]).shape == (2, 3)
    values = np.array(distance["mean_distance"])
    assert values.min() > 0 and values.max() < 12 * math.sqrt(2)  # 4x4 patches of 4 px

    rollout = json.loads((out / "attention_rollout.json").read_text())
    assert rollout["readout"] == "class token" and len(rollout["images"]) == 8
    assert all(" · " in image["caption"] for image in rollout["images"])  # sample key · class
    maps = np.array([image["rollout"] for image in rollout["images"]])
    assert maps.shape == (8, 4, 4) and maps.min() >= 0 and maps.sum(axis=(1, 2)).max() <= 1 + 1e-9

    # Another checkpoint's figures into the same --out replaced these without a word: refused, unless
    # --overwrite; the same checkpoint again rewrites its own.
    from vitray.runfolder.checkpoint_folders import find_checkpoints

    earlier = next(c.path for c in find_checkpoints(pretrained) if c.step == 4)
    again = ["inspect", "--out", str(out), "--num-images", "8", "--rollout-images", "2"]
    result = CliRunner().invoke(app, [*again[:1], earlier, *again[1:]])
    assert result.exit_code == 2 and "holds the figures of another checkpoint" in result.output, result.output
    assert json.loads((out / "inspection.json").read_text())["step"] == 8
    assert CliRunner().invoke(app, [*again[:1], pretrained, *again[1:]]).exit_code == 0
    result = CliRunner().invoke(app, [*again[:1], earlier, *again[1:], "--overwrite"])
    assert result.exit_code == 0 and json.loads((out / "inspection.json").read_text())["step"] == 4, result.output


@pytest.mark.slow
def test_cli_inspects_given_image_files(pretrained, tmp_path):
    paths = []
    for i, size in enumerate([(30, 20), (9, 9)]):
        path = tmp_path / f"picture{i}.png"
        Image.fromarray(np.random.default_rng(i).integers(0, 255, (*size, 3), dtype=np.uint8)).save(path)
        paths.append(str(path))
    out = tmp_path / "given"
    result = CliRunner().invoke(app, ["inspect", pretrained, *paths, "--out", str(out)])
    assert result.exit_code == 0, result.output
    _assert_every_figure(out)
    rollout = json.loads((out / "attention_rollout.json").read_text())
    assert [image["caption"] for image in rollout["images"]] == ["picture0.png", "picture1.png"]
    assert json.loads((out / "attention_distance.json").read_text())["num_images"] == 2

    missing = CliRunner().invoke(app, ["inspect", pretrained, str(tmp_path / "nope.png"), "--out", str(out)])
    assert missing.exit_code == 2 and "nope.png" in missing.output and "cannot be read" in missing.output
    (tmp_path / "broken.png").write_bytes(b"not an image")
    broken = CliRunner().invoke(app, ["inspect", pretrained, str(tmp_path / "broken.png"), "--out", str(out)])
    assert broken.exit_code == 2 and "not a readable PNG/JPEG image" in broken.output


def test_cli_refuses_a_folder_without_checkpoints(tmp_path):
    result = CliRunner().invoke(app, ["inspect", str(tmp_path), "--out", str(tmp_path / "out")])
    assert result.exit_code == 2 and "neither a checkpoint folder" in result.output


def test_validation_data_that_cannot_be_found_asks_for_images(tmp_path):
    with pytest.raises(InspectionInputError, match="give IMAGES"):
        validation_images({"config": {"data": {"train": str(tmp_path / "gone"), "val_split": "test"}}}, 16, 4)
    with pytest.raises(InspectionInputError, match="names no data.val"):
        validation_images({"config": {}}, 16, 4)


def test_validation_data_on_a_store_the_run_reached_with_its_own_options_is_read(seaweed_s3):
    """A run whose `data.storage_options` held a key records them masked; `vitray inspect RUN` sent the
    mask as the key (403, a traceback). The masked entries are left out: the environment's
    credentials stand in, the other options (the endpoint) are kept."""
    from vitray.common.redact import redact
    from vitray.data import prepare_dataset

    dest = seaweed_s3.url("datasets", "digits")
    prepare_dataset("builtin:digits", dest, samples_per_shard=1000)
    recorded = redact({**seaweed_s3.storage_options, "endpoint_url": seaweed_s3.endpoint_url})
    assert recorded["secret"] == "***" and recorded["endpoint_url"] == seaweed_s3.endpoint_url
    data = {"val": dest, "val_split": "test", "storage_options": recorded}
    images, captions = validation_images({"config": {"data": data}}, 16, 4)
    assert tuple(images.shape) == (4, 3, 16, 16) and len(captions) == 4


@pytest.mark.slow
def test_demo_report_gets_the_inspection_figures(pretrained, tmp_path):
    from vitray.evaluation.checkpoint_inspection import REPORT_FOLDER, add_to_report

    report = tmp_path / "report" / "report.md"
    report.parent.mkdir()
    report.write_text("# vitray evaluation report\n\n## Results\n")
    files = add_to_report(pretrained, report)
    text = report.read_text()
    assert text.startswith("# vitray evaluation report") and "## Model inspection" in text
    links = re.findall(r"\]\(([^)]+)\)", text)
    assert {f"{REPORT_FOLDER}/{name}.png" for name in FIGURES} <= set(links)
    assert all((report.parent / link).is_file() for link in links)
    assert files.out_dir == report.parent / REPORT_FOLDER
