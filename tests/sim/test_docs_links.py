"""The user docs owned here point only inside the repository (a user has no
``/work/shared`` and no design ``ARCHITECTURE.md``): every relative markdown link
resolves to a file of the repository, and no path outside it is cited."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ["docs/backends.md", "docs/architecture.md", "docs/capacity-planning.md"]
LINK = re.compile(r"\]\(([^)\s]+)\)")


@pytest.mark.parametrize("doc", DOCS)
def test_doc_points_only_inside_the_repository(doc: str) -> None:
    path = ROOT / doc
    text = path.read_text()
    for bad in ("/work/", "shared/design", "shared/traces", "ARCHITECTURE.md"):
        assert bad not in text, f"{doc} cites {bad!r}, which is outside the repository"
    for target in LINK.findall(text):
        if re.match(r"[a-z]+://|#|mailto:", target):
            continue
        resolved = (path.parent / target.split("#")[0]).resolve()
        assert resolved.is_relative_to(ROOT), f"{doc}: link {target} leaves the repository"
        assert resolved.exists(), f"{doc}: link {target} points to a missing file"
