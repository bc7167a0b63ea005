"""Data-parallel drafter training under ``msrun``: ranks, sharding of each global batch, gradient mean over ranks.

Legend: W = world size (ranks), r = this rank, G = global batch (samples per optimiser step, ``--batch-size``),
B = G / W samples (rows) per rank and step, S = ttt_length.

Launch (MindSpore's dynamic cluster, ``mindspore.parallel.cluster.run``): ``msrun --worker_num W
--local_worker_num W [--join True] python -m mindspore_eagle.train ...`` starts W worker processes with
``MS_ROLE=MS_WORKER``, ``RANK_ID``/``MS_NODE_ID`` = r, ``RANK_SIZE`` = W, ``DEVICE_ID`` = local rank,
``MS_WORKER_NUM``, ``MS_SCHED_HOST``/``MS_SCHED_PORT``, and one more copy of the same command as the scheduler
(``MS_ROLE=MS_SCHED``) that only serves the cluster. ``mindspore.communication.init()`` joins the cluster with the
default backend of the device: ``mccl`` on CPU (MindSpore's own TCP ring all-reduce, SUM only on CPU per
``comm_func.all_reduce``'s docstring), ``hccl`` on Ascend.

Data-parallel step (global batch G = ``--batch-size``, one sample per row, no packing):
* the training stream is ``batching.stream_sample(p)`` over stream positions p = 0, 1, ...; the step that starts
  at stream cursor c (c = kG at optimiser step k) uses positions [c, c + G); rank r takes the contiguous slice
  [c + rB, c + (r+1)B) (:func:`local_positions`), i.e. rows rB .. (r+1)B-1 of the single-process batch, and the
  cursor advances by G on every rank;
* each rank runs ONE batched ``ttt.TrainStep`` over its B rows (batch loss = mean of its B per-sample losses),
  with ``grad_reduce`` = :class:`GradMean` (all-reduce SUM, times 1/W) inside the jitted step, right after
  ``value_and_grad`` and before clipping. Every rank has the same B, so the mean of the W rank means is the mean
  over the G samples: W x B rows equal 1 process x WB rows up to the order of float additions. Clipping and
  the AdamW update then run identically on every rank;
* the logged statistics are reduced over ranks (:func:`reduce_step_stats`): loss and per-TTT-step losses are
  the mean of the rank means, hits / loss-masked positions / samples / tokens are sums, so rank 0's log line
  is the single-process line (up to float32 rounding of the loss);
* the held-out evaluation is split over ranks (rank r scores held-out samples r, r + W, ...) and its counts
  summed (``trainer.evaluate``);
* packing (``--pack-len``) is refused with W > 1: packed rows hold a variable number of samples per rank, so a
  mean of rank means would weight ranks wrongly (:func:`check_batch`);
* identical initial weights come from the same seed and the same (deterministic) draft vocabulary on every rank,
  checked with :func:`fingerprint` (:meth:`DistContext.check_same`) at the start and at every checkpoint;
* rank 0 alone writes checkpoints, the logs, the summary and the export; the resume state holds the optimiser
  step and the global stream cursor, so a resumed run (any W dividing G) repeats the uninterrupted curve.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

import numpy as np
from mindspore import Tensor, nn, ops

from mindspore_eagle.errors import MsEagleError


class DistError(MsEagleError, ValueError):
    """Bad launch environment or batch configuration (one line naming the field and the allowed range)."""


def check_batch(global_batch: int, world: int, pack_len: int = 0) -> int:
    """Rows (samples) per rank B = G / W for global batch G = ``--batch-size`` over W ranks.

    Raises:
        DistError: G < 1, G not a multiple of W, or ``pack_len`` > 0 with W > 1 (packing is one process only).
    """
    if global_batch < 1:
        raise DistError(f"--batch-size must be >= 1 (samples per optimiser step), got {global_batch}")
    if pack_len and world > 1:
        raise DistError(f"--pack-len {pack_len} is not supported with data parallelism ({world} msrun ranks); "
                        f"use --pack-len 0 (one sample per row)")
    if global_batch % world:
        raise DistError(f"--batch-size {global_batch} must be a multiple of the number of ranks "
                        f"(RANK_SIZE={world}); use {world * max(1, round(global_batch / world))}")
    return global_batch // world


def local_positions(cursor: int, global_batch: int, rank: int, world: int) -> np.ndarray:
    """Stream positions (int64 [B], B = G / W) of rank ``rank``'s rows in the step that starts at stream
    position ``cursor``: cursor + rB .. cursor + (r+1)B - 1.

    Invariant: over r = 0..W-1 the slices are disjoint and their union is range(cursor, cursor + G), in order.
    Raises:
        DistError: bad G / W (see :func:`check_batch`) or rank outside [0, W).
    """
    b = check_batch(global_batch, world)
    if not 0 <= rank < world:
        raise DistError(f"rank {rank} is out of range for {world} ranks")
    return cursor + rank * b + np.arange(b, dtype=np.int64)


def fingerprint(arrays) -> np.ndarray:
    """float32 [32]: the bytes of SHA-256 over ``arrays`` (in order; dtype, shape and data), each in [0, 255].

    Small integers so that a float32 all-reduce of (x, x^2) is exact for any practical W (W * 255^2 < 2^24).
    """
    h = hashlib.sha256()
    for a in arrays:
        a = np.ascontiguousarray(a)
        h.update(f"{a.dtype}{a.shape}".encode())
        h.update(a.tobytes())
    return np.frombuffer(h.digest(), np.uint8).astype(np.float32)


def all_equal_from_sums(s1: np.ndarray, s2: np.ndarray, world: int) -> bool:
    """True iff W values x_r with sum s1 and sum of squares s2 are all equal (W * s2 == s1^2, Cauchy-Schwarz)."""
    return bool(np.all(world * np.asarray(s2, np.float64) == np.asarray(s1, np.float64) ** 2))


class GradMean(nn.Cell):
    """Mean over ranks of a gradient tuple: all-reduce SUM, then times 1/W (float32, same shapes).

    construct(grads: tuple of float32 Tensors [any shape]) -> tuple of the same shapes. With W = 1 it returns
    ``grads`` unchanged (no communication). Used as ``ttt.TrainStep(grad_reduce=...)``, i.e. inside the jitted
    step on the gradient tuple that ``value_and_grad`` builds in the graph (no host tuple of Tensors crosses the
    jit boundary; one that did would have to be passed as ``ms.mutable(tuple(...))``, or the graph would
    recompile on every call). Also callable eagerly.
    """

    def __init__(self, world: int):
        super().__init__()
        self.world = world
        self.scale = Tensor(np.float32(1.0 / world))
        self.allreduce = ops.AllReduce() if world > 1 else None    # ReduceOp.SUM over the world group

    def construct(self, grads):
        if self.world == 1:
            return grads
        return tuple(self.allreduce(g) * self.scale for g in grads)


@dataclass
class DistContext:
    """This process's place in the job: ``rank`` r in [0, world), ``world`` W >= 1, ``scheduler`` True only for
    msrun's scheduler process (which must exit without training). ``launched`` True when
    ``mindspore.communication`` was initialised (W > 1 is only possible then)."""
    rank: int = 0
    world: int = 1
    launched: bool = False
    scheduler: bool = False

    @property
    def is_main(self) -> bool:
        """Rank 0: the only writer of checkpoints, logs, the summary and the export."""
        return self.rank == 0

    def grad_reduce(self):
        """``TrainStep(grad_reduce=...)``: :class:`GradMean` over the W ranks, or None (identity) when W = 1."""
        return GradMean(self.world) if self.world > 1 else None

    def sum(self, x: np.ndarray) -> np.ndarray:
        """Element-wise sum over ranks of a host array (float32 all-reduce; returned as float64 [same shape])."""
        x = np.asarray(x, np.float64)
        if self.world == 1:
            return x
        out = ops.AllReduce()(Tensor(x.astype(np.float32)))
        return out.asnumpy().astype(np.float64)

    def check_same(self, arrays, what: str = "weights") -> None:
        """Verify that ``arrays`` are bit-identical on every rank (collective: every rank must call it).

        Raises:
            RuntimeError: they differ on some rank (e.g. a different feature set or vocabulary per rank).
        """
        if self.world == 1:
            return
        f = fingerprint(arrays)
        s = self.sum(np.concatenate([f, f * f]))
        if not all_equal_from_sums(s[:f.size], s[f.size:], self.world):
            raise RuntimeError(f"the {what} differ between the {self.world} ranks (rank {self.rank}); every rank "
                               f"must read the same --features-dir and start from the same seed / --init-from")


def _env_int(env: dict, name: str, default: int) -> int:
    v = env.get(name)
    if v in (None, ""):
        return default
    try:
        return int(v)
    except ValueError:
        raise DistError(f"environment variable {name} must be an integer, got {v!r}") from None


def init_from_env(env: dict | None = None) -> DistContext:
    """Join the msrun cluster when launched by msrun, else a single-process context.

    Reads ``MS_ROLE`` (msrun: ``MS_WORKER`` / ``MS_SCHED``), ``RANK_ID`` and ``RANK_SIZE``. Under msrun it calls
    ``mindspore.communication.init()`` (backend from the device target set before: mccl on CPU, hccl on Ascend),
    so call it after :func:`mindspore_eagle.kernels.runtime.configure` and before building any network. In the scheduler
    process ``init()`` serves the cluster (measured on MindSpore 2.9.0, CPU: it never returns; the process exits
    0 when the workers are done); should it return, the result is ``DistContext(scheduler=True)``: exit then.

    Raises:
        DistError: malformed RANK_ID / RANK_SIZE, or RANK_SIZE > 1 without msrun (no MS_ROLE: nothing to
            communicate through), or ranks that disagree with what the cluster reports.
    """
    env = os.environ if env is None else env
    role = env.get("MS_ROLE")
    _env_int(env, "RANK_ID", 0)  # a malformed RANK_ID is refused; the rank itself comes from the cluster
    world = _env_int(env, "RANK_SIZE", 1)
    if role is None:
        if world > 1:
            raise DistError(f"RANK_SIZE={world} but this process was not started by msrun (no MS_ROLE); launch "
                            f"with `msrun --worker_num {world} --local_worker_num {world} python -m "
                            f"mindspore_eagle.train ...` (docs/training_distributed.md)")
        return DistContext()
    from mindspore.communication import get_group_size, get_rank, init

    init()
    if role == "MS_SCHED":
        return DistContext(scheduler=True, launched=True)
    got_rank, got_world = get_rank(), get_group_size()
    if "RANK_SIZE" in env and got_world != world:
        raise DistError(f"RANK_SIZE={world} but the msrun cluster has {got_world} workers")
    return DistContext(rank=got_rank, world=got_world, launched=True)


def reduce_step_stats(ctx: "DistContext", loss: float, losses: np.ndarray, correct: np.ndarray,
                      masked: np.ndarray, samples: int, tokens: int):
    """Statistics of one data-parallel step over all ranks (collective: every rank calls it every step).

    Args: this rank's ``loss`` (mean over its B samples), ``losses`` [S] (per TTT step, mean over its samples),
    ``correct`` / ``masked`` [S] (hits / loss-masked positions), ``samples`` and ``tokens`` (real tokens).
    Returns:
        the same tuple for the global batch (identical on every rank): loss and losses = mean over ranks (the
        global mean when every rank has the same B), correct / masked float64 [S] and samples / tokens int =
        sums. With W = 1 the arguments are returned unchanged. Counts are exact below 2^24 (float32 all-reduce).
    """
    if ctx.world == 1:
        return loss, losses, correct, masked, samples, tokens
    S = len(losses)
    v = ctx.sum(np.concatenate([[loss], losses, correct, masked, [samples, tokens]]))
    W = ctx.world
    return (float(v[0] / W), v[1:1 + S] / W, v[1 + S:1 + 2 * S], v[1 + 2 * S:1 + 3 * S], int(round(v[-2])),
            int(round(v[-1])))
