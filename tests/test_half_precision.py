"""The half-precision guarantee, on the real embedded teacher in float16 on CPU (docs/ascend.md, "The
half-precision guarantee").

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
MIN_SAME = 18          # of N_PROMPTS; measured 20-22 on the CPUs of docs/ascend.md

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
    # The guarantee is the gap bound below. How many prompts depart depends on the CPU's float16 kernels (which
    # near-ties rounding tips): 22 of 24 on AVX-512 Intel, 20 of 24 on AVX2 AMD (docs/ascend.md). A broken verify
    # path departs on most prompts, so at least MIN_SAME must stay identical.
    assert same >= MIN_SAME, departures
    assert all(gap < HALF_TIE for _, _, gap in departures), departures


def test_float16_seeded_sampling_alone_equals_in_a_batch_of_4_up_to_keyed_near_ties(ms_runtime):
    """Seeded sampling in float16 (temperature 0.8): each text alone equals the same request decoded in a batch of
    4 (other row counts, other rounding), except from a position where the keyed draw's two best scores
    (log-probability + the position's keyed Gumbel noise, ``core.accept.keyed_draw``) differ by less than
    HALF_TIE / temperature: the keyed race changes its winner only at such a near-tie, as greedy does."""
    import dataclasses

    from mindspore_eagle.bench.batching import chat_prompts
    from mindspore_eagle.core.accept import keyed_uniforms, warp_probs
    from mindspore_eagle.serving.scheduler import BatchScheduler, Request

    cfg = load_config(None, ["model.dtype=float16", "model.drafter=none", f"generation.max_new_tokens={NEW_TOKENS}"])
    eng = build_engine(cfg)
    T = 0.8
    gens = [dataclasses.replace(cfg.generation, temperature=T, seed=11 + i) for i in range(4)]
    prompts = chat_prompts(4)
    sched = BatchScheduler(eng, cfg.generation, 4)
    done = {}
    for i, (p, g) in enumerate(zip(prompts, gens)):
        sched.add(Request(i, g, messages=[{"role": "user", "content": p}],
                          on_done=lambda r, res: done.__setitem__(r.rid, res)))
    while sched.has_work:
        sched.step()
    assert sched.peak_live == 4
    same = 0
    for i, (p, g) in enumerate(zip(prompts, gens)):
        alone = eng.generate(p, g, speculative=False).token_ids
        batched = done[i].token_ids
        if alone == batched:
            same += 1
            continue
        j = next(k for k, (a, b) in enumerate(zip(alone, batched)) if a != b)
        ids = eng.encode_chat(p) + alone[:j]
        sid = eng.teacher.new_seq()
        try:
            logits, _ = eng.teacher.prefill(sid, ids)
        finally:
            eng.teacher.free(sid)
        prob = warp_probs(np.asarray(logits, np.float64)[None], T)[0]
        u = keyed_uniforms(g.seed, [len(ids)], prob.size)[0]
        with np.errstate(divide="ignore"):
            score = np.log(prob) - np.log(-np.log(u))
        a, b = np.sort(score)[-2:]
        assert b - a < HALF_TIE / T, (i, j, b - a)
    print(f"float16 seeded sampling: {same} of 4 texts identical alone and in a batch of 4")
