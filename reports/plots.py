"""Report figures (matplotlib, Agg backend). Every function returns a ``Figure`` built from a
:class:`~reports.schema.PrivacyReport` (or a part of it) alone, or ``None`` when the report holds
nothing to draw.

Methods without formal DP (the report's one rule, ``MethodReport.formal_dp``) never disappear from a
chart: they are drawn in a separate band labelled "no formal DP", with the rule's short reason.
Curves that coincide stay visible: each method has its own marker and line style, and a curve
identical to another's says so in the legend.
"""

from __future__ import annotations

import base64
import functools
import io
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TypeGuard

import matplotlib
import numpy as np

matplotlib.use("Agg")  # no display; figures are written to PNG

from matplotlib import pyplot as plt
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from reports.roc_claims import forbidden_roc_points, rocs_of, stored_curve
from reports.schema import DatasetSummary, MethodReport, PrivacyReport

INF_LABEL = "no formal DP\n(epsilon = inf\nat this delta)"
MARKERS = ("o", "s", "^", "v", "D", "P", "X", "*", "<", ">", "h", "p")
LINESTYLES = ("-", "--", "-.", ":")
_DPI = 110


def _finite(x: float | None) -> TypeGuard[float]:
    return x is not None and not math.isnan(x) and not math.isinf(x)


