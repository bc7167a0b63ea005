"""CostTable: the measured wall cost of each call a decode step can make, and the budgets it is measured for.

Pure numpy; never imports MindSpore. The engine measures the table on this machine (``Engine.measure_costs``) and
the speculation policy (core/policy.py) turns it into expected tokens per millisecond.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass

import numpy as np


def compiled_budgets(M: int) -> list[int]:
    """Verification budgets the adaptive policy may use under the ceiling M: 2, 4, 8, ... below M, then M.

    Raises:
        ValueError: M < 2.
    """
    if M < 2:
        raise ValueError(f"speculative.M = {M} must be >= 2 to speculate")
    out, m = [], 2
    while m < M:
        out.append(m)
        m *= 2
    return out + [M]


@dataclass
class CostTable:
    """Measured wall cost of each call a step can make, in ms, on this machine and process (Engine.measure_costs).

    Fields:
        decode_ms: one teacher decode (k = 1 query row), plus the plain step's host work.
        verify_ms: {m: ms} one teacher verification of an m-token tree, for each compiled budget m.
        draft_ctx_ms: the drafter's context pass over one new (feature, token) pair.
        draft_step_ms: one drafter expansion step (K rows).
        host_ms: a speculative step's host work (tensorize, mask, accept, commit), added to verify_ms[m].
    """

    decode_ms: float
    verify_ms: dict
    draft_ctx_ms: float
    draft_step_ms: float
    host_ms: float = 0.0

    def __post_init__(self):
        self.verify_ms = {int(m): float(v) for m, v in self.verify_ms.items()}
        for name in ("decode_ms", "draft_ctx_ms", "draft_step_ms", "host_ms"):
            if not np.isfinite(getattr(self, name)) or getattr(self, name) < 0:
                raise ValueError(f"CostTable.{name} = {getattr(self, name)} must be a finite number >= 0 (ms)")
        if self.decode_ms <= 0 or not self.verify_ms or min(self.verify_ms.values()) <= 0:
            raise ValueError("CostTable needs decode_ms > 0 and verify_ms > 0 for at least one budget")

    def step_ms(self, m: int) -> float:
        """Cost of the verification part of a step of budget m (m = 1: a plain decode)."""
        return self.decode_ms if m == 1 else self.verify_ms[m] + self.host_ms

    def to_dict(self) -> dict:
        return {"decode_ms": self.decode_ms, "verify_ms": {str(m): v for m, v in sorted(self.verify_ms.items())},
                "draft_ctx_ms": self.draft_ctx_ms, "draft_step_ms": self.draft_step_ms, "host_ms": self.host_ms}

    def save(self, path: str) -> None:
        """Write the table as JSON to ``path`` atomically (temporary file, then rename); an unwritable path is
        skipped (the table is only a cache)."""
        try:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            tmp = f"{path}.tmp{os.getpid()}"
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(self.to_dict(), f)
            os.replace(tmp, path)
        except OSError:
            pass

    @classmethod
    def load(cls, path: str, max_age_s: float, budgets=()) -> "CostTable | None":
        """The table saved at ``path`` if it is younger than ``max_age_s`` seconds, readable, and has a cost for
        every budget in ``budgets``; else None (measure again)."""
        try:
            if time.time() - os.path.getmtime(path) > max_age_s:
                return None
            with open(path, encoding="utf-8") as f:
                table = cls(**json.load(f))
        except (OSError, ValueError, TypeError):
            return None
        return table if set(budgets) <= set(table.verify_ms) else None

    def describe(self) -> str:
        """One line per call, ms and multiple of a decode."""
        d = self.decode_ms
        rows = [f"decode           {d:7.1f} ms  1.00x"]
        rows += [f"verify m={m:<3d}     {v:7.1f} ms  {v / d:.2f}x" for m, v in sorted(self.verify_ms.items())]
        rows += [f"drafter context  {self.draft_ctx_ms:7.1f} ms  {self.draft_ctx_ms / d:.2f}x",
                 f"drafter step     {self.draft_step_ms:7.1f} ms  {self.draft_step_ms / d:.2f}x",
                 f"step host work   {self.host_ms:7.1f} ms  {self.host_ms / d:.2f}x"]
        return "\n".join(rows)


__all__ = ["CostTable", "compiled_budgets"]
