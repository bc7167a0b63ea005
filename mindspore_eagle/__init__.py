"""mindspore_eagle: EAGLE-3 tree speculative decoding for Pangu / Llama-family teachers on MindSpore.

A small EAGLE-3 drafter proposes a tree of candidate tokens, the teacher verifies the whole tree in one
forward, the longest accepted path plus one bonus token is committed. Greedy output equals teacher-only
greedy decoding token for token; sampling follows the teacher's distribution exactly.

Entry points: ``python -m mindspore_eagle`` / ``mindspore-eagle`` (cli.py), :mod:`mindspore_eagle.serving.engine`.
"""
__version__ = "0.1.0"
