"""README.md is the front door: at most 150 lines, and every link in it resolves to a file of the
repository (and to a heading of it, for a link with an anchor), as GitHub renders it. Its python
examples run in tests/test_docs_examples.py."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading: lower case, punctuation dropped, spaces to '-'."""
    text = re.sub(r"[`*]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)  # no headings in code
    found: set[str] = set()
    for heading in re.findall(r"^#{1,6} (.+)$", text, flags=re.M):
        anchor, n = github_anchor(heading), 1
        while anchor in found:  # repeated headings: -1, -2, ...
            anchor, n = f"{github_anchor(heading)}-{n}", n + 1
        found.add(anchor)
    return found


def test_readme_is_short():
    assert len(README.read_text().splitlines()) <= 150


def test_every_readme_link_resolves():
    links = _LINK.findall(README.read_text())
    assert links, "README.md links into the documentation"
    broken = []
    for link in links:
        if re.match(r"[a-z]+:", link):  # https:, mailto: (not checked offline)
            continue
        path, _, anchor = link.partition("#")
        target = (README.parent / path).resolve() if path else README
        if not target.exists() or (
            anchor and (target.suffix != ".md" or anchor not in anchors(target))
        ):
            broken.append(link)
    assert not broken, f"README.md links that resolve to no file or heading: {broken}"


def test_anchor_rules():
    assert (
        github_anchor("From scores to a verdict: `attacks.audit_scores`")
        == "from-scores-to-a-verdict-attacksaudit_scores"
    )
    assert github_anchor("Auditing privkit's methods") == "auditing-privkits-methods"
