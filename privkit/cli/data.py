"""``privkit data``: list datasets and show federated splits."""

from __future__ import annotations

import typer
from rich.table import Table

from privkit.cli.app import app, out_console, print_json

data_app = typer.Typer(help="Datasets and federated splits.", no_args_is_help=True)
app.add_typer(data_app, name="data")


@data_app.command("list")
def list_datasets(
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """List the embedded datasets and the local formats privkit reads."""
    from privkit.data import DATASETS

    rows = [
        {"name": d.name, "embedded": d.embedded, "description": d.description}
        for d in DATASETS.values()
    ]
    if as_json:
        print_json({"datasets": rows})
        return
    table = Table(
        title="datasets (local ones read from --data-root / $PRIVKIT_DATA, never downloaded)"
    )
    for col in ("name", "embedded", "description / expected layout"):
        table.add_column(col)
    for r in rows:
        table.add_row(str(r["name"]), "yes" if r["embedded"] else "no", str(r["description"]))
    out_console.print(table)


@data_app.command("split")
def split(
    dataset: str = typer.Option("mnist5k", help="Dataset name or path to a .npz file."),
    clients: int = typer.Option(20, help="Number of clients."),
    partition: str = typer.Option("dirichlet", help="dirichlet | iid | shards"),
    alpha: float = typer.Option(1.0, help="Dirichlet concentration (smaller = more skewed)."),
    shards_per_client: int = typer.Option(2, help="Label shards per client (partition=shards)."),
    public_dataset: str | None = typer.Option(
        "digits28", help="Public/auxiliary dataset ('none' to carve it from DATASET)."
    ),
    data_root: str | None = typer.Option(None, help="Folder holding local datasets."),
    seed: int = typer.Option(0, help="Split seed."),
    save: str | None = typer.Option(None, help="Write the split (index sets) to this JSON file."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Split DATASET among clients and show each client's size and class histogram."""
    from privkit.data import FederationConfig, build_federation

    cfg = FederationConfig(
        dataset=dataset,
        clients=clients,
        partition=partition,  # type: ignore[arg-type]  # pydantic checks the name
        alpha=alpha,
        shards_per_client=shards_per_client,
        public_dataset=public_dataset,
        data_root=data_root,
        seed=seed,
    )
    fed = build_federation(cfg)
    if save:
        fed.save(save)
    summary = fed.summary()
    if as_json:
        print_json(summary)
        return
    table = Table(
        title=f"{dataset}: {clients} clients, {partition}"
        + (f" alpha={alpha}" if partition == "dirichlet" else "")
    )
    table.add_column("client", justify="right")
    table.add_column("size", justify="right")
    table.add_column("class counts")
    for i, c in enumerate(summary["clients"]):
        table.add_row(str(i), str(c["size"]), " ".join(f"{v:4d}" for v in c["class_counts"]))
    out_console.print(table)
    shares = " / ".join(f"{100 * s:.1f}%" for s in summary["top_class_shares"])
    sizes = summary["sizes"]
    out_console.print(f"mean share of each client's 3 largest classes: {shares}")
    out_console.print(
        f"test {sizes['test']}, shadow pool {sizes['shadow_pool']} (auditor only), "
        f"public {summary['public_dataset']}: distill {sizes['distill']}, negative {sizes['negative']}"
    )
