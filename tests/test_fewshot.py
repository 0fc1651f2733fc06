"""The few-shot linear probe against independent solvers, the sampling protocol, l2 selection,
a real accuracy check on scikit-learn's digits, and feature extraction from a torch model."""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from sklearn.datasets import load_digits
from sklearn.linear_model import Ridge

from vitray.evaluation.fewshot import (
    DEFAULT_L2_REG,
    L2_GRID,
    _NormalEquations,
    extract_features,
    fewshot_accuracy,
    predict,
    sample_few_shot,
    select_l2,
    solve_lsr,
)


def _problem(num_points: int, dim: int, num_classes: int, seed: int = 0, separation: float = 1.0):
    """Features with class structure (class centre + noise), every class present."""
    rng = np.random.default_rng(seed)
    centres = separation * rng.normal(size=(num_classes, dim))
    labels = np.concatenate([np.arange(num_classes), rng.integers(0, num_classes, num_points - num_classes)])
    features = centres[labels] + rng.normal(size=(num_points, dim)) * rng.uniform(0.5, 3.0, size=dim)
    return features + rng.normal(size=dim) * 5.0, labels  # an offset, so whitening matters


def _whitened_design(train: np.ndarray, x: np.ndarray) -> np.ndarray:
    """The protocol's design matrix, written out independently of the module under test."""
    mean, std = train.mean(axis=0), train.std(axis=0) + 1e-5
    return np.hstack([(x - mean) / std, np.full((len(x), 1), 100.0)])


def _targets(labels: np.ndarray, num_classes: int) -> np.ndarray:
    return 2.0 * np.eye(num_classes)[labels] - 1.0


# ---------------------------------------------------------------------------------------------
# The solve
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_points,dim", [(40, 200), (600, 30)], ids=["dual N<D", "primal N>D"])
@pytest.mark.parametrize("l2", [2.0**-4, DEFAULT_L2_REG, 2.0**16])
def test_solve_matches_sklearn_ridge(num_points, dim, l2):
    num_classes = 7
    train_x, train_y = _problem(num_points, dim, num_classes)
    test_x, _ = _problem(300, dim, num_classes, seed=1)

    solution = solve_lsr(train_x, train_y, num_classes, l2)

    ridge = Ridge(alpha=l2, fit_intercept=False).fit(_whitened_design(train_x, train_x), _targets(train_y, num_classes))
    np.testing.assert_allclose(solution.weights, ridge.coef_.T, rtol=1e-6, atol=1e-9)
    expected = np.argmax(ridge.predict(_whitened_design(train_x, test_x)), axis=1)
    np.testing.assert_array_equal(predict(solution, test_x), expected)


@pytest.mark.parametrize("num_points,dim", [(30, 100), (400, 20)], ids=["dual N<D", "primal N>D"])
def test_solve_matches_augmented_least_squares(num_points, dim):
    """Ridge as plain least squares on [X; sqrt(l2) I] -- an SVD solve, no normal equations."""
    num_classes, l2 = 5, 3.0
    train_x, train_y = _problem(num_points, dim, num_classes, seed=3)
    design = _whitened_design(train_x, train_x)
    stacked = np.vstack([design, np.sqrt(l2) * np.eye(design.shape[1])])
    targets = np.vstack([_targets(train_y, num_classes), np.zeros((design.shape[1], num_classes))])
    reference, *_ = np.linalg.lstsq(stacked, targets, rcond=None)

    solution = solve_lsr(train_x, train_y, num_classes, l2)

    np.testing.assert_allclose(solution.weights, reference, rtol=1e-6, atol=1e-8)
    test_x, _ = _problem(200, dim, num_classes, seed=4)
    np.testing.assert_array_equal(
        predict(solution, test_x), np.argmax(_whitened_design(train_x, test_x) @ reference, axis=1)
    )


