"""mindspore_eagle: EAGLE-3 tree speculative decoding for Pangu / Llama-family teachers on MindSpore.

A small EAGLE-3 drafter proposes a tree of candidate tokens, the teacher verifies the whole tree in one
forward, the longest accepted path plus one bonus token is committed. Greedy output equals teacher-only
greedy decoding token for token; sampling follows the teacher's distribution exactly.

Entry points: ``python -m mindspore_eagle`` / ``mindspore-eagle`` (cli.py), :mod:`mindspore_eagle.serving.engine`.
"""
__version__ = "0.1.0"

import os as _os

# The CPU kernels (kernels/cpu.py) run their threads through OpenMP inside MindSpore's graphs. OpenMP's default lets
# idle threads spin after each call, which takes the cores MindSpore's own ops run on next: a decode forward took
# 35 ms with spinning threads and 28.5 ms with sleeping ones (2-core VM; docs/cpu_kernels.md). libgomp reads this
# once, when MindSpore first loads it, so it is set here, before anything imports mindspore; a value the user set
# is kept.
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
