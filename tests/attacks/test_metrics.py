"""ROC metrics against scikit-learn and brute force."""

import numpy as np
import pytest
from sklearn.metrics import roc_auc_score, roc_curve

from attacks import metrics


def _data(seed=0, n=500):
    rng = np.random.default_rng(seed)
    m = rng.random(n) < 0.4
    s = rng.normal(size=n) + 0.8 * m
    s = np.round(s, 1)  # force ties
    return s, m


def test_roc_and_auc_match_sklearn():
    s, m = _data()
    fpr, tpr, _ = metrics.roc_points(s, m)
    f2, t2, _ = roc_curve(m, s, drop_intermediate=False)
    np.testing.assert_allclose(fpr, f2)
    np.testing.assert_allclose(tpr, t2)
    assert metrics.auc(s, m) == pytest.approx(roc_auc_score(m, s), abs=1e-12)


def _brute(s, m):
    out = []
    for t in np.r_[np.unique(s), np.inf]:
        pred = s >= t
        out.append(((pred & ~m).sum() / (~m).sum(), (pred & m).sum() / m.sum()))
    return np.array(out)


def test_balanced_accuracy_advantage_bruteforce():
    s, m = _data(1)
    pts = _brute(s, m)
    assert metrics.advantage(s, m) == pytest.approx(np.max(pts[:, 1] - pts[:, 0]))
    assert metrics.balanced_accuracy(s, m) == pytest.approx(
        np.max(1 - (pts[:, 0] + 1 - pts[:, 1]) / 2)
    )


def test_tpr_at_fpr_uses_less_or_equal():
    # 100 non-members, 10 members; the top score is a non-member: FPR exactly 0.01 at t=10.
    s = np.r_[
        10.0,
        np.zeros(99),
        np.full(10, 5.0),
    ]
    m = np.r_[np.zeros(100, bool), np.ones(10, bool)]
    s[100:105] = 11.0  # five members above the non-member
    assert metrics.tpr_at_fpr(s, m, 0.0) == pytest.approx(0.5)  # zero-FPR TPR is defined, not N/A
    # at FPR <= 0.01 the threshold t = 5 admits all members and exactly one non-member
    assert metrics.tpr_at_fpr(s, m, 0.01) == pytest.approx(1.0)
    assert metrics.tpr_at_fpr(s, m, 0.0099) == pytest.approx(0.5)


def test_tpr_at_fpr_never_reads_a_point_above_the_level():
    s, m = _data(2, 3000)
    for level in (0.001, 0.01, 0.1):
        tpr = metrics.tpr_at_fpr(s, m, level)
        pts = _brute(s, m)
        assert tpr == pytest.approx(pts[pts[:, 0] <= level, 1].max())


def test_summarize_and_loglog():
    s, m = _data(3, 2000)
    summ = metrics.summarize(s, m, max_points=50)
    assert summ.auc == pytest.approx(roc_auc_score(m, s))
    assert len(summ.fpr) <= 52 and summ.fpr[0] == 0 and summ.tpr[-1] == 1
    assert summ.tpr_at_fpr["0.01"] == metrics.tpr_at_fpr(s, m, 0.01)
    ll = metrics.loglog_roc(s, m)
    assert min(ll["fpr"]) == pytest.approx(0.5 / (~m).sum())


def test_bad_input_names_the_parameter():
    with pytest.raises(ValueError, match="membership must contain both"):
        metrics.auc(np.ones(3), np.ones(3, bool))
    with pytest.raises(ValueError, match="same length"):
        metrics.auc(np.ones(3), np.ones(2, bool))
    with pytest.raises(ValueError, match="level must be in"):
        metrics.tpr_at_fpr(np.r_[0.0, 1.0], np.r_[False, True], 1.5)
