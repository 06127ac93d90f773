"""``privkit audit RUN_DIR --mechanisms``: the white-box audit of a run's method at its DP mechanisms.

The run's method is trained again on the run's federation with its trainer config (reproducible
noise: an audit run is never a release) with canaries at every DP mechanism of the probed clients
(:func:`privkit.audit.mechanism_audit.audit_mechanisms`); each mechanism is tested against what the
ledger claims for it. ``--mutation`` runs the same audit on a deliberately broken copy (a positive
control: it must say ``violation``). Writes ``RUN_DIR/mechanism-audit.json`` (or
``mechanism-audit-<mutation>.json``).
"""

from __future__ import annotations

import re
from pathlib import Path

from rich.markup import escape
from rich.table import Table

from privkit.cli.app import out_console, print_json
from privkit.errors import PrivkitError


def parse_clients(text: str | None) -> tuple[int, ...] | None:
    """``"0,3"`` -> (0, 3); ``"all"`` -> None (every client)."""
    if text is None:
        return (0,)
    if text.strip() == "all":
        return None
    try:
        out = tuple(int(c) for c in text.split(",") if c.strip())
    except ValueError:
        raise PrivkitError(
            f"--clients must be comma-separated client ids or 'all'; found {text!r}"
        ) from None
    if not out or min(out) < 0:
        raise PrivkitError(
            f"--clients must be comma-separated client ids >= 0 or 'all'; found {text!r}"
        )
    return out


def check_mechanism_options(mutation: str, canaries: int) -> None:
    """What can be refused before anything heavy loads."""
    from privkit.mechanisms.mutations import MUTATIONS

    if mutation not in MUTATIONS:
        raise PrivkitError(f"--mutation must be one of {', '.join(MUTATIONS)}; found {mutation!r}")
    if canaries < 2:
        raise PrivkitError(f"--canaries must be >= 2; found {canaries}")


def _probe_table(record: dict) -> Table:
    table = Table(
        title=escape(
            f"mechanism audit of {record['method']} ({record['mutation']['name']}), "
            f"delta={record['delta']:g}"
        )
    )
    for col in ("client", "mechanism", "test", "measured", "limit", "flags at", "rejected"):
        table.add_column(col)
    for p in record["probes"]:
        for name, t in p["audit"]["conformance"]["tests"].items():
            table.add_row(
                str(p["client"]),
                escape(p["mechanism"]),
                name,
                _f(t["measured"]),
                _f(t["confidence_limit"]),
                _f(t.get("detectable")),
                "[bold red]yes[/bold red]" if t["rejected"] else "no",
            )
        one = p["audit"]
        table.add_row(
            str(p["client"]),
            escape(p["mechanism"]),
            "one-run bound",
            _f(one["epsilon_lower_bound"]),
            _f(one["epsilon_ceiling"]),
            _f(one["detectable_epsilon"]),
            "[bold red]yes[/bold red]" if one["one_run"]["status"] == "violation" else "no",
        )
    return table


def _f(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, str):  # strict JSON's non-finite numbers
        return {"Infinity": "inf", "-Infinity": "-inf"}.get(x, x)
    return f"{x:.4g}"


def audit_run_mechanisms(
    run_dir: Path,
    *,
    seed: int,
    delta: float | None,
    mutation: str,
    canaries: int,
    clients: str | None,
    as_json: bool,
) -> None:
    """Run the mechanism audit of ``run_dir``'s method, write its JSON, print a summary."""
    check_mechanism_options(mutation, canaries)
    wanted = parse_clients(clients)
    from privkit.audit.mechanism_audit import audit_mechanisms
    from privkit.audit.run import resolve_delta
    from privkit.data import Federation
    from privkit.files import read_json, write_json

    cfg = read_json(run_dir / "config.json", "run config")
    fed = Federation.load(run_dir / "federation.json")
    if wanted is not None and max(wanted) >= fed.num_clients:
        raise PrivkitError(
            f"--clients must be below the federation's {fed.num_clients} clients; found {max(wanted)}"
        )
    delta = resolve_delta(delta, cfg["trainer"], {}, len(fed.members))
    record = audit_mechanisms(
        cfg["method"],
        fed,
        cfg["trainer"],
        delta=delta,
        seed=seed,
        mutation=mutation,
        canaries=canaries,
        clients=wanted,
        progress=not as_json,
        engine=cfg.get("engine", "inprocess"),
    )
    slug = re.sub(r"[^a-z0-9]+", "-", mutation.lower()).strip("-")
    path = run_dir / (
        "mechanism-audit.json" if mutation == "correct" else f"mechanism-audit-{slug}.json"
    )
    write_json(path, record)
    if as_json:
        print_json(record)
        return
    if record["probes"]:
        out_console.print(_probe_table(record))
    color = {"violation": "bold red", "consistent": "green"}.get(record["status"], "yellow")
    out_console.print(
        f"verdict: [{color}]{escape(record['status'])}[/{color}] - {escape(record['message'])}",
        highlight=False,
    )
    out_console.print(f"wrote {path}", highlight=False)
