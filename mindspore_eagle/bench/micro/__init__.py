"""Micro-benchmarks behind figures of the manual, each run as ``python -m mindspore_eagle.bench.micro.<name>``
(its docstring says what it prints; ``--help`` lists its options). Not tests: figures only.

- ``forward``: the teacher's forward (decode, prefill, k query rows) beside numpy and llama.cpp, the drafter's
  cost per round; docs/performance.md, docs/design.md, docs/cpu_kernels.md, docs/install.md.
- ``kernels``: one CPU kernel (attention or the packed matmul) over a teacher's layers, for one or more builds of
  the kernel library; docs/cpu_kernels.md.
- ``linear_rows``: the CPU matmul kernel on a teacher-sized MLP pair by row count; docs/cpu_kernels.md, "Tiles".
- ``matmul_forms``: three matmul formulations of the teacher's weight stack (behind ``kernels/dense.linear``);
  docs/design.md.
- ``drafter_calls``: the drafter's calls, hot and right after a teacher decode; docs/design.md,
  docs/cpu_kernels.md.
- ``dtype_forward``: one teacher forward in float32 against float16; docs/ascend.md.
- ``dtype_agreement``: float16 against float32 greedy, speculative float16 against teacher-only float16;
  docs/ascend.md.
- ``batch_rows``: one batched teacher forward (decode of n sequences, verification of n x m rows) by row count;
  docs/performance.md, "Continuous batching".
- ``policy_replay``: the drafter's candidate trees at every position of greedy replies, and policies replayed on
  them; docs/design.md.
"""