@pytest.mark.parametrize("num_points,dim", [(50, 120), (120, 50)])
def test_primal_and_dual_forms_agree(num_points, dim):
    """The push-through identity: both forms give the same weights on the same design matrix."""
    num_classes = 6
    x, y = _problem(num_points, dim, num_classes, seed=5)
    design = _whitened_design(x, x)
    primal = _NormalEquations.build(design, y, num_classes, form="primal")
    dual = _NormalEquations.build(design, y, num_classes, form="dual")
    assert primal.gram.shape == (dim + 1, dim + 1) and dual.gram.shape == (num_points, num_points)
    for l2 in (0.5, DEFAULT_L2_REG):
        np.testing.assert_allclose(primal.solve(l2), dual.solve(l2), rtol=1e-7, atol=1e-10)


def test_solution_carries_train_whitening():
    x, y = _problem(60, 16, 4, seed=6)
    solution = solve_lsr(x, y, 4)
    np.testing.assert_allclose(solution.mean, x.mean(axis=0))
    np.testing.assert_allclose(solution.std, x.std(axis=0) + 1e-5)
    assert solution.weights.shape == (17, 4) and solution.weights.dtype == np.float64

    # Predictions depend on the train set's statistics only: the same per-feature affine map on
    # train and test leaves them unchanged, while moving only the test set changes them.
    test_x, _ = _problem(400, 16, 4, seed=7)
    scale, shift = np.linspace(0.5, 40.0, 16), np.linspace(-30.0, 30.0, 16)
    moved = solve_lsr(x * scale + shift, y, 4)
    np.testing.assert_array_equal(predict(moved, test_x * scale + shift), predict(solution, test_x))
    assert not np.array_equal(predict(solution, test_x * scale + shift), predict(solution, test_x))


def test_float32_input_is_solved_in_float64():
    x, y = _problem(80, 40, 5, seed=8)
    single = solve_lsr(x.astype(np.float32), y, 5)
    double = solve_lsr(x.astype(np.float32).astype(np.float64), y, 5)
    np.testing.assert_array_equal(single.weights, double.weights)


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda x, y: solve_lsr(x, y[:-1], 3), "entries but there are"),
        (lambda x, y: solve_lsr(x, y + 5, 3), r"must lie in \[0, 3\)"),
        (lambda x, y: solve_lsr(np.where(x > 1, np.nan, x), y, 3), "NaN"),
        (lambda x, y: solve_lsr(x, y, 3, l2_reg=0.0), "positive"),
        (lambda x, y: solve_lsr(x[:, 0], y, 3), "2-D"),
        (lambda x, y: solve_lsr(x, y, 1), "num_classes"),
        (lambda x, y: predict(solve_lsr(x, y, 3), x[:, :5]), "fitted on 8"),
        (lambda x, y: fewshot_accuracy(x, y, x, y, num_classes=3, shots=2, l2_reg="auto"), '"select"'),
        (lambda x, y: fewshot_accuracy(x, y, x, y, num_classes=3, shots=2, seeds=[]), "seeds"),
    ],
)
def test_bad_input_errors_name_the_problem(call, message):
    x, y = _problem(30, 8, 3, seed=9)
    with pytest.raises(ValueError, match=message):
        call(x, y)


# ---------------------------------------------------------------------------------------------
# Sampling
# ---------------------------------------------------------------------------------------------


def test_sampling_is_deterministic_per_class_and_nested():
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 10, 2000)

    five = sample_few_shot(labels, 5, seed=3, num_classes=10)
    again = sample_few_shot(labels, 5, seed=3, num_classes=10)
    other = sample_few_shot(labels, 5, seed=4, num_classes=10)
    ten = sample_few_shot(labels, 10, seed=3, num_classes=10)

    np.testing.assert_array_equal(five, again)
    assert not np.array_equal(five, other)
    assert len(set(five.tolist())) == 50
    np.testing.assert_array_equal(labels[five], np.repeat(np.arange(10), 5))  # class-major, 5 each
    # A seed's 5-shot set is the head of its 10-shot set, class by class.
    np.testing.assert_array_equal(ten.reshape(10, 10)[:, :5].ravel(), five)


