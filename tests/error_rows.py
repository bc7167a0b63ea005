"""The rows of docs/errors.md: the message each row documents, and a check that an error message matches it."""
from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ERRORS_MD = ROOT / "docs" / "errors.md"


def documented(row: str) -> str:
    """The message docs/errors.md gives for ``row`` (first column), as a regex (placeholders <..> = .+?)."""
    for line in ERRORS_MD.read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if len(cells) == 3 and cells[0] == row:
            span = re.search(r"`(.+?)`", cells[2]).group(1)
            if cells[2].startswith("record "):  # an output record's "error" field, JSON-encoded in the table
                span = json.loads(span[len('"error": '):])
            return ".+?".join(re.escape(p) for p in re.split(r"<[^>]+>", span))
    raise AssertionError(f"docs/errors.md has no row {row!r}")


def check_row(row: str, message: str) -> None:
    """Assert that ``message`` is exactly what docs/errors.md documents for ``row``."""
    assert re.fullmatch(documented(row), message), f"{row}: got {message!r}, documented {documented(row)!r}"
