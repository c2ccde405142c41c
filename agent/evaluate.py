"""Evaluation of the multivariate detector on a labelled dataset (the ASD protocol).

The dataset is an ``.npz`` with ``<series>_train`` [T, D], ``<series>_test`` [T, D] and
``<series>_test_label`` [T] arrays. For each series the detector is fitted on train only
and its 0/1 flags on test are scored point-wise (no point adjustment); the point-adjusted
F1 is computed beside it for comparison only, because it inflates scores.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

import numpy as np


class Detector(Protocol):
    def fit(self, train: np.ndarray) -> Detector: ...
    def predict(self, test: np.ndarray) -> np.ndarray: ...


@dataclass(frozen=True)
class Scores:
    precision: float
    recall: float
    f1: float
    f1_point_adjusted: float


def prf(flags: np.ndarray, labels: np.ndarray) -> tuple[float, float, float]:
    """Point-wise precision, recall and F1 (0 when undefined)."""
    flags = np.asarray(flags).astype(bool)
    labels = np.asarray(labels).astype(bool)
    if flags.shape != labels.shape:
        raise ValueError(f"flags {flags.shape} and labels {labels.shape} differ in shape")
    tp = int((flags & labels).sum())
    fp = int((flags & ~labels).sum())
    fn = int((~flags & labels).sum())
    precision = tp / (tp + fp) if tp + fp else 0.0
    recall = tp / (tp + fn) if tp + fn else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return precision, recall, f1


def point_adjust(flags: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Flags with every labelled segment that has one flagged point marked entirely."""
    out = np.asarray(flags).astype(bool).copy()
    labels = np.asarray(labels).astype(bool)
    edges = np.diff(np.concatenate([[0], labels.astype(np.int8), [0]]))
    for start, end in zip(np.flatnonzero(edges == 1), np.flatnonzero(edges == -1), strict=True):
        if out[start:end].any():
            out[start:end] = True
    return out


def score(flags: np.ndarray, labels: np.ndarray) -> Scores:
    precision, recall, f1 = prf(flags, labels)
    f1_pa = prf(point_adjust(flags, labels), labels)[2]
    return Scores(precision, recall, f1, f1_pa)


def series_names(data: np.lib.npyio.NpzFile) -> list[str]:
    """Series in natural order (omi-2 before omi-10)."""
    names = {key[: -len("_train")] for key in data.files if key.endswith("_train")}
    missing = [n for n in names if f"{n}_test" not in data.files or f"{n}_test_label" not in data]
    if missing:
        raise ValueError(f"series without _test or _test_label arrays: {sorted(missing)}")
    if not names:
        raise ValueError("no '<series>_train' arrays in the dataset")

    def natural(name: str) -> tuple[str, int]:
        head, _, tail = name.rpartition("-")
        return (head, int(tail)) if tail.isdigit() else (name, -1)

    return sorted(names, key=natural)


def evaluate(
    path: Path,
    make_detector: Callable[[], Detector],
    only: list[str] | None = None,
) -> dict[str, Scores]:
    """Fit a fresh detector per series on train, score its test flags; keyed by series."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"dataset not found: {path}")
    with np.load(path) as data:
        names = series_names(data)
        if only:
            unknown = sorted(set(only) - set(names))
            if unknown:
                raise ValueError(f"unknown series {unknown}; the dataset has {names}")
            names = [n for n in names if n in only]
        results: dict[str, Scores] = {}
        for name in names:
            detector = make_detector().fit(data[f"{name}_train"])
            flags = detector.predict(data[f"{name}_test"])
            results[name] = score(flags, data[f"{name}_test_label"])
    return results


def summary(results: dict[str, Scores]) -> dict[str, object]:
    """The ``--json`` form: mean F1 (and point-adjusted) plus per-series P/R/F1."""
    return {
        "mean_f1": float(np.mean([s.f1 for s in results.values()])),
        "mean_f1_point_adjusted": float(np.mean([s.f1_point_adjusted for s in results.values()])),
        "series": {
            name: {k: v for k, v in asdict(s).items() if k != "f1_point_adjusted"}
            | {"f1_point_adjusted": s.f1_point_adjusted}
            for name, s in results.items()
        },
    }
