"""The sweeps' results written out: the tradeoff rows as JSON, and plots of rows and batch sizes.

In: :class:`~remat.sweeps.rows.TradeoffRow` rows (with the run's metadata for JSON), or
:class:`~remat.sweeps.sizing.BatchSizeReport` reports, a path and a title. Out: JSON text (:func:`rows_to_json`),
or a PNG written to the path (:func:`plot_rows`: measured peak vs step time; :func:`plot_sizes`: samples per second
by size; both need matplotlib). Used by the command line (``remat tradeoff --json/--plot``, ``remat maxbatch
--plot``) and the benchmarks."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from remat.solve.plan import GiB, fmt_bytes

if TYPE_CHECKING:
    from remat.sweeps.rows import TradeoffRow


def rows_to_json(rows: list[TradeoffRow], meta: dict[str, Any]) -> str:
    return json.dumps({"meta": meta, "rows": [dataclasses.asdict(r) for r in rows]}, indent=2)


def plot_rows(rows: list[TradeoffRow], path: str | Path, title: str) -> None:
    """Measured peak vs measured step time: remat's plans as a curve, hand rules as labelled points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    peaks = [r.measured_peak_bytes for r in rows if r.measured_peak_bytes is not None]
    unit, scale = ("GiB", GiB) if max(peaks, default=0) >= GiB else ("MiB", 2**20)
    curves = [s for s in dict.fromkeys(r.strategy for r in rows) if sum(x.strategy == s for x in rows) > 1]
    for k, name in enumerate(curves):
        pts = sorted((r for r in rows if r.strategy == name and r.measured_peak_bytes is not None),
                     key=lambda r: r.measured_peak_bytes)
        ax.plot([r.measured_peak_bytes / scale for r in pts], [r.measured_step_time_s * 1e3 for r in pts],
                "o-" if name.startswith("remat") else "x--", color=f"C{k}", label=f"{name} (one point per budget)")
        if name == curves[0] and name.startswith("remat"):
            for r in pts:
                ax.axvline(r.budget_bytes / scale, color="C0", alpha=0.12, lw=1)
    singles = [x for x in rows if x.strategy not in curves and x.measured_peak_bytes is not None]
    for k, r in enumerate(singles):
        ax.plot(r.measured_peak_bytes / scale, r.measured_step_time_s * 1e3, "s", color=f"C{k + len(curves)}",
                label=r.strategy)
    ax.set_xlabel(f"measured peak memory of a training step ({unit}; faint lines: budgets)")
    ax.set_ylabel("measured step time (ms)")
    _save(fig, ax, title, path)


def _save(fig, ax, title: str, path: str | Path) -> None:
    import matplotlib.pyplot as plt

    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_sizes(reports: list, path: str | Path, title: str) -> None:
    """Measured samples per second by size, one line per :class:`remat.BatchSizeReport` (remat's plans, hand
    rules), each size's largest-fitting answer marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for k, rep in enumerate(reports):
        pts = [r for r in rep.rows if r.fits and r.measured_samples_per_s is not None]
        ax.plot([r.size for r in pts], [r.measured_samples_per_s for r in pts], "o-", color=f"C{k}",
                label=f"{rep.strategy}: largest {rep.max_size}, fastest {rep.best_size}")
        ax.axvline(rep.max_size, color=f"C{k}", alpha=0.3, lw=1)
    ax.set_xscale("log", base=2)
    ax.set_xlabel(f"{reports[0].dim} size (vertical lines: the largest that fits {fmt_bytes(reports[0].budget_bytes)})")
    ax.set_ylabel("measured samples/s" if reports[0].dim == "batch" else "measured positions/s")
    _save(fig, ax, title, path)
