"""ROC against the accountant's trade-off curve: the forbidden-point helper and the figure."""

import math

import numpy as np
import pytest

from accountants import gaussian_curve, generic_curve
from reports import plots

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def eps1(fpr):
    """The pure 1-DP curve written out: max(0, 1 - e a, (1 - a) / e)."""
    a = np.asarray(fpr, dtype=float)
    return np.maximum(0.0, np.maximum(1 - math.e * a, (1 - a) / math.e))


def test_forbidden_points_are_those_above_one_minus_f():
    # TPR bound 1 - f(FPR): e * FPR for FPR <= 1/(1+e), then 1 - (1 - FPR)/e
    fpr = np.array([0.0, 0.001, 0.01, 0.01, 0.2, 0.5, 0.5, 1.0])
    tpr = np.array([0.0, 0.0027, 0.02, 0.1, 0.6, 0.9, 0.8, 1.0])
    # bounds: 0, 0.002718, 0.02718, 0.02718, 0.5437, 0.8161, 0.8161, 1
    np.testing.assert_array_equal(plots.forbidden_roc_points(fpr, tpr, eps1), [3, 4, 5])
    # a tolerance forgives what lies within it
    np.testing.assert_array_equal(plots.forbidden_roc_points(fpr, tpr, eps1, tol=0.06), [3, 5])
    # the accountant's own curve object gives the same answer
    np.testing.assert_array_equal(
        plots.forbidden_roc_points(fpr, tpr, generic_curve(1.0, 0.0)), [3, 4, 5]
    )


def test_chance_and_a_dp_consistent_roc_are_never_forbidden():
    fpr = np.linspace(0, 1, 101)
    assert plots.forbidden_roc_points(fpr, fpr, gaussian_curve(0.5, 1e-5)).size == 0
    # the boundary itself, attained exactly, is allowed
    c = gaussian_curve(2.0, 1e-5)
    assert plots.forbidden_roc_points(fpr, 1 - c(fpr), c).size == 0


@pytest.mark.parametrize("fpr,tpr", [([0.1, 0.2], [0.3]), ([0.1, 1.2], [0.3, 0.4])])
def test_forbidden_points_bad_input(fpr, tpr):
    with pytest.raises(ValueError, match="fpr and tpr"):
        plots.forbidden_roc_points(fpr, tpr, eps1)


def test_tradeoff_roc_figure_is_a_png_and_marks_violations():
    fpr = np.r_[0.0, np.geomspace(1e-3, 1.0, 60)]
    rocs = {
        "loss threshold": (fpr, 1 - generic_curve(0.5, 0.0)(fpr)),  # a 0.5-DP attack
        "broken": (fpr, np.minimum(1.0, 10 * fpr)),
    }  # far above e * FPR at low FPR
    curve = generic_curve(1.0, 1e-5)
    fig = plots.tradeoff_roc_figure(rocs, curve, title="demo")
    png = plots.figure_to_png(fig)
    assert png.startswith(PNG_MAGIC) and len(png) > 5000
    ax = fig.axes[0]
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    n_bad = plots.forbidden_roc_points(*rocs["broken"], curve).size
    assert n_bad > 0 and plots.forbidden_roc_points(*rocs["loss threshold"], curve).size == 0
    assert f"{n_bad} ROC points above the curve" in labels
    assert any(lab.startswith("claim: (1, 1e-05)-DP") for lab in labels)