def test_sampling_follows_the_authors_rng_stream():
    """One default_rng(seed): a permutation of each class's indices, classes in order."""
    labels = np.array([2, 0, 1, 0, 2, 1, 1, 0, 2, 2, 0, 1])
    rng = np.random.default_rng(11)
    expected = np.concatenate([rng.permutation(np.flatnonzero(labels == c))[:2] for c in range(3)])
    np.testing.assert_array_equal(sample_few_shot(labels, 2, seed=11, num_classes=3), expected)


def test_sampling_names_classes_with_too_few_examples():
    labels = np.array([0] * 10 + [1] * 3 + [2] * 10)
    with pytest.raises(ValueError, match=r"5-shot.*class 1: 3") as err:
        sample_few_shot(labels, 5, seed=0, num_classes=4)
    assert "class 3: 0" in str(err.value)  # a class with no example at all is named too
    with pytest.raises(ValueError, match="positive integer"):
        sample_few_shot(labels, 0, seed=0, num_classes=3)


# ---------------------------------------------------------------------------------------------
# l2 selection
# ---------------------------------------------------------------------------------------------


def _nuisance_problem(per_class: int, seed: int):
    """Two classes told apart only by x0 - x1: x1 is a copy of x0's large noise.

    A lightly regularised least-squares probe cancels the noise (near-perfect); heavy
    regularisation drifts toward comparing class means (x0 alone), which the noise swamps.
    """
    rng = np.random.default_rng(seed)
    labels = np.repeat([0, 1], per_class)
    noise = rng.normal(size=len(labels))
    x0 = 0.3 * (2 * labels - 1) + noise
    x1 = noise + 0.01 * rng.normal(size=len(labels))
    extra = rng.normal(size=(len(labels), 3))
    return np.column_stack([x0, x1, extra]), labels


def test_select_l2_finds_the_regime_the_data_needs():
    train_x, train_y = _nuisance_problem(400, seed=0)
    test_x, test_y = _nuisance_problem(500, seed=1)

    idx = sample_few_shot(train_y, 25, seed=0, num_classes=2)
    chosen = select_l2(train_x[idx], train_y[idx], 2)
    assert chosen in L2_GRID and chosen < DEFAULT_L2_REG

    fixed = fewshot_accuracy(train_x, train_y, test_x, test_y, num_classes=2, shots=25, seeds=2)
    selected = fewshot_accuracy(train_x, train_y, test_x, test_y, num_classes=2, shots=25, seeds=2, l2_reg="select")
    assert [s.l2_reg for s in fixed] == [DEFAULT_L2_REG] * 2
    assert all(s.l2_reg < DEFAULT_L2_REG for s in selected)
    assert min(s.accuracy for s in selected) > 0.95
    assert max(s.accuracy for s in fixed) < 0.8


def test_select_l2_ties_go_to_the_protocol_default():
    # Well separated classes: every candidate classifies every held-out point right.
    y = np.repeat(np.arange(3), 20)
    x = 50.0 * np.eye(4)[y] + np.random.default_rng(0).normal(size=(60, 4))
    assert select_l2(x, y, 3) == DEFAULT_L2_REG
    assert select_l2(x, y, 3, grid=(1.0, 4.0, 2.0**15)) == 2.0**15  # closest to 2**10 in log2
    with pytest.raises(ValueError, match="at least 2"):
        select_l2(x[::20], y[::20], 3)  # one example per class
    with pytest.raises(ValueError, match="folds"):
        select_l2(x, y, 3, folds=50)


# ---------------------------------------------------------------------------------------------
# Real data: scikit-learn's handwritten digits, raw pixels as features
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def digits():
    data = load_digits()
    order = np.random.default_rng(0).permutation(len(data.target))
    x, y = data.data[order], data.target[order]
    return x[:1200], y[:1200], x[1200:], y[1200:]


