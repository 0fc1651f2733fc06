"""Few-shot probe solve: vitray's closed form vs scikit-learn's Ridge on the same problem.

ImageNet-sized few-shot problem: 1000 classes x 25 shots x 768 features (ViT-B width), seeded
synthetic features with class structure (class centre + noise) and 10 test images per class.
Both sides fit the same whitened, bias-augmented ridge regression onto {-1, 1} targets with
l2 = 2**10 (sklearn: `Ridge(alpha=l2, fit_intercept=False)`, timed on already-whitened inputs, which
favours it slightly); the script checks that the test predictions are identical and prints both
times. The LAST line is the speed ratio sklearn time / vitray time (fit + predict each).

    python benchmarks/fewshot.py [--classes 1000 --shots 25 --dim 768 --repeats 5]
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
from sklearn.linear_model import Ridge

from vitray.evaluation.fewshot import BIAS_CONSTANT, DEFAULT_L2_REG, predict, solve_lsr


def make_problem(classes: int, shots: int, dim: int, test_per_class: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(classes, dim)).astype(np.float32)
    train_y = np.repeat(np.arange(classes), shots)
    test_y = np.repeat(np.arange(classes), test_per_class)
    # Noise 5x the centres' scale: a hard problem (test accuracy ~0.5), so near-ties in the scores
    # are common and identical predictions really mean identical solutions.
    train_x = centres[train_y] + 5.0 * rng.normal(size=(len(train_y), dim)).astype(np.float32)
    test_x = centres[test_y] + 5.0 * rng.normal(size=(len(test_y), dim)).astype(np.float32)
    return train_x, train_y, test_x, test_y


def vitray_solve(train_x, train_y, test_x, classes):
    started = time.perf_counter()
    solution = solve_lsr(train_x, train_y, classes, DEFAULT_L2_REG)
    solved = time.perf_counter()
    predictions = predict(solution, test_x)
    return predictions, solved - started, time.perf_counter() - solved


def sklearn_solve(train_x, train_y, test_x, classes):
    # The same problem, built the textbook way: whiten, append the bias feature, {-1, 1} targets.
    mean = train_x.mean(axis=0, dtype=np.float64)
    std = train_x.std(axis=0, dtype=np.float64) + 1e-5

    def design(x):
        return np.hstack([(x - mean) / std, np.full((len(x), 1), BIAS_CONSTANT)])

    train_design, test_design = design(train_x), design(test_x)
    targets = 2.0 * np.eye(classes)[train_y] - 1.0
    ridge = Ridge(alpha=DEFAULT_L2_REG, fit_intercept=False)
    started = time.perf_counter()
    ridge.fit(train_design, targets)
    fitted = time.perf_counter()
    predictions = np.argmax(ridge.predict(test_design), axis=1)
    return predictions, fitted - started, time.perf_counter() - fitted


def fastest(runs):
    """The run with the smallest total time; a run is (predictions, fit s, predict s)."""
    return min(runs, key=lambda run: run[1] + run[2])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--classes", type=int, default=1000)
    parser.add_argument("--shots", type=int, default=25)
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--test-per-class", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    train_x, train_y, test_x, test_y = make_problem(args.classes, args.shots, args.dim, args.test_per_class)
    print(
        f"problem: {args.classes} classes x {args.shots} shots = {len(train_y)} train, {args.dim} features, "
        f"{len(test_y)} test; l2 = {DEFAULT_L2_REG:g}; best of {args.repeats}"
    )

    # Interleaved repeats, best of each: load changes on a shared machine hit both sides alike.
    vitray_runs, sklearn_runs = [], []
    for _ in range(args.repeats):
        vitray_runs.append(vitray_solve(train_x, train_y, test_x, args.classes))
        sklearn_runs.append(sklearn_solve(train_x, train_y, test_x, args.classes))
    vitray_pred, vitray_fit, vitray_predict = fastest(vitray_runs)
    sklearn_pred, sklearn_fit, sklearn_predict = fastest(sklearn_runs)
    vitray_time, sklearn_time = vitray_fit + vitray_predict, sklearn_fit + sklearn_predict

    agree = float(np.mean(vitray_pred == sklearn_pred))
    print(
        f"vitray  solve_lsr {vitray_fit:.3f} s + predict {vitray_predict:.3f} s = {vitray_time:.3f} s  "
        f"(test accuracy {np.mean(vitray_pred == test_y):.4f})"
    )
    print(
        f"sklearn Ridge.fit {sklearn_fit:.3f} s + predict {sklearn_predict:.3f} s = {sklearn_time:.3f} s  "
        f"(test accuracy {np.mean(sklearn_pred == test_y):.4f}; whitening not timed)"
    )
    print(f"identical predictions: {agree:.6f} of {len(test_y)} test images")
    if agree != 1.0:
        print("ERROR: vitray and sklearn predictions differ", file=sys.stderr)
        return 1
    print(f"speed ratio (sklearn / vitray): {sklearn_time / vitray_time:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
