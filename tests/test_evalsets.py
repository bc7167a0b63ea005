"""Offline eval sets (MT-Bench, HumanEval, ShareGPT) and the wheel-asset helper."""
import io
from collections import Counter

import pytest

from mindspore_eagle.evalsets import (
    HUMANEVAL_TEMPLATE,
    _iter_json_array,
    eval_turns,
    humaneval_prompts,
    mtbench_questions,
    sharegpt_conversations,
)
from mindspore_eagle.models import fetch

CATEGORIES = ["writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"]


def _need(fn, *args):
    try:
        return fn(*args)
    except fetch.AssetError as e:
        pytest.skip(f"package index unreachable: {e}")


def test_mtbench_questions():
    qs = _need(mtbench_questions)
    assert len(qs) == 80 and all(len(q["turns"]) == 2 for q in qs)
    assert [q["question_id"] for q in qs] == list(range(81, 161))
    assert Counter(q["category"] for q in qs) == {c: 10 for c in CATEGORIES}


def test_humaneval_prompts():
    ps = humaneval_prompts()
    assert [p["task_id"] for p in ps] == [f"HumanEval/{i}" for i in range(80)]
    assert ps[0]["entry_point"] == "has_close_elements" and "def has_close_elements" in ps[0]["prompt"]


def test_eval_turns_full():
    items = _need(eval_turns)
    assert len(items) == 160 and sum(len(it.turns) for it in items) == 240
    mt = [it for it in items if it.source == "mtbench"]
    he = [it for it in items if it.source == "humaneval"]
    assert len(mt) == 80 and all(len(it.turns) == 2 for it in mt)
    assert len(he) == 80 and all(len(it.turns) == 1 and it.category == "humaneval" for it in he)
    assert he[0].turns[0] == HUMANEVAL_TEMPLATE.format(prompt=humaneval_prompts()[0]["prompt"])
    assert he[0].turns[0].startswith("Complete the following Python function:\n```python\nfrom typing import List")
    # round robin: one per MT-Bench category, then HumanEval, then the next round
    assert [it.id for it in items[:10]] == [f"mtbench/{81 + 10 * i}" for i in range(8)] + ["HumanEval/0",
                                                                                          "mtbench/82"]
    assert [it.category for it in items[:9]] == CATEGORIES + ["humaneval"]
    assert all(it.source == "humaneval" for it in items[90:])
    assert len({it.id for it in items}) == 160


def test_eval_turns_quick_subset():
    items = _need(eval_turns, 18)
    assert sum(len(it.turns) for it in items) == 18
    assert [len(it.turns) for it in items] == [2] * 8 + [1, 1] and items[-1].id == "mtbench/82"
    assert {it.category for it in items} == set(CATEGORIES) | {"humaneval"}
    assert [it.id for it in eval_turns(3)] == ["mtbench/81", "mtbench/91"] and eval_turns(3)[1].turns == \
        [mtbench_questions()[10]["turns"][0]]
    assert [it.id for it in eval_turns(4, subset=["math", "humaneval"])] == ["mtbench/111", "HumanEval/0",
                                                                              "mtbench/112"]
    assert sum(len(it.turns) for it in eval_turns(subset="mtbench")) == 160
    with pytest.raises(ValueError, match="valid"):
        eval_turns(5, subset="poetry")
    with pytest.raises(ValueError, match=r"\[1, 240\]"):
        eval_turns(241)


def test_sharegpt_conversations():
    convs = _need(sharegpt_conversations, 4)
    assert len(convs) == 4
    for conv in convs:
        assert conv[0]["role"] == "user" and all(m["role"] in ("user", "assistant", "system") for m in conv)
        assert all(isinstance(m["content"], str) and m["content"].strip() for m in conv)


def test_truncated_json_array_parser():
    data = b'junk [ {"a": 1}, {"b": [1, 2]} ,\n {"c": "trunc'
    for chunk in (3, 7, 1000):
        assert list(_iter_json_array(io.BytesIO(data), chunk_chars=chunk)) == [{"a": 1}, {"b": [1, 2]}]
    assert list(_iter_json_array(io.BytesIO(b'[{"a": 1}, {"b": 2}]'), chunk_chars=4)) == [{"a": 1}, {"b": 2}]
    assert list(_iter_json_array(io.BytesIO(b"no array"))) == []
