"""FLiP runs batched (:mod:`privkit.batched.many`): the clients of many runs' rounds step together.

Each run is a :class:`~privkit.trainers.flip.FlipRun` (the single run's own object: the initial
model and distilled data, the clients' seeds, the aggregation, the evaluation and artifacts of
every round, the result), driven round by round (:func:`~privkit.batched.many.lockstep`). A run
that is not an audit's reference run computes its round's client updates with the single run's
own call (:func:`~privkit.trainers.flip.round_updates`), so it is its single run bit for bit. The
reference runs (``fast``: the auditor's own models, whose statistics, not bits, the attacks use)
compute theirs together (:func:`~privkit.trainers.flip.runs_round_updates`): for privkit's MLP
every client of every reference run steps in one rank-one lockstep (:mod:`privkit.trainers.
flip_rank_one`, the runs' initial models stacked one per run, their clients' padded raw rows kept
across the rounds), equal to its single run up to float rounding, which the clients' Adam
amplifies. The reference runs skip every round's evaluation (:func:`~privkit.batched.many.
unreported`); their results' models and test accuracies stay.
"""

from __future__ import annotations

from privkit.batched.many import lockstep, unreported
from privkit.trainers.flip import FlipRun, round_updates, runs_round_updates


def train_flip_many(
    method: str, federations: list, configs: list, seeds: list[int], fast: list[bool] | None = None
) -> list:
    """``train("flip", federations[j], configs[j], seeds[j])`` for every j, the runs' rounds in
    lockstep, the reference runs' client updates batched (see the module docstring).

    Parameters
    ----------
    method : str
        The method, ``"flip"``.
    federations : list
        One federation per run, in the same layout (model architecture, client count).
    configs : list
        One FLiP trainer config per run, equal but for ``reproducible_noise`` (which FLiP, drawing
        no noise, does not read).
    seeds : list[int]
        One seed per run: its initial model and distilled data, its clients' batches.
    fast : list[bool] or None
        One flag per run: ``True`` marks an audit's reference run, whose client updates are
        computed with the other reference runs' (equal to its single run's up to float
        rounding); ``None`` (default): none, every run its single run bit for bit.
    """
    runs = [FlipRun(f, c, s) for f, c, s in zip(federations, configs, seeds)]
    together = {id(r) for r, f in zip(runs, fast or [False] * len(runs)) if f}
    unreported(runs, fast)
    together_rows: dict = {}  # the reference runs' padded raw rows, kept across rounds

    def local_round(going: list[FlipRun], picked: list[list[int]]) -> list:
        out: list = [None] * len(going)
        batched = [at for at, r in enumerate(going) if id(r) in together]
        for at, r in enumerate(going):
            if id(r) not in together:
                out[at] = round_updates(
                    r.model,
                    r.init,
                    r.S,
                    r.L,
                    r.eta,
                    r.round_clients(),
                    r.config,
                    r.lr,
                    r.seeds,
                    r.rows_cache,
                )
        if batched:
            if len({going[at].lr for at in batched}) != 1:
                raise ValueError("batched FLiP runs must share the round's step size")
            owners = [at for at in batched for _ in going[at].round_clients()]
            updates = runs_round_updates(
                going[batched[0]].model,
                [
                    (going[at].init, going[at].S, going[at].L, going[at].eta)
                    for at in batched
                    for _ in going[at].round_clients()
                ],
                [c for at in batched for c in going[at].round_clients()],
                going[batched[0]].config,
                going[batched[0]].lr,
                [s for at in batched for s in going[at].seeds],
                together_rows,
            )
            for at in batched:
                out[at] = [u for u, o in zip(updates, owners) if o == at]
        return out

    lockstep(runs, local_round)
    return [r.outcome() for r in runs]


__all__ = ["train_flip_many"]
