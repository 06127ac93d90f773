"""Attack estimators on synthetic outputs with known membership structure."""

import numpy as np
import pytest
from sklearn.base import clone
from sklearn.linear_model import LogisticRegression

from attacks import metrics, signals
from attacks.attribute import AttributeInferenceAttack, evaluate_predictions
from attacks.experiment import membership_mask
from attacks.mia import LiRA, ShadowModelAttack, ThresholdAttack, lira_leave_one_out


def test_signals_closed_forms():
    z = np.array([[2.0, 0.0, -1.0], [0.0, 0.0, 0.0]])
    y = np.array([0, 2])
    p = np.exp(z) / np.exp(z).sum(1, keepdims=True)
    np.testing.assert_allclose(signals.loss(z, y), -np.log(p[[0, 1], y]))
    np.testing.assert_allclose(
        signals.logit_confidence(z, y), np.log(p[[0, 1], y] / (1 - p[[0, 1], y]))
    )
    # no overflow where p_y rounds to 1 in float64
    big = signals.logit_confidence(np.array([[800.0, 0.0]]), np.array([0]))
    assert big[0] == pytest.approx(800.0)
    feats = signals.shadow_features(z, y)
    assert feats.shape == (2, 4) and np.all(np.diff(feats[:, :3], axis=1) <= 0)


def _lira_world(m_models=16, n=400, seed=0):
    """Per-example difficulty mu_i (wide spread) + IN shift d: LiRA's calibration should win."""
    rng = np.random.default_rng(seed)
    mu = rng.normal(0, 3, n)
    keep = membership_mask(m_models, n, seed)
    target_in = rng.random(n) < 0.5
    conf = mu + 1.0 * keep + 0.3 * rng.normal(size=(m_models, n))
    target_conf = mu + 1.0 * target_in + 0.3 * rng.normal(size=n)
    two = lambda c: np.stack([c, np.zeros_like(c)], -1)
    return two(conf), two(target_conf), np.zeros(n, np.int64), keep, target_in


def test_membership_mask_exactly_half():
    keep = membership_mask(8, 100, 3)
    assert keep.shape == (8, 100) and (keep.sum(0) == 4).all()
    assert (membership_mask(8, 100, 3) == keep).all()
    with pytest.raises(ValueError, match="n_models"):
        membership_mask(3, 10, 0)


def test_lira_beats_global_threshold_at_low_fpr():
    sh, tgt, y, keep, member = _lira_world()
    thr = ThresholdAttack("logit_confidence").score_samples(tgt, y)
    online = LiRA(online=True).fit(sh, y, keep).score_samples(tgt, y)
    offline = LiRA(online=False).fit(sh, y, keep).score_samples(tgt, y)
    fixed = LiRA(online=True, fix_variance=True).fit(sh, y, keep).score_samples(tgt, y)
    a_thr = metrics.auc(thr, member)
    for s in (online, offline, fixed):
        assert metrics.auc(s, member) > a_thr + 0.2
        assert metrics.tpr_at_fpr(s, member, 0.01) > metrics.tpr_at_fpr(thr, member, 0.01)
    assert metrics.auc(online, member) > 0.9


def test_lira_offline_is_one_sided():
    # a target confidence far BELOW the OUT mean must not look like a member (two-sided logpdf would)
    sh = np.stack([np.stack([np.array([0.0, 0.1, -0.1, 0.05]), np.zeros(4)], -1)] * 1, 1)  # (4,1,2)
    keep = np.zeros((4, 1), bool)
    att = LiRA(online=False).fit(sh, np.array([0]), keep)
    low = att.score_samples(np.array([[-5.0, 0.0]]), np.array([0]))
    high = att.score_samples(np.array([[5.0, 0.0]]), np.array([0]))
    mid = att.score_samples(np.array([[0.0, 0.0]]), np.array([0]))
    assert low < mid < high


def test_lira_leave_one_out_and_errors():
    sh, _, y, keep, _ = _lira_world(8, 200)
    s, m = lira_leave_one_out(sh, y, keep)
    assert s.shape == (8 * 200,) and metrics.auc(s, m) > 0.8
    with pytest.raises(ValueError, match="keep must have shape"):
        LiRA().fit(sh, y, keep[:, :10])


def _shadow_world(n=600, seed=0):
    rng = np.random.default_rng(seed)
    member = rng.random(n) < 0.5
    y = rng.integers(0, 3, n)
    z = rng.normal(size=(n, 3))
    z[np.arange(n), y] += np.where(member, 3.0, 1.0)  # members: more confident
    return z, y, member


def test_threshold_attack_fit_and_predict():
    z, y, m = _shadow_world()
    att = ThresholdAttack().fit(z, y, m)
    assert np.isfinite(att.threshold_)
    acc = (att.predict(z, y) == m).mean()
    assert acc == pytest.approx(metrics.balanced_accuracy(att.score_samples(z, y), m), abs=0.05)


@pytest.mark.parametrize("per_class", [False, True])
def test_shadow_model_attack_catboost(per_class):
    z, y, m = _shadow_world(seed=1)
    zt, yt, mt = _shadow_world(seed=2)
    att = ShadowModelAttack(iterations=60, per_class=per_class, random_state=0).fit(z, y, m)
    assert metrics.auc(att.score_samples(zt, yt), mt) > 0.75
    p = att.predict_proba(zt, yt)
    assert p.shape == (len(yt), 2) and np.allclose(p.sum(1), 1)
    # same seed -> same scores; estimator contract: clone keeps params, drops fitted state
    again = ShadowModelAttack(iterations=60, per_class=per_class, random_state=0).fit(z, y, m)
    np.testing.assert_array_equal(att.score_samples(zt, yt), again.score_samples(zt, yt))
    c = clone(att)
    assert c.get_params() == att.get_params() and not hasattr(c, "global_")


def test_shadow_model_attack_sklearn_classifier():
    z, y, m = _shadow_world(seed=3)
    att = ShadowModelAttack(classifier=LogisticRegression(max_iter=500)).fit(z, y, m)
    assert metrics.auc(att.score_samples(z, y), m) > 0.75
    with pytest.raises(ValueError, match="classifier must be"):
        ShadowModelAttack(classifier="xgb").fit(z, y, m)


def test_attribute_attack_signal_and_null():
    rng = np.random.default_rng(0)
    prop = rng.integers(0, 2, 400)
    x_sig = rng.normal(size=(400, 5)) + prop[:, None] * 1.5
    x_null = rng.normal(size=(400, 5))
    att = AttributeInferenceAttack().fit(x_sig[:200], prop[:200])
    res = att.evaluate(x_sig[200:], prop[200:])
    assert res.above_chance and res.accuracy > 0.8
    res0 = (
        AttributeInferenceAttack().fit(x_null[:200], prop[:200]).evaluate(x_null[200:], prop[200:])
    )
    assert res0.ci_low <= 0.5 + 0.1 and not res0.accuracy > 0.65
    assert res0.ci_low <= res0.accuracy <= res0.ci_high


def test_evaluate_predictions_interval():
    r = evaluate_predictions(np.array([1, 1, 0, 0]), np.array([1, 0, 0, 1]), chance=0.5)
    assert r.accuracy == 0.5 and r.ci_low < 0.5 < r.ci_high and r.n_test == 4
