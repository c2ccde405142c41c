"""Evaluation of the multivariate detector on a labelled dataset (the ASD protocol).

The dataset is an ``.npz`` with ``<series>_train`` [T, D], ``<series>_test`` [T, D] and
``<series>_test_label`` [T] arrays. For each series the detector is fitted on train only
and its 0/1 flags on test are scored point-wise (no point adjustment); the point-adjusted
F1 is computed beside it for comparison only, because it inflates scores. Beside the F1 of
the detector's own threshold stands the *oracle* F1 of the same scores (the best threshold
chosen on the test labels): the gap between the two is what is lost in thresholding.

Attribution: with interpretation labels (``<labels>/<series>.txt``, one
``start-end:dim,dim,...`` line per anomaly segment, rows inclusive, dims 1-based), the
detector's per-metric ranking at each anomalous point it flagged is scored with the
dataset authors' HitRate@P%: the share of the blamed metrics among the top
``floor(P% x their count)`` of the ranking, averaged over those points.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from bulkhead.agent.detect.multivariate import Run

HIT_RATE_LEVELS = (1.0, 1.5)  # HitRate@100% and @150%


class Detector(Protocol):
    def fit(self, train: np.ndarray) -> Detector: ...
    def run(self, test: np.ndarray) -> Run: ...


@dataclass(frozen=True)
class Segment:
    start: int  # first test row
    end: int  # last test row (inclusive)
    metrics: tuple[int, ...]  # 0-based metric indices the experts blamed


@dataclass(frozen=True)
class Scores:
    precision: float
    recall: float
    f1: float
    f1_point_adjusted: float
    f1_oracle: float  # the same scores with the best threshold on the test labels
    hit_rate_100: float | None = None  # None: no interpretation labels or no point found
    hit_rate_150: float | None = None


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


def oracle_f1(scores: np.ndarray, labels: np.ndarray) -> float:
    """The best point-wise F1 of ``scores > t`` over every threshold t (exact)."""
    labels = np.asarray(labels).astype(bool)
    positives = int(labels.sum())
    if positives == 0:
        return 0.0
    order = np.argsort(-np.asarray(scores, dtype=np.float64), kind="stable")
    ranked = np.asarray(scores, dtype=np.float64)[order]
    tp = np.cumsum(labels[order])
    flagged = np.arange(1, len(ranked) + 1)
    # Only cut between distinct scores: tied points are flagged together.
    last_of_tie = np.append(ranked[1:] != ranked[:-1], True)
    f1 = 2 * tp / (flagged + positives)
    return float(f1[last_of_tie].max())


def point_adjust(flags: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Flags with every labelled segment that has one flagged point marked entirely."""
    out = np.asarray(flags).astype(bool).copy()
    labels = np.asarray(labels).astype(bool)
    edges = np.diff(np.concatenate([[0], labels.astype(np.int8), [0]]))
    for start, end in zip(np.flatnonzero(edges == 1), np.flatnonzero(edges == -1), strict=True):
        if out[start:end].any():
            out[start:end] = True
    return out


def read_segments(path: Path) -> list[Segment]:
    """Interpretation labels: ``start-end:dim,dim,...`` per line (rows inclusive, dims 1-based)."""
    segments: list[Segment] = []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rows, dims = line.split(":")
            start, end = (int(v) for v in rows.split("-"))
            metrics = tuple(int(d) - 1 for d in dims.split(","))
        except ValueError as exc:
            raise ValueError(
                f"{path}:{number}: expected 'start-end:dim,dim,...', got {line!r}"
            ) from exc
        if end < start or min(metrics) < 0:
            raise ValueError(f"{path}:{number}: bad segment {line!r}")
        segments.append(Segment(start, end, metrics))
    return segments


def hit_rates(
    contributions: np.ndarray, flags: np.ndarray, segments: list[Segment]
) -> tuple[float | None, ...]:
    """HitRate@P% for each P in ``HIT_RATE_LEVELS`` over the flagged labelled points."""
    hits: list[list[float]] = [[] for _ in HIT_RATE_LEVELS]
    for seg in segments:
        blamed = set(seg.metrics)
        for row in range(seg.start, min(seg.end + 1, len(flags))):
            if not flags[row]:
                continue
            ranking = np.argsort(-contributions[row], kind="stable")
            for i, level in enumerate(HIT_RATE_LEVELS):
                top = ranking[: int(np.floor(level * len(blamed)))]
                hits[i].append(len(blamed.intersection(top.tolist())) / len(blamed))
    return tuple(float(np.mean(h)) if h else None for h in hits)


def score(run: Run, labels: np.ndarray, segments: list[Segment] | None = None) -> Scores:
    precision, recall, f1 = prf(run.flags, labels)
    f1_pa = prf(point_adjust(run.flags, labels), labels)[2]
    rates = hit_rates(run.contributions, run.flags, segments) if segments else (None, None)
    return Scores(precision, recall, f1, f1_pa, oracle_f1(run.scores, labels), *rates)


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


def default_labels(path: Path) -> Path | None:
    """``interpretation_label/`` next to the dataset, if it is there."""
    candidate = Path(path).parent / "interpretation_label"
    return candidate if candidate.is_dir() else None


def evaluate(
    path: Path,
    make_detector: Callable[[], Detector],
    only: list[str] | None = None,
    labels: Path | None = None,
    progress: Callable[[str, Scores], None] | None = None,
) -> dict[str, Scores]:
    """Fit a fresh detector per series on train, score its test run; keyed by series.

    ``labels`` is a folder of interpretation labels (``<series>.txt``); a series without a
    file there gets no hit rates.
    """
    if not Path(path).is_file():
        raise FileNotFoundError(f"dataset not found: {path}")
    if labels is not None and not Path(labels).is_dir():
        raise FileNotFoundError(f"interpretation labels folder not found: {labels}")
    with np.load(path) as data:
        names = series_names(data)
        if only:
            unknown = sorted(set(only) - set(names))
            if unknown:
                raise ValueError(f"unknown series {unknown}; the dataset has {names}")
            names = [n for n in names if n in only]
        results: dict[str, Scores] = {}
        for name in names:
            label_file = Path(labels) / f"{name}.txt" if labels is not None else None
            segments = read_segments(label_file) if label_file and label_file.is_file() else None
            detector = make_detector().fit(data[f"{name}_train"])
            run = detector.run(data[f"{name}_test"])
            results[name] = score(run, data[f"{name}_test_label"], segments)
            if progress is not None:
                progress(name, results[name])
    return results


def _mean(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return float(np.mean(present)) if present else None


def summary(results: dict[str, Scores]) -> dict[str, object]:
    """The ``--json`` form: the means of every measure plus the per-series values."""
    columns = [f for f in Scores.__dataclass_fields__]
    means = {f"mean_{c}": _mean([getattr(s, c) for s in results.values()]) for c in columns}
    return means | {"series": {name: asdict(s) for name, s in results.items()}}
