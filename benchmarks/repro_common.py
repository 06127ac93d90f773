"""Shared pieces of the ``repro_*.py`` scripts: rows (paper number beside privkit's), claims marked
reproduced or not, privacy-arithmetic corrections, and one output format (``--json`` or Markdown).

Every script prints one object::

    {"schema_version": 1, "benchmark": "repro_<paper>", "paper": "...", "setting": {...},
     "rows": [{"name", "paper", "privkit_mean", "privkit_std", "per_seed", ...}],
     "claims": [{"claim", "paper", "privkit", "reproduced", "resolved", "note"}],
     "privacy_arithmetic": [{"item", "paper", "corrected", "note"}],
     "conditions": {...}, "seconds": ..., "cpu_seconds": ...}

Accuracies are percentages; ``paper`` is None where the paper has no number for a row.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from privkit.jsonutil import json_default, strict

SCHEMA_VERSION = 1


@dataclass
class Report:
    """What a reproduction script measured, built up as it runs."""

    benchmark: str
    paper: str
    setting: dict
    rows: list[dict] = field(default_factory=list)
    claims: list[dict] = field(default_factory=list)
    privacy_arithmetic: list[dict] = field(default_factory=list)
    started: float = field(default_factory=time.time)
    cpu_started: float = field(default_factory=time.process_time)

    def row(self, name: str, values: list[float], paper: float | None = None, **extra: Any) -> dict:
        """Add a row: privkit's per-seed values (fractions are turned into %) beside the paper's."""
        pct = [100.0 * v for v in values]
        r = {
            "name": name,
            "paper": paper,
            "privkit_mean": statistics.fmean(pct) if pct else None,
            "privkit_std": statistics.pstdev(pct) if len(pct) > 1 else 0.0,
            "per_seed": pct,
            **extra,
        }
        self.rows.append(r)
        return r

    def mean(self, name: str) -> float:
        return next(r["privkit_mean"] for r in self.rows if r["name"] == name)

    def std(self, name: str) -> float:
        return next(r["privkit_std"] for r in self.rows if r["name"] == name)

    def claim(
        self,
        claim: str,
        paper: str,
        privkit: str,
        reproduced: bool,
        note: str = "",
        resolved: bool = True,
    ) -> None:
        """``resolved`` False: the difference is within the spread over seeds (not decided)."""
        self.claims.append(
            {
                "claim": claim,
                "paper": paper,
                "privkit": privkit,
                "reproduced": bool(reproduced),
                "resolved": bool(resolved),
                "note": note,
            }
        )

    def order_claim(
        self,
        better: str,
        worse: str,
        paper_better: float,
        paper_worse: float,
        note: str = "",
        claim: str | None = None,
    ) -> bool:
        """``better`` beats ``worse`` (row means): reproduced when privkit's order matches."""
        a, b = self.mean(better), self.mean(worse)
        spread = max(self.std(better), self.std(worse))
        ok, resolved = a > b, abs(a - b) > spread
        if not resolved:
            note = (
                note + "; " if note else ""
            ) + f"difference within the spread over seeds ({spread:.1f})"
        self.claim(
            claim or f"{better} > {worse}",
            f"{paper_better:.1f} > {paper_worse:.1f}",
            f"{a:.1f} {'>' if ok else '<='} {b:.1f}",
            ok,
            note,
            resolved,
        )
        return ok

    def arithmetic(self, item: str, paper: Any, corrected: Any, note: str = "") -> None:
        self.privacy_arithmetic.append(
            {"item": item, "paper": paper, "corrected": corrected, "note": note}
        )

    def to_dict(self) -> dict:
        return {
            "schema_version": SCHEMA_VERSION,
            "benchmark": self.benchmark,
            "paper": self.paper,
            "setting": self.setting,
            "rows": self.rows,
            "claims": self.claims,
            "privacy_arithmetic": self.privacy_arithmetic,
            "conditions": {
                "torch_threads": torch.get_num_threads(),
                "cpus": os.cpu_count(),
                "platform": platform.platform(),
                "load_average": os.getloadavg(),
            },
            "seconds": round(time.time() - self.started, 1),
            # one torch thread: CPU seconds are what the run takes on an idle core
            "cpu_seconds": round(time.process_time() - self.cpu_started, 1),
        }

    def markdown(self) -> str:
        def cell(v: Any) -> str:
            text = f"{v:.3g}" if isinstance(v, float) else str(v)
            return text.replace("|", "\\|")

        core = {"name", "paper", "privkit_mean", "privkit_std", "per_seed"}
        extras = sorted({k for r in self.rows for k in r if k not in core})
        lines = [
            f"## {self.benchmark}: {self.paper}",
            "",
            "| row | paper | privkit (mean +- std) |" + "".join(f" {e} |" for e in extras),
            "|---|---|---|" + "---|" * len(extras),
        ]
        for r in self.rows:
            paper = "-" if r["paper"] is None else f"{r['paper']:.1f}"
            lines.append(
                f"| {cell(r['name'])} | {paper} | {r['privkit_mean']:.1f} +- {r['privkit_std']:.1f} |"
                + "".join(f" {cell(r[e]) if e in r else '-'} |" for e in extras)
            )
        lines += ["", "| claim | paper | privkit | reproduced |", "|---|---|---|---|"]
        for c in self.claims:
            verdict = ("yes" if c["reproduced"] else "NO") + (
                "" if c["resolved"] else " (unresolved)"
            )
            lines.append(
                f"| {cell(c['claim'])} | {cell(c['paper'])} | {cell(c['privkit'])} | "
                f"{verdict}{': ' + cell(c['note']) if c['note'] else ''} |"
            )
        if self.privacy_arithmetic:
            lines += ["", "| privacy arithmetic | paper | corrected | note |", "|---|---|---|---|"]
            for a in self.privacy_arithmetic:
                lines.append(
                    f"| {cell(a['item'])} | {cell(a['paper'])} | {cell(a['corrected'])} | "
                    f"{cell(a['note'])} |"
                )
        d = self.to_dict()
        lines.append(f"\n{d['seconds']} s wall, {d['cpu_seconds']} s CPU")
        return "\n".join(lines)


def parser(doc: str, seeds: int) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=seeds)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--out", default=None, help="also write the JSON object to this file")
    ap.add_argument("--progress", action="store_true", help="one line per run on stderr")
    return ap


def emit(report: Report, args: argparse.Namespace) -> None:
    data = strict(report.to_dict())
    text = json.dumps(data, indent=2, default=json_default)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text)
    print(text if args.json else report.markdown())


def log(args: argparse.Namespace, msg: str) -> None:
    if args.progress:
        import sys

        print(msg, file=sys.stderr, flush=True)