def method_colors(names: Iterable[str]) -> dict[str, tuple]:
    """A stable colour per method (same colour in every figure of a report)."""
    names = list(names)
    if len(names) <= 10:
        cmap = plt.get_cmap("tab10")
        return {n: cmap(i % cmap.N) for i, n in enumerate(names)}
    # tab20 pairs a dark and a light shade of each hue: take every hue's dark shade first, so
    # neighbouring methods (often related baselines) get different hues
    cmap = plt.get_cmap("tab20")
    return {n: cmap((2 * i) % 20 + (2 * i // 20) % 2) for i, n in enumerate(names)}


def _new_figure(width: float, height: float) -> Figure:
    # Figure() directly (not pyplot) so figures are never kept alive by pyplot's registry
    return Figure(figsize=(width, height), dpi=_DPI, layout="constrained")


def figure_to_png(fig: Figure) -> bytes:
    """PNG bytes of ``fig``."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=_DPI)
    return buf.getvalue()


def png_data_uri(png: bytes) -> str:
    """``data:image/png;base64,...`` of PNG bytes (for self-contained HTML)."""
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


# ---------------------------------------------------------------------------------- shared styling
def _style(i: int, n_points: int) -> dict:
    """Marker, line style and drawing order of the i-th curve: a curve drawn over an identical one
    still shows its hollow markers around the other's, offset along the curve."""
    every = max(1, n_points // 12)
    return {
        "marker": MARKERS[i % len(MARKERS)],
        "ls": LINESTYLES[(i + i // len(MARKERS)) % len(LINESTYLES)],  # no (marker, ls) repeats
        "ms": 4 + 2 * (i % 3),
        "mfc": "none",
        "mew": 1.1,
        "zorder": 3 + (i % 5),
        "markevery": (i % every, every),
    }


def _duplicates(series: list[tuple[str, object]]) -> dict[str, str]:
    """Legend suffix " (= first)" for every curve identical to an earlier one."""
    seen: dict[object, str] = {}
    out: dict[str, str] = {}
    for name, key in series:
        if key in seen:
            out[name] = f" (= {seen[key]})"
        else:
            seen[key] = name
    return out


def _dodge(ys: list[float], tol: float, *, start: float, step: float) -> list[float]:
    """x positions in a band: a point within ``tol`` of an earlier one moves ``step`` right."""
    xs: list[float] = []
    for i, y in enumerate(ys):
        xs.append(start + step * sum(1 for y2 in ys[:i] if abs(y2 - y) < tol))
    return xs


def _band_label(m: MethodReport) -> str:
    label = m.formal_dp_label
    return m.name if label in ("", "no", "yes") else f"{m.name} ({label})"


# ---------------------------------------------------------------------------------- privacy-utility
def _spread_labels(ax, items: list[tuple[str, float, float]], gap: float, *, log_x: bool) -> None:
    """Label points without overlap: points at about the same x (within 15 %, or 0.3 on a linear
    axis) form a column whose labels are pushed up to at least ``gap`` apart, with a thin leader
    line from each moved label to its point."""

    def same_column(x0: float, x1: float) -> bool:
        return abs(math.log(x1 / x0)) < 0.14 if log_x else abs(x1 - x0) < 0.3

    columns: list[list[tuple[str, float, float]]] = []
    for item in sorted(items, key=lambda t: t[1]):
        if columns and same_column(columns[-1][0][1], item[1]):
            columns[-1].append(item)
        else:
            columns.append([item])
    for column in columns:
        last = -math.inf
        for name, x, y in sorted(column, key=lambda t: t[2]):
            ty = max(y, last + gap)
            last = ty
            tx = x * 1.12 if log_x else x + 0.15
            moved = ty - y > 1e-9
            ax.annotate(
                name,
                (x, y),
                xytext=(tx, ty),
                textcoords="data",
                fontsize=8,
                va="center",
                arrowprops=dict(arrowstyle="-", lw=0.5, color="grey") if moved else None,
            )


def privacy_utility_figure(report: PrivacyReport) -> Figure | None:
    """Accounted worst-client epsilon (log x) against test accuracy, one point per method.

    Methods with no formal guarantee (epsilon = inf) sit in a separate right-hand band.
    """
    points = [
        (m, m.privacy.epsilon if m.privacy else None, acc)
        for m in report.methods
        if _finite(acc := m.utility.test_accuracy if m.utility else None)
    ]
    if not points:
        return None
    colors = method_colors(m.name for m in report.methods)
    fig = _new_figure(8.0, 4.6)
    grid = fig.add_gridspec(1, 2, width_ratios=[5, 1], wspace=0.02)
    ax = fig.add_subplot(grid[0])
    ax_inf = fig.add_subplot(grid[1], sharey=ax)
    finite = [(m, e, a) for m, e, a in points if m.formal_dp and _finite(e) and e > 0]
    infinite = [(m, e, a) for m, e, a in points if not (m.formal_dp and _finite(e) and e > 0)]
    gap = 0.05 * (max(a for _, _, a in points) - min(a for _, _, a in points) + 0.1)
    for k, (m, e, a) in enumerate(finite):
        # an identical point drawn earlier stays visible as a ring around this one
        ring = sum(1 for m2, e2, a2 in finite[:k] if (e2, a2) == (e, a))
        ax.scatter(
            [e],
            [a],
            s=60 + 90 * ring,
            color=colors[m.name],
            edgecolor="black",
            zorder=3 - 0.1 * ring,
        )
    _spread_labels(ax, [(m.name, e, a) for m, e, a in finite], gap, log_x=True)
    ax.set_xscale("log")
    if finite:
        lo = min(e for _, e, _ in finite)
        hi = max(e for _, e, _ in finite)
        ax.set_xlim(lo / 2.0, hi * 2.0)
    else:
        ax.set_xlim(0.1, 10)
    ax.set_xlabel(
        f"accounted epsilon, worst client (delta = {report.threat_model.delta:g}; log scale)"
    )
    ax.set_ylabel("test accuracy")
    ax.grid(True, which="both", alpha=0.3)
    ax.set_title("What privacy costs: accounted epsilon vs test accuracy")
    band_x = _dodge([a for _, _, a in infinite], gap / 2, start=0.5, step=0.22)
    for (m, _, a), x in zip(infinite, band_x):
        ax_inf.scatter(
            [x], [a], s=70, marker="D", color=colors[m.name], edgecolor="black", zorder=3
        )
    _spread_labels(
        ax_inf, [(_band_label(m), x, a) for (m, _, a), x in zip(infinite, band_x)], gap, log_x=False
    )
    ax_inf.set_xlim(0, 2.2)
    ax_inf.set_xticks([0.5])
    ax_inf.set_xticklabels([INF_LABEL], fontsize=8)
    ax_inf.tick_params(axis="y", labelleft=False)
    ax_inf.set_facecolor("#f3f3f3")
    ax_inf.grid(True, axis="y", alpha=0.3)
    return fig


# ---------------------------------------------------------------------------------- accounted vs empirical
def epsilon_comparison_figure(report: PrivacyReport) -> Figure | None:
    """Per method: accounted epsilon (promise) beside the family-wise empirical lower bound (audit).

    The empirical bound is drawn with its ceiling (the largest bound the number of trials could
    show). A sound accountant has every lower bound left of (or at) its accounted epsilon.
    """
    rows = [m for m in report.methods if m.privacy is not None or m.audit is not None]
    if not rows:
        return None
    fig = _new_figure(8.0, 0.45 * len(rows) + 1.6)
    ax = fig.add_subplot()
    finite_vals = [1.0]
    for m in rows:
        e = m.privacy.epsilon if m.privacy else None
        if _finite(e):
            finite_vals.append(e)
        for v in m.audit_numbers()[:2]:
            if _finite(v):
                finite_vals.append(v)
    right = max(finite_vals) * 3.0
    labelled: set[str] = set()

    def label(text: str) -> str | None:  # each legend entry once, on its first use
        if text in labelled:
            return None
        labelled.add(text)
        return text

    for y, m in enumerate(rows):
        e = m.privacy.epsilon if m.privacy else None
        if _finite(e):
            ax.scatter(
                [e],
                [y],
                marker="s",
                s=55,
                color="#1f77b4",
                zorder=3,
                label=label("accounted epsilon"),
            )
        elif m.privacy is not None:
            label_ = m.formal_dp_label or "no"
            text = "inf" if label_ in ("no", "yes") else f"inf ({label_})"
            ax.annotate(
                text,
                (right, y),
                xytext=(-30 - 4 * max(0, len(text) - 3), 0),
                textcoords="offset points",
                va="center",
                fontsize=8,
                color="#1f77b4",
                arrowprops={"arrowstyle": "->", "color": "#1f77b4"},
            )
        lb, ceil, _ = m.audit_numbers()
        if _finite(ceil):
            ax.plot(
                [0, ceil],
                [y, y],
                color="#d62728",
                alpha=0.25,
                lw=6,
                solid_capstyle="butt",
                label=label("range an audit of this size can show"),
            )
        if _finite(lb):
            ax.scatter(
                [lb],
                [y],
                marker="o",
                s=55,
                color="#d62728",
                zorder=4,
                label=label("empirical lower bound (all attacks, family-wise)"),
            )
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([m.name for m in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xscale("symlog", linthresh=1.0)
    ax.set_xlim(0, right)
    ax.set_xlabel(f"epsilon at delta = {report.threat_model.delta:g} (symlog scale)")
    ax.set_title("Promise vs evidence: accounted epsilon and audited lower bound")
    ax.grid(True, axis="x", alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if handles:  # below the axes, so it never hides a method's row
        fig.legend(handles, labels, fontsize=7, loc="outside lower center", ncol=3, frameon=False)
    return fig


# ---------------------------------------------------------------------------------- ROC
def roc_figure(method: MethodReport) -> Figure | None:
    """Log-log ROC of every successful attack on ``method`` (chance = the diagonal)."""
    if method.audit is None:
        return None
    curves = [
        (n, a, a.roc)
        for n, a in method.audit.attacks.items()
        if not a.error
        and a.roc is not None
        and len(a.roc.fpr) > 1
        and len(a.roc.fpr) == len(a.roc.tpr)
    ]
    if not curves:
        return None
    fig = _new_figure(4.6, 4.0)
    ax = fig.add_subplot()
    floor = 1.0
    for _, _, roc in curves:
        pos = [v for v in roc.fpr + roc.tpr if v and v > 0]
        floor = min(floor, min(pos) if pos else 1.0)
    floor = max(floor / 2.0, 1e-5)
    same = _duplicates([(name, (tuple(roc.fpr), tuple(roc.tpr))) for name, _, roc in curves])
    for i, (name, a, roc) in enumerate(curves):
        fpr = [max(v, floor) for v in roc.fpr]
        tpr = [max(v, floor) for v in roc.tpr]
        auc = f"AUC {a.auc:.3f}" if _finite(a.auc) else "AUC n/a"
        ax.plot(
            fpr, tpr, lw=1.5, label=f"{name} ({auc}){same.get(name, '')}", **_style(i, len(fpr))
        )
    _finish_loglog_roc(ax, floor, f"{method.name}: membership inference ROC")
    return fig


def _finish_loglog_roc(ax, floor: float, title: str) -> None:
    """Chance line, log-log axes from ``floor`` to 1, labels, grid and legend of a ROC plot."""
    ax.plot([floor, 1], [floor, 1], ls="--", color="grey", lw=1, label="chance")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(floor, 1)
    ax.set_ylim(floor, 1)
    ax.set_xlabel("false positive rate")
    ax.set_ylabel("true positive rate")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")


# ---------------------------------------------------------------------------------- ROC vs the claim
def tradeoff_roc_figure(
    rocs: Mapping[str, tuple[Sequence[float], Sequence[float]]],
    curve: Callable,
    *,
    claim: str | None = None,
    title: str | None = None,
    floor: float | None = None,
) -> Figure:
    """Log-log ROC of every attack over the region a privacy claim allows.

    The claim's boundary ``TPR = 1 - f(FPR)`` is drawn as a line and the region above it (which no
    attack on a mechanism satisfying the claim can reach) is shaded; ROC points inside it are
    marked, so a violation is visible.  ``rocs`` maps attack name -> (fpr, tpr); ``curve`` is the
    trade-off function (its ``claim`` attribute labels the boundary unless ``claim`` is given);
    ``floor`` is the smallest rate shown (default: half the smallest positive rate, >= 1e-6).
    """
    label = claim or getattr(curve, "claim", "the privacy claim")
    pos = [v for f, t in rocs.values() for v in (*f, *t) if v and v > 0]
    floor = floor if floor is not None else max(min(pos, default=1e-3) / 2.0, 1e-6)
    fig = _new_figure(5.0, 4.4)
    ax = fig.add_subplot()
    grid = np.geomspace(floor, 1.0, 400)
    boundary = np.maximum(1.0 - np.asarray(curve(grid), dtype=np.float64), floor)
    ax.fill_between(
        grid, boundary, 1.0, color="tab:red", alpha=0.12, lw=0, label="forbidden by the claim"
    )
    ax.plot(grid, boundary, color="tab:red", lw=1.5, label=f"claim: {label}")
    n_bad = 0
    for name, (fpr_seq, tpr_seq) in rocs.items():
        f, t = np.asarray(fpr_seq, dtype=np.float64), np.asarray(tpr_seq, dtype=np.float64)
        ax.plot(np.maximum(f, floor), np.maximum(t, floor), lw=1.3, label=name)
        bad = forbidden_roc_points(f, t, curve)
        n_bad += bad.size
        ax.plot(
            np.maximum(f[bad], floor),
            np.maximum(t[bad], floor),
            ls="none",
            marker="x",
            color="tab:red",
            ms=5,
        )
    if n_bad:
        ax.plot(
            [],
            [],
            ls="none",
            marker="x",
            color="tab:red",
            label=f"{n_bad} ROC points above the curve",
        )
    _finish_loglog_roc(ax, floor, title or "membership inference ROC against the accounted curve")
    return fig


def ledger_roc_figure(m: MethodReport):
    """:func:`tradeoff_roc_figure` of every attack against the stored curve (or None)."""
    rocs = rocs_of(m)
    if not rocs or m.audit is None or m.audit.tradeoff_curve is None:
        return None
    tc = m.audit.tradeoff_curve
    return tradeoff_roc_figure(
        rocs,
        stored_curve(tc),
        claim=f"the ledger ({tc.claim})",
        title=f"{m.name}: ROC against the ledger's trade-off curve",
    )


# ---------------------------------------------------------------------------------- epsilon over rounds
def epsilon_over_rounds_figure(report: PrivacyReport) -> Figure | None:
    """Worst-client accounted epsilon after each round, one line per method with finite values."""
    colors = method_colors(m.name for m in report.methods)
    series = []
    for m in report.methods:
        if m.privacy is None:
            continue
        pts = [(r, e) for r, e in m.privacy.epsilon_over_rounds if _finite(e) and e > 0]
        if pts:
            series.append((m, pts))
    if not series:
        return None
    fig = _new_figure(8.0, 4.2)
    ax = fig.add_subplot()
    same = _duplicates([(m.name, tuple(pts)) for m, pts in series])
    for i, (m, pts) in enumerate(series):
        xs, ys = zip(*pts)
        ax.plot(
            xs,
            ys,
            lw=1.4,
            color=colors[m.name],
            label=m.name + same.get(m.name, ""),
            **_style(i, len(xs)),
        )
    ax.set_yscale("log")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("round")
    ax.set_ylabel("accounted epsilon, worst client (log)")
    ax.set_title(f"Privacy spent over rounds (delta = {report.threat_model.delta:g})")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    return fig


# ---------------------------------------------------------------------------------- client x class split
def client_class_figure(dataset: DatasetSummary | None) -> Figure | None:
    """Clients (x) by classes (y), dot area proportional to the record count (FedAUX Fig. 8)."""
    if dataset is None or not dataset.class_counts:
        return None
    counts = dataset.class_counts
    n_clients, n_classes = len(counts), len(counts[0])
    top = max((c for row in counts for c in row), default=1) or 1
    fig = _new_figure(max(5.0, 0.32 * n_clients + 1.5), 0.3 * n_classes + 1.6)
    ax = fig.add_subplot()
    xs, ys, ss = [], [], []
    for i, row in enumerate(counts):
        for k, c in enumerate(row):
            if c > 0:
                xs.append(i)
                ys.append(k)
                ss.append(220.0 * c / top)
    ax.scatter(xs, ys, s=ss, color="#2c7fb8", alpha=0.8, edgecolor="none")
    ax.set_xticks(range(n_clients))
    ax.set_yticks(range(n_classes))
    ax.tick_params(labelsize=7)
    ax.set_xlim(-0.7, n_clients - 0.3)
    ax.set_ylim(-0.7, n_classes - 0.3)
    ax.set_xlabel("client")
    ax.set_ylabel("class")
    part = dataset.partition + (f", alpha = {dataset.alpha:g}" if dataset.alpha is not None else "")
    ax.set_title(
        f"{dataset.dataset}: records per client and class\n({part}; largest dot = {top} records)",
        fontsize=9,
    )
    ax.grid(True, alpha=0.2)
    return fig


def _builders(report: PrivacyReport) -> dict[str, Callable[[], Figure | None]]:
    """Each figure's key and the call that draws it (``None``: nothing to draw)."""
    out: dict[str, Callable[[], Figure | None]] = {
        "privacy_utility": lambda: privacy_utility_figure(report),
        "epsilon_comparison": lambda: epsilon_comparison_figure(report),
        "epsilon_over_rounds": lambda: epsilon_over_rounds_figure(report),
        "client_class": lambda: client_class_figure(report.dataset),
    }
    for m in report.methods:
        out[f"roc/{m.name}"] = functools.partial(roc_figure, m)
        out[f"tradeoff_roc/{m.name}"] = functools.partial(ledger_roc_figure, m)
    return out


def report_figures(report: PrivacyReport) -> dict[str, Figure]:
    """Every figure of a report, keyed ``privacy_utility``, ``epsilon_comparison``,
    ``epsilon_over_rounds``, ``client_class`` and ``roc/<method>`` (missing ones left out)."""
    figs = {key: draw() for key, draw in _builders(report).items()}
    return {k: v for k, v in figs.items() if v is not None}


def _pngs(report: PrivacyReport, keys: Sequence[str]) -> dict[str, bytes]:
    builders = _builders(report)
    figs = {key: builders[key]() for key in keys}
    return {k: figure_to_png(f) for k, f in figs.items() if f is not None}


def report_pngs(report: PrivacyReport, workers: int = 1) -> dict[str, bytes]:
    """PNG bytes of :func:`report_figures`' figures, in its order.

    With ``workers > 1`` the figures are shared out (every ``workers``-th one) between this process
    and ``workers - 1`` spawned processes: a report of 16 methods has 30-odd figures, about 0.3 s
    each to lay out and rasterise on one core.
    """
    keys = list(_builders(report))
    workers = max(1, min(workers, len(keys)))
    if workers == 1:
        return _pngs(report, keys)
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    shares = [keys[i::workers] for i in range(workers)]
    with ProcessPoolExecutor(workers - 1, mp_context=get_context("spawn")) as pool:
        futures = [pool.submit(_pngs, report, share) for share in shares[1:]]
        out = _pngs(report, shares[0])  # this process draws its share meanwhile
        for future in futures:
            out.update(future.result())
    return {k: out[k] for k in keys if k in out}
