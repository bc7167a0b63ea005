"""train/regen.py: batched regeneration gives each prompt the greedy reply of decoding it alone, and every block
goes back to the pool, also after an error mid-run."""
from __future__ import annotations

import pytest
from tiny_corpus import TEXTS, conversations


@pytest.mark.slow
def test_batched_regeneration_equals_one_sequence_greedy(tiny, ms_runtime):
    """Continuous batching over decode_batch (block-diagonal mask, concatenated block tables) gives each prompt
    the same greedy reply as decoding it alone; every block goes back to the pool."""
    from mindspore_eagle.train.data import build_samples, regenerate_reply
    from mindspore_eagle.train.features import build_runner
    from mindspore_eagle.train.regen import build_batch_runner, regenerate_replies

    cfg, tensors, tok = tiny
    single, _ = build_runner(cfg, tensors, 256)
    max_len = 128
    prompts = TEXTS[:5] + ["word " * 300]                     # the last one leaves no room: skipped (None)
    batch_runner, _ = build_batch_runner(cfg, tensors, max_len, batch=2)
    free0 = batch_runner.bm.free_blocks()
    got = regenerate_replies(batch_runner, tok, prompts, max_len, batch=2, min_reply=4)
    assert got[-1] is None and batch_runner.bm.free_blocks() == free0
    for text, reply in zip(prompts[:-1], got[:-1]):
        n = len(tok.encode_chat([{"role": "user", "content": text}], add_generation_prompt=True))
        assert reply == regenerate_reply(single, tok, text, max_new=max_len - n), text
    with pytest.raises(ValueError, match="batch"):
        regenerate_replies(batch_runner, tok, prompts, max_len, batch=0)
    for method, fail_at in (("decode_batch", 1), ("decode_batch", 12), ("prefill", 3), ("progress", 1)):
        calls, real = [], getattr(batch_runner, method, None)   # an error mid-run: every row freed exactly once

        def flaky(*a, **k):
            calls.append(1)
            if len(calls) == fail_at:
                raise RuntimeError("injected")
            return real(*a, **k) if real is not None else None
        if method != "progress":
            setattr(batch_runner, method, flaky)
        try:
            with pytest.raises(RuntimeError, match="injected"):
                regenerate_replies(batch_runner, tok, prompts, max_len, batch=2, min_reply=4,
                                   progress=flaky if method == "progress" else None)
        finally:
            if method != "progress":
                setattr(batch_runner, method, real)
        assert batch_runner.bm.free_blocks() == free0, (method, fail_at)
    samples, st = build_samples(tok, conversations(6), 4, max_len, min_assistant=1, regenerate=3,
                                runner=batch_runner, eval_keys=set(), regen_batch=2)
    assert 1 <= st.regenerated <= 3 and len(samples) == 4     # empty replies (EOS first) are skipped
