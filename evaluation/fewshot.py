"""Few-shot linear probe: closed-form regularised least squares on frozen features.

The protocol of the ViT paper (and of big_vision's `fewshot_lsr` evaluator):

1. per seed, sample `shots` training images per class (`numpy.random.default_rng(seed)`, one
   permutation per class in class order, the first `shots` taken -- so a seed's 5-shot set is a
   subset of its 10-shot set);
2. whiten the features with the few-shot train set's mean and std (+1e-5, population std), append
   a constant bias feature of 100 (large, so the bias is almost unregularised);
3. regress onto targets in {-1, 1}^K: `W = (X^T X + l2 I)^-1 X^T Y`, default `l2 = 2**10`;
4. predict `argmax(x W)` and report top-1 accuracy on the full test split.

Everything runs in float64 numpy/scipy on the host; no gradient steps, no sklearn.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import scipy.linalg
import scipy.sparse

BIAS_CONSTANT = 100.0
DEFAULT_L2_REG = 2.0**10
WHITENING_EPS = 1e-5
# Candidates for l2_reg="select": powers of two around the fixed-protocol default 2**10.
L2_GRID: tuple[float, ...] = tuple(2.0**k for k in range(-10, 21, 2))
MAX_SELECTION_FOLDS = 5


@dataclass(frozen=True)
class LsrSolution:
    """A fitted probe: the whitening it was fitted with and the (D+1, C) weights (last row: bias)."""

    weights: np.ndarray
    mean: np.ndarray
    std: np.ndarray
    l2_reg: float

    @property
    def num_classes(self) -> int:
        return self.weights.shape[1]

    @property
    def num_features(self) -> int:
        return self.mean.shape[0]


@dataclass(frozen=True)
class FewShotScore:
    """The outcome of one few-shot run (one seed)."""

    seed: int
    shots: int
    l2_reg: float
    accuracy: float
    num_train: int
    num_test: int


# ---------------------------------------------------------------------------------------------
# The closed-form solve
# ---------------------------------------------------------------------------------------------


def solve_lsr(features: Any, labels: Any, num_classes: int, l2_reg: float = DEFAULT_L2_REG) -> LsrSolution:
    """Fits the whitened, biased ridge regression onto {-1, 1} one-hot targets in closed form.

    Args:
        features: (N, D) array-like of floats (the few-shot train set's representations).
        labels: (N,) integer class ids in ``[0, num_classes)``.
        num_classes: number of classes C (columns of the solution).
        l2_reg: ridge strength (> 0); the bias column is regularised too, as in the paper.

    Returns:
        An :class:`LsrSolution` to pass to :func:`predict`.
    """
    x = _as_features(features, "features")
    y = _as_labels(labels, num_classes, "labels", expected_len=x.shape[0])
    l2 = _check_l2(l2_reg)
    mean, std = _whitening(x)
    design = _whiten_and_bias(x, mean, std)
    system = _NormalEquations.build(design, y, num_classes)
    return LsrSolution(weights=system.solve(l2), mean=mean[0], std=std[0], l2_reg=l2)


def predict(solution: LsrSolution, features: Any) -> np.ndarray:
    """Class ids (N,) int64 predicted by a fitted probe: `argmax(whiten(x) @ W)`."""
    x = _as_features(features, "features")
    if x.shape[1] != solution.num_features:
        raise ValueError(
            f"features have {x.shape[1]} dimensions but the solution was fitted on {solution.num_features}"
        )
    # Fold the whitening and the bias feature into the weights: one product with the raw features,
    # ((x - m) / s) @ W[:-1] + 100 W[-1]  ==  x @ (W[:-1] / s) + (100 W[-1] - (m / s) @ W[:-1]).
    weights, bias_row = solution.weights[:-1], solution.weights[-1]
    scaled = weights / solution.std[:, None]
    offset = BIAS_CONSTANT * bias_row - solution.mean @ scaled
    return np.argmax(x @ scaled + offset, axis=1).astype(np.int64)


class _NormalEquations:
    """`(X^T X + l2 I) W = X^T Y`, kept in whichever form is smaller so several l2 values are cheap.

    With N points in D+1 dimensions the push-through identity
    `(X^T X + l2 I)^-1 X^T = X^T (X X^T + l2 I)^-1` lets us factor a (D+1)-square matrix when
    N >= D+1 ("primal") and an N-square one otherwise ("dual", the usual few-shot case).
    """

    def __init__(self, design: np.ndarray, gram: np.ndarray, rhs: np.ndarray, primal: bool):
        self.design, self.gram, self.rhs, self.primal = design, gram, rhs, primal

    @classmethod
    def build(
        cls,
        design: np.ndarray,
        labels: np.ndarray,
        num_classes: int,
        form: Literal["auto", "primal", "dual"] = "auto",
    ) -> _NormalEquations:
        num_points, dim = design.shape
        if form == "primal" or (form == "auto" and num_points >= dim):
            # X^T Y with Y = 2*onehot - 1 is 2 * (per-class row sums) - (column sums): O(N D), not
            # O(N D C), which is what keeps 1000 classes x 25 shots well under a second.
            onehot = scipy.sparse.csr_matrix(
                (np.ones(num_points), (labels, np.arange(num_points))), shape=(num_classes, num_points)
            )
            class_sums = np.asarray(onehot @ design)
            rhs = (2.0 * class_sums - design.sum(axis=0, keepdims=True)).T
            return cls(design, design.T @ design, rhs, primal=True)
        targets = np.full((num_points, num_classes), -1.0)
        targets[np.arange(num_points), labels] = 1.0
        return cls(design, design @ design.T, targets, primal=False)

    def solve(self, l2_reg: float) -> np.ndarray:
        regularised = self.gram + l2_reg * np.eye(self.gram.shape[0])
        try:
            solved = scipy.linalg.cho_solve(scipy.linalg.cho_factor(regularised), self.rhs)
        except np.linalg.LinAlgError:
            # Positive definite in exact arithmetic; only rounding can break Cholesky (tiny l2 on
            # near-duplicate features). A symmetric indefinite solve still gives the answer.
            solved = scipy.linalg.solve(regularised, self.rhs, assume_a="sym")
        return solved if self.primal else self.design.T @ solved


def _whitening(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return x.mean(axis=0, keepdims=True), x.std(axis=0, keepdims=True) + WHITENING_EPS


def _whiten_and_bias(x: np.ndarray, mean: np.ndarray, std: np.ndarray) -> np.ndarray:
    design = np.empty((x.shape[0], x.shape[1] + 1))
    whitened = design[:, :-1]  # written in place: no temporaries of the (N, D) size
    np.subtract(x, mean, out=whitened)
    np.divide(whitened, std, out=whitened)
    design[:, -1] = BIAS_CONSTANT
    return design


# ---------------------------------------------------------------------------------------------
# Sampling, l2 selection and the per-seed evaluation
# ---------------------------------------------------------------------------------------------


def sample_few_shot(labels: Any, shots: int, seed: int, num_classes: int) -> np.ndarray:
    """Indices of `shots` examples of every class, drawn as the authors do.

    For each class in order 0..C-1 the class's indices are permuted with one
    `numpy.random.default_rng(seed)` stream and the first `shots` kept; the result is
    class-major (all of class 0, then class 1, ...). The same seed gives nested sets for growing
    `shots`. Raises ValueError naming every class with fewer than `shots` examples.
    """
    y = _as_labels(labels, num_classes, "labels")
    if isinstance(shots, bool) or not isinstance(shots, (int, np.integer)) or shots < 1:
        raise ValueError(f"shots must be a positive integer, got {shots!r}")
    counts = np.bincount(y, minlength=num_classes)
    short = np.flatnonzero(counts < shots)
    if short.size:
        listed = ", ".join(f"class {c}: {counts[c]}" for c in short[:10])
        more = f" and {short.size - 10} more" if short.size > 10 else ""
        raise ValueError(
            f"{shots}-shot sampling needs at least {shots} examples of every class; "
            f"{short.size} of {num_classes} classes have fewer ({listed}{more})"
        )
    rng = np.random.default_rng(seed)
    picked = [rng.permutation(np.flatnonzero(y == c))[:shots] for c in range(num_classes)]
    return np.concatenate(picked).astype(np.int64)


def select_l2(
    features: Any,
    labels: Any,
    num_classes: int,
    *,
    grid: Sequence[float] = L2_GRID,
    folds: int | None = None,
) -> float:
    """Chooses l2_reg by per-class k-fold cross-validation inside a few-shot train set.

    Every class's examples are dealt round-robin into `folds` folds (default: min(shots, 5)); each
    fold is held out once while the probe -- whitened on the remaining examples, as the protocol
    does -- is fitted for every l2 in `grid`. The l2 with the most held-out hits wins; ties go to
    the value closest (in log2) to the fixed-protocol default 2**10. Needs >= 2 examples per class.
    """
    x = _as_features(features, "features")
    y = _as_labels(labels, num_classes, "labels", expected_len=x.shape[0])
    candidates = [_check_l2(l2) for l2 in grid]
    if not candidates:
        raise ValueError("grid must hold at least one l2 value")
    counts = np.bincount(y, minlength=num_classes)
    fewest = int(counts.min())
    if fewest < 2:
        raise ValueError(
            f"l2 selection holds out part of the few-shot train set, so every class needs at least 2 "
            f"examples; class {int(counts.argmin())} has {fewest} (use a fixed l2_reg for 1-shot)"
        )
    num_folds = min(fewest, MAX_SELECTION_FOLDS) if folds is None else folds
    if not 2 <= num_folds <= fewest:
        raise ValueError(f"folds must be between 2 and {fewest} (fewest examples in a class), got {folds}")
    fold_of = np.empty(len(y), dtype=np.int64)
    for c in range(num_classes):
        members = np.flatnonzero(y == c)
        fold_of[members] = np.arange(members.size) % num_folds
    hits = np.zeros(len(candidates))
    for fold in range(num_folds):
        held_out = fold_of == fold
        fit_x, fit_y = x[~held_out], y[~held_out]
        mean, std = _whitening(fit_x)
        system = _NormalEquations.build(_whiten_and_bias(fit_x, mean, std), fit_y, num_classes)
        val_design = _whiten_and_bias(x[held_out], mean, std)
        for i, l2 in enumerate(candidates):
            hits[i] += np.sum(np.argmax(val_design @ system.solve(l2), axis=1) == y[held_out])
    distance_to_default = [abs(math.log2(l2) - math.log2(DEFAULT_L2_REG)) for l2 in candidates]
    best = max(range(len(candidates)), key=lambda i: (hits[i], -distance_to_default[i]))
    return candidates[best]


def fewshot_accuracy(
    train_feats: Any,
    train_labels: Any,
    test_feats: Any,
    test_labels: Any,
    *,
    num_classes: int,
    shots: int,
    seeds: Iterable[int] | int = (0, 1, 2),
    l2_reg: float | Literal["select"] = DEFAULT_L2_REG,
) -> list[FewShotScore]:
    """Few-shot top-1 accuracy of a linear probe, one :class:`FewShotScore` per seed.

    The train arrays are the full pool a `shots`-per-class set is sampled from (per seed);
    the test arrays are evaluated in full. `test_labels` may be (N,) class ids or an (N, C)
    multi-hot matrix (ImageNet-ReaL style: a prediction counts when it is any of the image's
    labels; images without labels are left out). `seeds` is an iterable of seeds or a count n
    meaning seeds 0..n-1 (the authors use 3). `l2_reg` is a fixed value or "select" (see
    :func:`select_l2`).
    """
    train_x, train_y, test_x, correct_fn, num_test = _checked_problem(
        train_feats, train_labels, test_feats, test_labels, num_classes, l2_reg
    )
    seed_list = list(range(seeds)) if isinstance(seeds, (int, np.integer)) else [int(s) for s in seeds]
    if not seed_list:
        raise ValueError("seeds is empty: give at least one seed (or a count such as 3)")

    scores = []
    for seed in seed_list:
        idx = sample_few_shot(train_y, shots, seed, num_classes)
        x, y = train_x[idx], train_y[idx]
        scores.append(_score(x, y, test_x, correct_fn, num_test, num_classes, shots, seed, l2_reg))
    return scores


def score_few_shot_set(
    train_feats: Any,
    train_labels: Any,
    test_feats: Any,
    test_labels: Any,
    *,
    num_classes: int,
    shots: int,
    seed: int,
    l2_reg: float | Literal["select"] = DEFAULT_L2_REG,
) -> FewShotScore:
    """Like :func:`fewshot_accuracy` for one seed whose few-shot set is already drawn: the train
    arrays *are* the set (e.g. the :func:`sample_few_shot` picks of a pool whose features were
    extracted for those picks only). `shots` and `seed` are recorded, not used to sample."""
    x, y, test_x, correct_fn, num_test = _checked_problem(
        train_feats, train_labels, test_feats, test_labels, num_classes, l2_reg
    )
    return _score(x, y, test_x, correct_fn, num_test, num_classes, shots, seed, l2_reg)


def _checked_problem(train_feats, train_labels, test_feats, test_labels, num_classes, l2_reg):
    """Validated arrays of a few-shot problem: (train x, train y, test x, scorer, number of test
    images scored)."""
    x = _as_features(train_feats, "train_feats")
    y = _as_labels(train_labels, num_classes, "train_labels", expected_len=x.shape[0])
    test_x = _as_features(test_feats, "test_feats")
    if test_x.shape[1] != x.shape[1]:
        raise ValueError(f"test_feats have {test_x.shape[1]} dimensions, train_feats {x.shape[1]}")
    correct_fn, num_test = _scorer(test_labels, num_classes, test_x.shape[0])
    if isinstance(l2_reg, str) and l2_reg != "select":
        raise ValueError(f'l2_reg must be a positive number or "select", got {l2_reg!r}')
    return x, y, test_x, correct_fn, num_test


def _score(x, y, test_x, correct_fn, num_test, num_classes, shots, seed, l2_reg) -> FewShotScore:
    l2 = select_l2(x, y, num_classes) if l2_reg == "select" else _check_l2(l2_reg)
    predictions = predict(solve_lsr(x, y, num_classes, l2), test_x)
    accuracy = float(np.sum(correct_fn(predictions)) / num_test)
    return FewShotScore(seed, shots, l2, accuracy, num_train=len(y), num_test=num_test)


def _scorer(test_labels: Any, num_classes: int, num_rows: int):
    """(per-row correctness function over predictions, number of scored rows)."""
    labels = np.asarray(test_labels)
    if labels.ndim == 2:
        if labels.shape != (num_rows, num_classes):
            raise ValueError(f"multi-hot test_labels must have shape ({num_rows}, {num_classes}), got {labels.shape}")
        labelled = labels.astype(bool).any(axis=1)
        if not labelled.any():
            raise ValueError("multi-hot test_labels: no test image has any label")
        return (lambda pred: labels[np.arange(num_rows), pred].astype(bool)[labelled]), int(labelled.sum())
    y = _as_labels(labels, num_classes, "test_labels", expected_len=num_rows)
    return (lambda pred: pred == y), num_rows


# ---------------------------------------------------------------------------------------------
# Features from a model
# ---------------------------------------------------------------------------------------------


def _representation_of(model: Any) -> Any:
    """The function from a batch of images to `model`'s pre-logits representations `(B, D)`."""
    if callable(getattr(model, "forward_pre_logits", None)):
        return model.forward_pre_logits  # a vitray ViT: the last block for the class token alone
    if callable(getattr(model, "forward_features", None)) and callable(getattr(model, "forward_head", None)):
        return lambda images: model.forward_head(model.forward_features(images), pre_logits=True)
    raise TypeError(
        f"{type(model).__name__} has neither forward_pre_logits(x) (a vitray ViT) nor forward_features(x) and "
        "forward_head(x, pre_logits=True) (a timm model): pass one of those"
    )


def extract_features(model: Any, batches: Iterable[Any], device: Any = "cpu") -> tuple[np.ndarray, np.ndarray]:
    """Pre-logits representations of every image in `batches`: (features float32 (N, D), labels).

    `model` is a vitray ViT (its `forward_pre_logits`) or a timm model (`forward_head(forward_features(x),
    pre_logits=True)`); it is moved to `device` and put in eval mode for the pass (its train/eval mode
    is restored afterwards). The images are passed as the batches hold them: vitray's loaders give
    [-1, 1], the range of the ViT authors' and timm's original ViT weights. `batches` yields the
    data layer's `Batch` (`.images`, `.labels`) or `(images, labels)` pairs. Labels are returned
    as given (class ids, or multi-hot rows) concatenated in order.
    """
    import torch

    represent = _representation_of(model)
    was_training = model.training
    model.to(device)
    model.eval()
    features, labels = [], []
    try:
        # no_grad, not inference_mode: torch-xla cannot run the model under inference_mode (a training
        # run's probe on a TPU failed at its first evaluation), and it gains a probe nothing measurable.
        with torch.no_grad():
            for i, batch in enumerate(batches):
                images, batch_labels = _unpack_batch(batch, i)
                images = torch.as_tensor(images).to(device=device, dtype=torch.float32)
                features.append(represent(images).float().cpu().numpy())
                batch_labels = batch_labels.cpu().numpy() if torch.is_tensor(batch_labels) else batch_labels
                labels.append(np.asarray(batch_labels))
    finally:
        model.train(was_training)
    if not features:
        raise ValueError("batches yielded nothing: no features to extract")
    return np.concatenate(features).astype(np.float32, copy=False), np.concatenate(labels)


def _unpack_batch(batch: Any, index: int) -> tuple[Any, Any]:
    if hasattr(batch, "images") and hasattr(batch, "labels"):
        return batch.images, batch.labels
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    raise TypeError(
        f"batch {index} is a {type(batch).__name__}; expected an object with .images and .labels "
        "(vitray.data Batch) or an (images, labels) pair"
    )


# ---------------------------------------------------------------------------------------------
# Input checks
# ---------------------------------------------------------------------------------------------


def _as_features(features: Any, name: str) -> np.ndarray:
    x = np.asarray(features, dtype=np.float64)
    if x.ndim != 2 or x.shape[0] == 0 or x.shape[1] == 0:
        raise ValueError(f"{name} must be a non-empty 2-D array (num_examples, dim), got shape {x.shape}")
    if not np.isfinite(x).all():
        raise ValueError(f"{name} contain NaN or infinite values")
    return x


def _as_labels(labels: Any, num_classes: int, name: str, expected_len: int | None = None) -> np.ndarray:
    if isinstance(num_classes, bool) or not isinstance(num_classes, (int, np.integer)) or num_classes < 2:
        raise ValueError(f"num_classes must be an integer >= 2, got {num_classes!r}")
    y = np.asarray(labels)
    if y.ndim != 1:
        raise ValueError(f"{name} must be a 1-D array of class ids, got shape {y.shape}")
    if expected_len is not None and y.shape[0] != expected_len:
        raise ValueError(f"{name} has {y.shape[0]} entries but there are {expected_len} feature rows")
    if y.size and not np.issubdtype(y.dtype, np.integer) and not np.all(np.mod(y, 1) == 0):
        raise ValueError(f"{name} must be integer class ids, got dtype {y.dtype}")
    y = y.astype(np.int64)
    if y.size and (y.min() < 0 or y.max() >= num_classes):
        raise ValueError(f"{name} must lie in [0, {num_classes}), found values {y.min()}..{y.max()}")
    return y


def _check_l2(l2_reg: Any) -> float:
    if isinstance(l2_reg, bool) or not isinstance(l2_reg, (int, float, np.integer, np.floating)):
        raise ValueError(f'l2_reg must be a positive number or "select", got {l2_reg!r}')
    if not (math.isfinite(l2_reg) and l2_reg > 0):
        raise ValueError(f"l2_reg must be positive and finite, got {l2_reg!r}")
    return float(l2_reg)