def test_digits_few_shot_accuracy_is_far_above_chance(digits):
    train_x, train_y, test_x, test_y = digits
    ten = fewshot_accuracy(train_x, train_y, test_x, test_y, num_classes=10, shots=10, seeds=3)
    one = fewshot_accuracy(train_x, train_y, test_x, test_y, num_classes=10, shots=1, seeds=3)

    assert [s.seed for s in ten] == [0, 1, 2]
    assert all(s.num_train == 100 and s.num_test == len(test_y) for s in ten)
    # Chance is 0.10; a linear probe on 10 raw-pixel digits per class gets roughly 0.8.
    assert min(s.accuracy for s in ten) > 0.65
    assert np.mean([s.accuracy for s in ten]) > np.mean([s.accuracy for s in one]) > 0.3
    # The accuracy is the fraction of test images whose prediction is right, per seed.
    idx = sample_few_shot(train_y, 10, seed=1, num_classes=10)
    manual = np.mean(predict(solve_lsr(train_x[idx], train_y[idx], 10), test_x) == test_y)
    assert ten[1].accuracy == pytest.approx(manual)


def test_multi_hot_test_labels_score_like_imagenet_real(digits):
    train_x, train_y, test_x, test_y = digits
    multi = np.eye(10)[test_y]
    multi[::2, (test_y[::2] + 1) % 10] = 1  # even rows also accept the next digit
    multi[5] = 0  # an image without labels is left out
    score = fewshot_accuracy(train_x, train_y, test_x, multi, num_classes=10, shots=5, seeds=[7])[0]

    idx = sample_few_shot(train_y, 5, seed=7, num_classes=10)
    pred = predict(solve_lsr(train_x[idx], train_y[idx], 10), test_x)
    keep = np.arange(len(test_y)) != 5
    assert score.num_test == len(test_y) - 1
    assert score.accuracy == pytest.approx(np.mean(multi[np.arange(len(pred)), pred][keep] == 1))
    single = fewshot_accuracy(train_x, train_y, test_x, test_y, num_classes=10, shots=5, seeds=[7])[0]
    assert score.accuracy > single.accuracy


# ---------------------------------------------------------------------------------------------
# Feature extraction
# ---------------------------------------------------------------------------------------------


class _PixelEncoder(torch.nn.Module):
    """A small real encoder with the ViT's `forward_pre_logits` contract (dropout shows the mode)."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(3 * 8 * 8, 16)
        self.drop = torch.nn.Dropout(0.5)
        self.head = torch.nn.Linear(16, 10)

    def forward_pre_logits(self, x):
        assert not torch.is_grad_enabled()
        return self.drop(torch.tanh(self.proj(x.flatten(1))))

    def forward(self, x):
        return self.head(self.forward_pre_logits(x))


@dataclass
class _Batch:
    images: torch.Tensor
    labels: torch.Tensor


def test_extract_features_batches_and_pairs():
    torch.manual_seed(0)
    model = _PixelEncoder().train()
    images = torch.randn(10, 3, 8, 8)
    labels = torch.arange(10) % 4
    batches = [_Batch(images[:4], labels[:4]), (images[4:7], labels[4:7]), _Batch(images[7:], labels[7:])]

    features, got_labels = extract_features(model, batches)

    assert features.dtype == np.float32 and features.shape == (10, 16)
    np.testing.assert_array_equal(got_labels, labels.numpy())
    with torch.no_grad():  # eval mode means dropout off: the features are exactly tanh(proj(x))
        expected = torch.tanh(model.proj(images.flatten(1)))
    np.testing.assert_allclose(features, expected.numpy(), rtol=1e-5, atol=1e-6)
    model.train()
    extract_features(model, [(images, labels)])
    assert model.training, "the caller's train/eval mode is restored"


def test_extract_features_errors():
    with pytest.raises(TypeError, match="neither forward_pre_logits.*nor forward_features"):
        extract_features(torch.nn.Linear(3, 3), [])
    with pytest.raises(ValueError, match="nothing"):
        extract_features(_PixelEncoder(), [])
    with pytest.raises(TypeError, match=r"\.images and \.labels"):
        extract_features(_PixelEncoder(), [torch.zeros(2, 3, 8, 8)])


def test_extract_features_from_a_vitray_vit():
    from vitray.models import create_model

    torch.manual_seed(0)
    model = create_model("Ti/4", num_classes=10, img_size=32)
    images = torch.rand(6, 3, 32, 32) * 2 - 1
    features, labels = extract_features(model, [(images[:3], torch.arange(3)), (images[3:], torch.arange(3, 6))])
    assert features.shape == (6, model.num_features)
    with torch.inference_mode():
        np.testing.assert_allclose(features, model.eval().forward_pre_logits(images).numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(labels, np.arange(6))


def test_extract_features_from_a_timm_model_equal_those_of_the_same_vitray_vit():
    import timm

    from vitray.models import create_model, load_timm_state_dict

    torch.manual_seed(0)
    reference = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=4, depth=2, num_classes=10)
    model = create_model("Ti/4", num_classes=10, img_size=32, depth=2)
    load_timm_state_dict(model, reference.state_dict())
    batches = [(torch.rand(3, 3, 32, 32) * 2 - 1, torch.arange(3))]
    timm_features, _ = extract_features(reference, batches)
    vitray_features, _ = extract_features(model, batches)
    assert timm_features.shape == (3, model.width)
    np.testing.assert_allclose(timm_features, vitray_features, rtol=1e-4, atol=1e-5)


class _PooledPixels(torch.nn.Module):
    """Raw pixels, 4x4-average-pooled: a parameter-free encoder with the ViT's feature contract."""

    def forward_pre_logits(self, x):
        return torch.nn.functional.avg_pool2d(x, 4).flatten(1)


