"""Data-parallel drafter training under ``msrun``: ranks, sharding of each global batch, gradient mean over ranks.

Legend: W = world size (ranks), r = this rank, G = global batch (samples per optimiser step, ``--batch-size``),
B = G / W samples per rank and step, S = ttt_length, P = trainable Parameters.

Launch (MindSpore's dynamic cluster, ``mindspore.parallel.cluster.run``): ``msrun --worker_num W
--local_worker_num W [--join True] python -m mindspore_eagle.train ...`` starts W worker processes with
``MS_ROLE=MS_WORKER``, ``RANK_ID``/``MS_NODE_ID`` = r, ``RANK_SIZE`` = W, ``DEVICE_ID`` = local rank,
``MS_WORKER_NUM``, ``MS_SCHED_HOST``/``MS_SCHED_PORT``, and one more copy of the same command as the scheduler
(``MS_ROLE=MS_SCHED``) that only serves the cluster. ``mindspore.communication.init()`` joins the cluster with the
default backend of the device: ``mccl`` on CPU (MindSpore's own TCP ring all-reduce, SUM only on CPU per
``comm_func.all_reduce``'s docstring), ``hccl`` on Ascend.

Data-parallel step (global batch G, same math as one process accumulating G samples):
* the global sample stream is the trainer's ``sample_order(p)`` over stream positions p = 0, 1, ...; optimiser
  step k uses positions [kG, (k+1)G); rank r takes the contiguous slice [kG + rB, kG + (r+1)B)
  (:func:`local_positions`);
* each rank averages the gradients of its B samples, then :class:`GradMean` all-reduces (SUM) and multiplies by
  1/W, so every rank holds the mean gradient over the G samples: W x B equals 1 x WB up to the order of float
  additions. Clipping and the AdamW update then run identically on every rank;
* identical initial weights come from the same seed and the same (deterministic) draft vocabulary on every rank,
  checked with :func:`fingerprint` (:meth:`DistContext.check_same`);
* rank 0 alone writes checkpoints, the log, the summary and the export; the resume state holds only the
  optimiser step, so a resumed run (any W dividing G) repeats the uninterrupted curve.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

import numpy as np
from mindspore import Tensor, nn, ops


class DistError(ValueError):
    """Bad launch environment or batch configuration (one line naming the field and the allowed range)."""


def check_batch(global_batch: int, world: int) -> int:
    """Samples per rank B = G / W.

    Raises:
        DistError: G < 1, or G not a multiple of W.
    """
    if global_batch < 1:
        raise DistError(f"--batch-size must be >= 1 (samples per optimiser step), got {global_batch}")
    if global_batch % world:
        raise DistError(f"--batch-size {global_batch} must be a multiple of the number of ranks "
                        f"(RANK_SIZE={world}); use {world * max(1, round(global_batch / world))}")
    return global_batch // world


def local_positions(step: int, global_batch: int, rank: int, world: int) -> np.ndarray:
    """Stream positions (int64 [B]) that rank ``rank`` trains on at optimiser step ``step``.

    Invariant: over r = 0..W-1 the slices are disjoint and their union is range(step G, (step + 1) G), in order.
    Raises:
        DistError: bad G / W (see :func:`check_batch`) or rank outside [0, W).
    """
    b = check_batch(global_batch, world)
    if not 0 <= rank < world:
        raise DistError(f"rank {rank} is out of range for {world} ranks")
    return step * global_batch + rank * b + np.arange(b, dtype=np.int64)


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
    ``grads`` unchanged (no communication). Usable inside ``mindspore.jit`` (the optimiser step) and eagerly.
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

    def grad_reducer(self):
        """:class:`GradMean` for the optimiser step (identity when W = 1)."""
        return GradMean(self.world)

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
    so call it after :func:`mindspore_eagle.runtime.configure` and before building any network. In the scheduler
    process ``init()`` serves the cluster (measured on MindSpore 2.9.0, CPU: it never returns; the process exits
    0 when the workers are done); should it return, the result is ``DistContext(scheduler=True)``: exit then.

    Raises:
        DistError: malformed RANK_ID / RANK_SIZE, or RANK_SIZE > 1 without msrun (no MS_ROLE: nothing to
            communicate through), or ranks that disagree with what the cluster reports.
    """
    env = os.environ if env is None else env
    role = env.get("MS_ROLE")
    rank, world = _env_int(env, "RANK_ID", 0), _env_int(env, "RANK_SIZE", 1)
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


def data_parallel_step(ts, batches: list, lr: float, ctx: DistContext) -> dict:
    """One optimiser step on this rank's B samples of a global batch of G = W B: mean gradient over the B local
    samples, then ``ts.apply`` (its :class:`GradMean` makes it the mean over all G), clip, AdamW.

    Args:
        ts: ``ttt.TrainStep`` built with ``grad_reducer=ctx.grad_reducer()``; batches: B ``ttt.Batch``.
    Returns:
        global statistics over the G samples (identical on every rank): ``loss`` float (mean of the per-sample
        TTT losses, ttt.py docstring), ``losses`` float64 [S] (mean), ``correct`` / ``masked`` float64 [S] (sums
        of hits / loss-masked positions), ``tokens`` int (sum of real tokens).
    """
    total, loss, losses, correct = None, 0.0, 0.0, 0.0
    for b in batches:
        (l, ls, c), g = ts.grads(b)
        total = g if total is None else tuple(a + x for a, x in zip(total, g))
        loss, losses, correct = loss + float(l.asnumpy()), losses + ls.asnumpy(), correct + c.asnumpy()
    if len(batches) > 1:
        inv = Tensor(np.float32(1.0 / len(batches)))
        total = tuple(x * inv for x in total)
    ts.apply(total, lr)
    S = len(losses)
    masked = np.sum([b.loss_mask.sum(1) for b in batches], 0)
    tokens = sum(b.n_valid for b in batches)
    v = ctx.sum(np.concatenate([[loss], losses, correct, masked, [tokens]]))
    G = len(batches) * ctx.world
    return {"loss": float(v[0] / G), "losses": v[1:1 + S] / G, "correct": v[1 + S:1 + 2 * S],
            "masked": v[1 + 2 * S:1 + 3 * S], "tokens": int(round(v[-1]))}
