"""A few short English / code lines and random two-turn conversations made of them, for training tests on the
tiny openPangu teacher."""
from __future__ import annotations

import numpy as np

TEXTS = [ln.strip() for ln in """\
The quick brown fox jumps over the lazy dog.
What is the capital of France? The capital of France is Paris.
Speculative decoding drafts several tokens and the teacher verifies them in one forward pass.
Write a short story about a robot who learns to paint.
Explain why the sky is blue.
Please answer the question step by step, and keep the answer short and clear.
def add(a, b): return a + b
numbers 0 1 2 3 4 5 6 7 8 9 10 42 100""".splitlines()]


def conversations(n, seed=0):
    """n user / assistant pairs, each line drawn from TEXTS (the assistant says two)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        a, b, c = rng.choice(len(TEXTS), 3)
        out.append([{"role": "user", "content": TEXTS[a]},
                    {"role": "assistant", "content": TEXTS[b] + " " + TEXTS[c]}])
    return out