def test_few_shot_on_prepared_digits_through_the_eval_loader(digits_dataset):
    """The real path: `vitray data prepare builtin:digits` shards -> EvalLoader Batches ->
    extract_features -> 10-shot probe."""
    from vitray.data import EvalLoader

    def features(split):
        return extract_features(_PooledPixels(), EvalLoader(str(digits_dataset), split, batch_size=256, img_size=32))

    train_x, train_y = features("train")
    test_x, test_y = features("test")
    assert train_x.shape == (1437, 3 * 8 * 8) and test_x.shape == (360, 192)
    assert np.bincount(train_y).min() >= 25

    scores = fewshot_accuracy(train_x, train_y, test_x, test_y, num_classes=10, shots=10, seeds=3)
    assert min(s.accuracy for s in scores) > 0.7  # chance: 0.1


class _CountingPixels(torch.nn.Module):
    """`_PooledPixels` with what the pre-training probe needs (a parameter, img_size) and a count
    of the images it encodes."""

    img_size = 32

    def __init__(self):
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(1))
        self.encoded = 0

    def forward_pre_logits(self, x):
        self.encoded += len(x)
        return torch.nn.functional.avg_pool2d(x, 4).flatten(1)


def test_probe_encodes_only_the_sampled_train_images_and_matches_the_whole_split_probe(digits_dataset):
    from vitray.data import EvalLoader, read_labels
    from vitray.evaluation.evaluators.fewshot import fewshot_accuracies

    model = _CountingPixels()
    probed = dict(fewshot_accuracies(model, {"digits": str(digits_dataset)}, shots=(1, 5, 10), seeds=2))

    # Reference: every train image encoded, sets drawn from the decoded pool (the former path),
    # with the authors' few-shot pre-processing (squashed square, then the central crop).
    def features(split):
        loader = EvalLoader(str(digits_dataset), split, batch_size=256, img_size=32, resize="square")
        return extract_features(_PooledPixels(), loader)

    (train_x, train_y), (test_x, test_y) = features("train"), features("test")
    for k in (1, 5, 10):
        scores = fewshot_accuracy(train_x, train_y, test_x, test_y, num_classes=10, shots=k, seeds=2)
        assert probed[f"digits_{k}shot"] == pytest.approx(np.mean([s.accuracy for s in scores]), abs=1e-12)

    keys, labels = read_labels(str(digits_dataset), "train")
    np.testing.assert_array_equal(labels, train_y)  # the labels read without decoding are the decoded ones
    assert keys[:2] == ["train_00000000", "train_00000001"]
    union = {int(i) for k in (1, 5, 10) for seed in range(2) for i in sample_few_shot(labels, k, seed, 10)}
    assert model.encoded == len(union) + len(test_y) and len(union) < 200  # not the 1437 train images


