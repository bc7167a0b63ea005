"""runners/drafter.py on the tiny openPangu teacher: the drafter's context window, and batched drafting equal to
per-sequence drafting."""
import numpy as np
import pytest
from tiny_engines import PROMPTS, tiny_drafter_dir, tiny_engine


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory, tiny):
    return tiny_drafter_dir(tmp_path_factory.mktemp("drafter"), tiny[0])


def test_drafter_window_truncation_masks_old_context(ms_runtime, tiny_dir, drafter_dir):
    """With speculative.window = W the drafter's queries see only the last W context pairs (paper Table 3);
    the teacher is unchanged, so the output stays identical."""
    eng, cfg = tiny_engine(tiny_dir, drafter_dir, "eager", ["speculative.window=8", "speculative.D_max=3"])
    seen = []
    orig_call = eng.drafter._call

    def spy_call(which, *args):           # every drafter call: context passes and tree expansion steps
        seen.append((np.asarray(args[2]).copy(), np.asarray(args[5]).copy()))       # positions, mask
        return orig_call(which, *args)

    eng.drafter._call = spy_call
    gen = cfg.generation
    gen.max_new_tokens = 6
    g = eng.generate(PROMPTS[1], gen)
    assert g.token_ids == eng.generate(PROMPTS[1], gen, speculative=False).token_ids
    for positions, mask in seen:
        visible = mask > -1
        ctx_cols = visible.sum(axis=1)
        assert ctx_cols.max() <= 8 + 3 * 4        # at most W context pairs (+ tree ancestors in tree steps)
    first_pos, first_mask = seen[0]               # context pass over the whole prompt
    row = int(np.argmax(first_pos))
    assert np.flatnonzero(first_mask[row] > -1).tolist() == list(range(first_pos[row] - 7, first_pos[row] + 1))


@pytest.mark.slow
def test_draft_batch_equals_per_sequence_drafting(ms_runtime, tiny, tiny_dir, tmp_path):
    """DrafterRunner.draft_batch (context passes and expansion steps batched across sequences, each group over its
    own block table, one pad group) gives every sequence the tree that extend + build_tree give it alone: same
    tokens and parents, scores to float32 rounding; a long context pass (> BATCH_EXTEND_MAX pairs) runs alone."""
    from mindspore_eagle.runners.drafter import BATCH_EXTEND_MAX

    d = tiny_drafter_dir(tmp_path, tiny[0])
    one, _ = tiny_engine(tiny_dir, d, "fused", ["speculative.M=8", "speculative.D_max=4"])
    bat, _ = tiny_engine(tiny_dir, d, "fused", ["speculative.M=8", "speculative.D_max=4"])
    assert bat.drafter.grouped
    rng = np.random.default_rng(3)
    H3 = 3 * tiny[0].hidden_size
    s1 = [one.drafter.new_seq() for _ in range(3)]
    s2 = [bat.drafter.new_seq() for _ in range(3)]
    for rnd, lens in enumerate(((5, BATCH_EXTEND_MAX + 9, 1), (1, 3, 2), (4, 1, 16))):
        pending = [(rng.standard_normal((m, H3)).astype(np.float32), rng.integers(3, 200, size=m)) for m in lens]
        roots = [int(x) for x in rng.integers(3, 200, size=3)]
        want = [one.drafter.build_tree(sid, r, one.drafter.extend(sid, a, t), 8, 4)
                for sid, (a, t), r in zip(s1, pending, roots)]
        got = bat.drafter.draft_batch(s2, pending, roots, 8, 4, groups=4)
        for w, g in zip(want, got):
            assert list(g.tokens) == list(w.tokens) and list(g.parents) == list(w.parents), rnd
            assert np.abs(np.asarray(g.scores) - np.asarray(w.scores)).max() < 1e-4
        assert [bat.drafter.bm.length(x) for x in s2] == [one.drafter.bm.length(x) for x in s1]
    with pytest.raises(ValueError, match="groups"):
        bat.drafter.draft_batch(s2, pending, roots, 8, 4, groups=2)
