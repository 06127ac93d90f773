"""Training recipes the recipe-audit tests use: scikit-learn, a plain PyTorch loop, opacus DP-SGD.

A module of its own (not a test file) so that worker processes and Ray can import the functions.
"""

import numpy as np
from sklearn.ensemble import RandomForestClassifier
from sklearn.linear_model import LogisticRegression

DP_EPSILON, DP_DELTA, DP_EPOCHS = 2.0, 1e-5, 4


def digits():
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    return (x / 16).astype(np.float32), y


def forest(x, y, seed):
    """Memorises its training data (fully grown trees)."""
    return RandomForestClassifier(n_estimators=20, random_state=seed, n_jobs=1).fit(x, y)


def logreg(x, y, seed):
    return LogisticRegression(C=1.0, max_iter=200, random_state=seed).fit(x, y)


def prior_only(x, y, seed):
    """Ignores the inputs: predicts the training labels' class frequencies (a null model)."""
    from sklearn.dummy import DummyClassifier

    return DummyClassifier(strategy="prior").fit(x, y)


def torch_loop(x, y, seed):
    """A plain PyTorch loop: full-batch Adam on an MLP until it fits its training data."""
    import torch

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    xt, yt = torch.as_tensor(x), torch.as_tensor(y)
    for _ in range(100):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(xt), yt).backward()
        opt.step()
    return model


def opacus_dpsgd(x, y, seed):
    """DP-SGD with opacus, calibrated to (DP_EPSILON, DP_DELTA) for its data size and epochs."""
    import warnings

    import torch
    from opacus import PrivacyEngine

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.as_tensor(x), torch.as_tensor(y)), batch_size=64
    )
    with (
        warnings.catch_warnings()
    ):  # opacus warns about secure RNG being off: a test, not a release
        warnings.simplefilter("ignore")
        model, opt, loader = PrivacyEngine(accountant="rdp").make_private_with_epsilon(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
            data_loader=loader,
            target_epsilon=DP_EPSILON,
            target_delta=DP_DELTA,
            epochs=DP_EPOCHS,
            max_grad_norm=1.0,
        )
        for _ in range(DP_EPOCHS):
            for xb, yb in loader:
                opt.zero_grad()
                torch.nn.functional.cross_entropy(model(xb), yb).backward()
                opt.step()
    return model


def logreg_losing_its_worker(x, y, seed):
    """``logreg``, but the third call anywhere kills the worker process running it (SIGKILL, as
    an out-of-memory killer would), once: calls are counted by files in ``$PRIVKIT_TEST_KILL_DIR``;
    the process ``$PRIVKIT_TEST_MAIN_PID`` (the test's own) is never killed."""
    import os
    import signal
    import time
    from pathlib import Path

    calls = Path(os.environ["PRIVKIT_TEST_KILL_DIR"])
    (calls / f"call-{seed}-{os.getpid()}-{time.time_ns()}").touch()
    if (
        os.getpid() != int(os.environ["PRIVKIT_TEST_MAIN_PID"])
        and len(list(calls.glob("call-*"))) >= 3
    ):
        try:
            os.close(os.open(calls / "killed", os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            pass
        else:
            os.kill(os.getpid(), signal.SIGKILL)
    return logreg(x, y, seed)