def test_the_fewshot_command_prints_each_shots_mean_over_its_seeds(digits_dataset, tmp_path, monkeypatch):
    """`vitray fewshot` end to end, in this process (no Ray): a checkpoint and a data root in, the
    checkpoint's line (whole on an 80-column terminal, however long its path) and one row per
    benchmark and shots out."""
    from pretrain_helpers import make_checkpoint
    from rich.console import Console
    from typer.testing import CliRunner

    from vitray.cli import transfer
    from vitray.cli.main import app

    monkeypatch.setattr(transfer, "table_console", lambda: Console(width=80))  # as on a terminal

    checkpoint = tmp_path / ("a-long-run-name-" * 6) / "checkpoint_2026-01-01_00-00-00.000001"
    make_checkpoint(checkpoint)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "digits").symlink_to(digits_dataset)
    args = ["fewshot", str(checkpoint), "-b", "digits", "--data-root", str(tmp_path / "data")]
    result = CliRunner().invoke(app, [*args, "--shots", "1,5", "--seeds", "2"])
    assert result.exit_code == 0, result.output
    assert f"few-shot linear probe: {checkpoint} (step " in result.output
    rows = [line.split("│")[1:-1] for line in result.output.splitlines() if line.startswith("│ digits")]
    assert [[cell.strip() for cell in row][:2] for row in rows] == [["digits", "1"], ["digits", "5"]]
    for _, _, accuracy, std, seeds, l2 in ([cell.strip() for cell in row] for row in rows):
        assert 0.0 <= float(accuracy) <= 1.0 and float(std) >= 0.0 and seeds == "2" and l2 == "1024"

    # For scripts: the same numbers as JSON on stdout; a missing benchmark is said, and exits 1.
    result = CliRunner().invoke(app, [*args, "-b", "cifar10", "--shots", "1,5", "--seeds", "2", "--format", "json"])
    assert result.exit_code == 1 and "benchmark 'cifar10'" in result.stderr
    answer = json.loads(result.stdout)
    assert (answer["checkpoint"], answer["step"]) == (str(checkpoint), 4)
    assert [(r["benchmark"], r["shots"], r["seeds"]) for r in answer["results"]] == [("digits", 1, 2), ("digits", 5, 2)]
    assert [f"{r['accuracy']:.4f}" for r in answer["results"]] == [[cell.strip() for cell in row][2] for row in rows]
    assert len(answer["problems"]) == 1 and "vitray data prepare cifar10:" in answer["problems"][0]

    # l2_reg=select: the strength chosen for each seed is printed (and a result row of the grid's)
    result = CliRunner().invoke(app, [*args, "--shots", "5", "--seeds", "2", "--l2", "select", "--format", "json"])
    assert result.exit_code == 0, result.output
    (row,) = json.loads(result.stdout)["results"]
    assert len(row["l2_reg"]) == 2 and set(row["l2_reg"]) <= set(L2_GRID), row


def test_a_runs_fewshot_evaluator_reads_the_train_labels_once(digits_dataset, monkeypatch):
    """A training run's probe reads the labels of the whole train split (every sample's bytes) to draw
    its sets: once, at its first evaluation, not again at every one, with the same scores."""
    from vitray.data.config import DataConfig
    from vitray.evaluation.evaluators import Forward, Worker, build_evaluator
    from vitray.evaluation.evaluators.fewshot import FewshotEvalConfig
    from vitray.evaluation.fewshot_probe import FewShotPool

    reads = []
    real_read = FewShotPool.read.__func__
    monkeypatch.setattr(
        FewShotPool, "read", classmethod(lambda cls, *a, **k: reads.append(a[:2]) or real_read(cls, *a, **k))
    )
    config = FewshotEvalConfig(type="fewshot", every=1, datasets={"digits": str(digits_dataset)}, shots=[2, 5])
    worker = Worker(rank=0, world_size=1, img_size=32, data=DataConfig(train=str(digits_dataset), num_workers=0))
    evaluator = build_evaluator(config, worker)
    forward = Forward("cpu", torch.float32, lambda values: values)
    first, second = (dict(evaluator.run(_CountingPixels(), forward)) for _ in range(2))
    assert first == second and set(first) == {"digits_2shot", "digits_5shot"}
    assert reads == [(str(digits_dataset), "train")]


