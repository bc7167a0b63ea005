"""The half-precision guarantee, on the real embedded teacher in float16 on CPU (docs/ascend.md, "Half precision").

Stated in README and docs/ascend.md: in float16 (and bfloat16), greedy speculative output equals teacher-only
output of the same dtype, except where the teacher's two best logits differ by less than ``HALF_TIE``: CPU half
kernels round a row differently with the row count and summation order (a tree verifies M rows, a decode one), and
that moves logits by ~1e-3, which decides a greedy token only at such a near-tie.
"""
import numpy as np
import pytest

from mindspore_eagle.config import load_config
from mindspore_eagle.serving.pipeline import build_engine

HALF_TIE = 0.05        # logits; measured departures so far at gaps 0.002-0.009 (docs/ascend.md)
N_PROMPTS, NEW_TOKENS = 24, 32

pytestmark = pytest.mark.slow


def top2_gap(eng, ids) -> float:
    """The float16 teacher's top-1 minus top-2 logit for the token after ``ids`` (a fresh prefill)."""
    sid = eng.teacher.new_seq()
    try:
        logits, _ = eng.teacher.prefill(sid, ids)
    finally:
        eng.teacher.free(sid)
    a, b = np.sort(logits)[-2:]
    return float(b - a)


def test_float16_speculation_departs_from_teacher_only_only_at_near_ties(ms_runtime):
    from mindspore_eagle.bench.batching import chat_prompts

    cfg = load_config(None, ["model.dtype=float16", "speculative.policy=fixed", "speculative.M=8",
                             "speculative.D_max=2", "speculative.top_k=4", f"generation.max_new_tokens={NEW_TOKENS}"])
    eng = build_engine(cfg)
    gen = cfg.generation
    departures, same = [], 0
    for i, p in enumerate(chat_prompts(N_PROMPTS)):
        base = eng.generate(p, gen, speculative=False).token_ids
        spec = eng.generate(p, gen, speculative=True).token_ids
        if spec == base:
            same += 1
            continue
        j = next((k for k, (a, b) in enumerate(zip(base, spec)) if a != b), min(len(base), len(spec)))
        departures.append((i, j, top2_gap(eng, eng.encode_chat(p) + base[:j])))
    print(f"float16 speculative == teacher-only on {same} of {N_PROMPTS} prompts; departures (prompt, position, "
          f"top-2 gap): {departures}")
    assert same + len(departures) == N_PROMPTS
    assert all(gap < HALF_TIE for _, _, gap in departures), departures