def test_a_live_runs_checkpoint_being_read_is_not_pruned_by_the_run(digits_dataset, tmp_path, monkeypatch):
    """`vitray fewshot RUN` while the run trains: the run writes a newer checkpoint and prunes with
    checkpoint.keep=1 while the probes read the one resolved. That one was deleted under the reader
    ("does not exist: give a checkpoint folder or a run folder"); the reader pins it now, and the
    run's prune leaves it to a later prune, once the reader has let go."""
    from pretrain_helpers import make_checkpoint
    from typer.testing import CliRunner

    from vitray.cli.main import app
    from vitray.evaluation.methods import fewshot as fewshot_method
    from vitray.runfolder import checkpoint_folders as ckpt
    from vitray.runfolder.pins import pinned_checkpoints

    run = tmp_path / "runs" / "live"
    make_checkpoint(run / "checkpoint_2026-01-01_00-00-00.000001")
    (run / "vitray").mkdir()  # a run folder, as a run leaves it
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "digits").symlink_to(digits_dataset)
    read = fewshot_method.run
    pruned: list[list[str]] = []

    def the_run_goes_on_meanwhile(*args, **kwargs):
        if not pruned:
            make_checkpoint(run / "checkpoint_2026-01-01_00-05-00.000001")
            assert pinned_checkpoints(str(run)) == {"checkpoint_2026-01-01_00-00-00.000001"}
            pruned.append(ckpt.prune_checkpoints(str(run), keep=1))
        return read(*args, **kwargs)

    monkeypatch.setattr(fewshot_method, "run", the_run_goes_on_meanwhile)
    args = ["fewshot", str(run), "-b", "digits", "--data-root", str(tmp_path / "data"), "--shots", "1", "--seeds", "1"]
    result = CliRunner().invoke(app, [*args, "--format", "json"])
    assert result.exit_code == 0, result.output
    assert pruned == [[]] and json.loads(result.stdout)["results"][0]["accuracy"] >= 0.0
    assert pinned_checkpoints(str(run)) == set() and not list((run / "vitray" / "pins").iterdir())
    assert ckpt.prune_checkpoints(str(run), keep=1) == [str(run / "checkpoint_2026-01-01_00-00-00.000001")]


def test_each_shots_summary_is_the_mean_and_population_std_of_its_ok_seeds():
    """What `vitray fewshot` prints and the pre-training hook logs per shots value: the seeds'
    accuracies reduced here by hand, a failed seed left out, `select`'s choices kept in seed order."""
    from vitray.evaluation.methods.fewshot import L2_METRIC, METRIC, summarize_scores
    from vitray.evaluation.results import Cell, CellOutcome

    def outcome(shots, seed, accuracy=None, chosen=None, l2="select"):
        cell = Cell("ckpt", "digits", "fewshot", {"shots": shots, "l2_reg": l2}, seed=seed)
        if accuracy is None:
            return CellOutcome(cell, error="RuntimeError: lost")
        metrics = {METRIC: accuracy, **({L2_METRIC: chosen} if chosen is not None else {})}
        return CellOutcome(cell, metrics)

    summaries = summarize_scores(
        [
            outcome(5, 0, 0.50, 64.0),
            outcome(1, 0, 0.25, l2=1024),
            outcome(5, 1, 0.70, 256.0),
            outcome(5, 2),  # failed: not averaged in as a zero
            outcome(5, 3, 0.90, 16.0),
            outcome(1, 1, 0.35, l2=1024),
        ]
    )
    assert list(summaries) == [1, 5]
    one, five = summaries[1], summaries[5]
    assert (one.seeds, one.l2) == (2, (1024.0, 1024.0))
    assert one.mean == pytest.approx(0.30) and one.std == pytest.approx(0.05)  # sqrt(((.05)^2 * 2) / 2)
    assert (five.seeds, five.l2) == (3, (64.0, 256.0, 16.0))
    # mean 0.7; deviations -0.2, 0, 0.2: population variance 0.08 / 3
    assert five.mean == pytest.approx(0.70) and five.std == pytest.approx((0.08 / 3) ** 0.5)
