"""EAGLE-3 training-time-test (TTT) drafter Cell and the jitted optimiser step (batch layout: batching.py).

Legend: B = rows of a batch, T = row length (tokens; max_len when unpacked), S = ttt_length (unrolled draft
steps), H = drafter hidden, Ht = teacher hidden, V = teacher vocab, Vd = draft vocab, nh / n_kv / hd = heads /
KV heads / head dim, kmax = top-k width of the evaluation outputs.

Math (docs/design.md, "Drafter architecture" and "Drafter training"; E ``eagle/traineagle3/cnets.py``, SF
``specforge/algorithms/eagle3/model.py``):

* ``h = fc(aux)`` once (with ``fc_norm``: ``fc(concat_c(rmsnorm_c(aux_c)))``, one weighted RMSNorm per captured
  layer's Ht-wide chunk, SF ``project_hidden_states``); for s = 0..S-1: ``e = embed(ids_s)``,
  ``h_out = midlayer(e, h)`` then each later layer (``num_hidden_layers`` > 1, each with its own step-by-step
  keys) (same math as :class:`~mindspore_eagle.models.eagle3.Eagle3Drafter`), ``logits_s = lm_head(norm(h_out))`` over Vd,
  then ``h <- h_out`` (the **pre-norm** output) and ids/targets/mask move one position left. Step s thus
  conditions on the drafter's **own** previous outputs h (as at inference) but on the **true** tokens ids_s
  (at inference: the drafted tokens; the two agree on an accepted path of the teacher's own greedy reply).
* Attention at step s (:func:`ttt_layout` is the reference for one sample): the query at position t sees the
  step-0 keys K0[0..t] (causal, and only keys of its own segment, ``seg``) plus the diagonal keys K1[t] ..
  Ks[t] of the same position at every later step, itself included; RoPE position pos[t] + s for the queries
  and keys of step s (pos = position inside the sample). Implemented in compact form: causal scores against
  K0 concatenated with one dot product per later step (E ``LlamaAttention.forward``).
* Alignment for position t at step s: token ``ids_s[t] = x[t+s+1]``, teacher target = teacher logits at row
  t+s+1 (the distribution of x[t+s+2]), loss mask ``m[t+s+2]`` (the predicted token is an assistant token; the
  mask moves with ids and targets). Ids, targets and masks are shifted per sample on the host
  (:func:`~mindspore_eagle.train.batching.sample_arrays`), so nothing crosses a sample boundary in packed rows.
* Loss of one sample: ``p = softmax(teacher_logits restricted to the draft vocab)`` (rows of the frozen teacher
  head at the draft ids, SF TargetHead), ``pos_mask = loss_mask * t2d[teacher argmax]``,
  ``L_s = -sum_t pos_mask * sum_v p log_softmax(logits_s) / max_len`` (mean over **all** max_len positions,
  as E), total = sum_s 0.8^s L_s. With ``argmax_weight`` a > 0 the target is ``(1 - a) p + a onehot(argmax p)``:
  part of the loss is the cross-entropy on the teacher's greedy token, the token that greedy verification
  accepts (a = 0 is the EAGLE-3 loss; docs/training.md, ``--argmax-weight``). Loss of a batch = the mean over its
  ``n_samples`` samples (the sums run over all rows, divided by max_len * n_samples), so its gradient is the mean
  of the per-sample gradients.
  Accuracy: d2t-mapped draft argmax == teacher argmax on loss-masked positions (positions whose teacher argmax
  lies outside the draft vocab count as misses, as in E).

Parameters carry the fused layout of the inference Cell (``wqkv`` = q;k;v rows, ``w_gate_up`` = gate;up rows);
:meth:`TTTDrafter.export_tensors` / :meth:`TTTDrafter.load_tensors` convert to / from SpecForge keys.
The embedding and the teacher head rows are frozen (never trained, never exported).
"""
from __future__ import annotations

import math

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops

from mindspore_eagle.models.eagle3 import (
    DrafterConfig,
    declare_drafter_weights,
    export_fused_weights,
    load_fused_weights,
)
from mindspore_eagle.models.llama import apply_rope, rope_swap_index, rope_tables
from mindspore_eagle.train.batching import Batch, make_batch  # noqa: F401  (re-exported: the batch layout lives in batching.py)

NEG = -1e9
LOSS_DECAY = 0.8


def ttt_layout(T: int, step: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Reference attention pattern of TTT step ``step`` in expanded form (keys of steps 0..step concatenated).

    Args:
        T: sequence length; step: s >= 0.
    Returns:
        visible bool [T, (s+1) T]: entry [t, j T + u] is True iff query t of step s sees key u of step j;
        j = 0: u <= t (causal over step-0 keys), j >= 1: u == t (same position of each later step, itself
        included). Right padding needs no special case: a real query t never sees a key u > t, and every query
        sees at least key t, so each softmax row stays finite.
        q_pos int [T] = t + s (RoPE positions of the queries), k_pos int [(s+1) T] = u + j.
    """
    vis = np.zeros((T, (step + 1) * T), bool)
    for t in range(T):
        vis[t, : t + 1] = True
        for j in range(1, step + 1):
            vis[t, j * T + t] = True
    q_pos = np.arange(T) + step
    k_pos = np.concatenate([np.arange(T) + j for j in range(step + 1)])
    return vis, q_pos, k_pos


def causal_bias(T: int) -> np.ndarray:
    """Additive float32 [T, T] mask over step-0 keys (0 visible, -1e9 hidden): the j = 0 block of ttt_layout."""
    return np.where(np.tri(T, dtype=bool), 0.0, NEG).astype(np.float32)


class TTTDrafter(nn.Cell):
    """The drafter with the TTT unroll; ``construct`` returns the batch loss and per-step statistics.

    construct(aux [B, T, 3Ht] f32, ids [S, B, T] i32, hid [B, T+S, H] f32, tgt [S, B, T] i32,
              pos_mask [S, B, T] f32, seg [B, T] i32, pos [B, T] i32, n_samples f32 scalar)
        -> (loss f32 scalar, step_losses f32 [S], step_correct f32 [S])
    (the inputs are ``Batch.tensors()``; any B, one compiled graph per shape).
    ``eval_topk(same inputs)`` -> the same three plus topk int32 [S, B, T, kmax]: the teacher ids (d2t-mapped)
    of the kmax largest draft logits at each position, best first (for ``coverage.coverage_counts``).
    ``step0_logp(aux [T, 3Ht], ids0 [T])`` -> log-softmax [T, Vd] of step 0 (used by the consistency test).

    Args:
        cfg: drafter config (H must equal the embedding width).
        embed: teacher embedding float32 [V, H] (frozen). head_rows: teacher lm_head rows at the draft ids,
        float32 [Vd, H] (frozen; SF TargetHead restricted to the draft vocab). d2t: int [Vd] offsets.
        T: row length; S: ttt_length; max_len: the per-sample loss normaliser (default T; the sample length
        limit when rows are packed longer than one sample); kmax: top-k width of ``eval_topk``;
        argmax_weight: a in [0, 1], the share of the target on the teacher's argmax (module docstring).
    Raises:
        ValueError: H differs from the embedding width, max_len outside 1..T, kmax outside 1..Vd, or
            argmax_weight outside [0, 1].
    """

    def __init__(self, cfg: DrafterConfig, embed: np.ndarray, head_rows: np.ndarray, d2t: np.ndarray,
                 T: int, S: int = 7, max_len: int | None = None, kmax: int = 4, argmax_weight: float = 0.0):
        super().__init__()
        H, F, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
        if embed.shape[1] != H:
            raise ValueError(f"drafter hidden_size {H} != teacher embedding width {embed.shape[1]}")
        max_len = T if max_len is None else max_len
        if not 1 <= max_len <= T:
            raise ValueError(f"max_len {max_len} must be in 1..T = {T}")
        if not 1 <= kmax <= cfg.draft_vocab_size:
            raise ValueError(f"kmax {kmax} must be in 1..Vd = {cfg.draft_vocab_size}")
        if not 0.0 <= argmax_weight <= 1.0:
            raise ValueError(f"argmax_weight {argmax_weight} must be in [0, 1]")
        self.cfg, self.T, self.S, self.max_len, self.kmax = cfg, T, S, max_len, kmax
        self.argmax_weight = float(argmax_weight)
        self.nh, self.nkv, self.hd, self.ffn = cfg.num_attention_heads, cfg.num_key_value_heads, hd, F
        self.group = self.nh // self.nkv
        self.embed = Parameter(Tensor(np.asarray(embed, np.float32)), name="embed", requires_grad=False)
        self.head_rows = Parameter(Tensor(np.asarray(head_rows, np.float32)), name="head_rows",
                                   requires_grad=False)
        self.d2t = Parameter(Tensor(np.asarray(d2t, np.int32)), name="d2t", requires_grad=False)
        declare_drafter_weights(self, cfg, ms.float32)
        cos, sin = rope_tables(hd, T + S, cfg.rope_theta)
        self.cos, self.sin = Tensor(cos), Tensor(sin)
        self.swap = rope_swap_index(hd)
        self.tri = Tensor(np.tri(T, dtype=np.float32))
        self.matmul_t = ops.MatMul(transpose_b=True)
        self.scale = 1.0 / math.sqrt(hd)
        self.weights = Tensor(np.array([LOSS_DECAY ** s for s in range(S)], np.float32))

    # ------------------------------------------------------------------ network
    def _lin(self, x, w):
        """x [..., in] @ w[out, in].T -> [..., out] (one 2-D MatMul)."""
        return self.matmul_t(x.reshape(-1, x.shape[-1]), w).reshape(x.shape[:-1] + (w.shape[0],))

    def _qkv(self, x, wqkv, pos, s):
        """Projections of step s from the normed layer input x [B, T, in]: q [B, T, nh, hd], k / v [B, T, n_kv,
        hd]; RoPE at positions pos + s."""
        B, T = x.shape[0], self.T
        qkv = self._lin(x, wqkv)
        nq, nk = self.nh * self.hd, self.nkv * self.hd
        p = pos + s
        cos, sin = ops.gather(self.cos, p, 0).expand_dims(2), ops.gather(self.sin, p, 0).expand_dims(2)
        q = apply_rope(qkv[..., :nq].reshape(B, T, self.nh, self.hd), cos, sin, self.swap)
        k = apply_rope(qkv[..., nq:nq + nk].reshape(B, T, self.nkv, self.hd), cos, sin, self.swap)
        v = qkv[..., nq + nk:].reshape(B, T, self.nkv, self.hd)
        return q, k, v

    def _attend(self, q, ks, vs, bias):
        """Compact TTT attention: masked (bias [B, T, T]) over ks[0], diagonal over ks[1:] -> [B, T, nh*hd]."""
        B, T, nkv, g, hd = q.shape[0], self.T, self.nkv, self.group, self.hd
        q4 = q.reshape(B, T, nkv, g, hd)
        qb = q4.transpose(0, 2, 3, 1, 4).reshape(B * nkv, g * T, hd)
        k0 = ks[0].transpose(0, 2, 3, 1).reshape(B * nkv, hd, T)
        scores = ops.bmm(qb, k0).reshape(B, nkv, g, T, T) * self.scale + bias.expand_dims(1).expand_dims(1)
        parts = [scores]
        for j in range(1, len(ks)):
            d = (q4 * ks[j].expand_dims(3)).sum(-1) * self.scale               # [B, T, nkv, g]
            parts.append(d.transpose(0, 2, 3, 1).expand_dims(-1))            # [B, nkv, g, T, 1]
        probs = ops.softmax(ops.concat(parts, -1) if len(parts) > 1 else scores, -1)
        p0 = probs[..., :T].reshape(B * nkv, g * T, T)
        v0 = vs[0].transpose(0, 2, 1, 3).reshape(B * nkv, T, hd)
        ctx = ops.bmm(p0, v0).reshape(B, nkv, g, T, hd).transpose(0, 3, 1, 2, 4)  # [B, T, nkv, g, hd]
        for j in range(1, len(ks)):
            pj = probs[..., T + j - 1].transpose(0, 3, 1, 2).expand_dims(-1)  # [B, T, nkv, g, 1]
            ctx = ctx + pj * vs[j].expand_dims(3)
        return ctx.reshape(B, T, self.nh * hd)

    def _mid(self, e, h, pos, s, kvs, bias):
        """All decoder layers at TTT step s. kvs: per layer (keys, values) of steps 0..s-1 (tuples of [B, T, n_kv,
        hd]); returns h_out [B, T, H] (pre-norm) and kvs with step s appended."""
        x = ops.concat((self.input_layernorm(e), self.hidden_norm(h)), -1)
        h, kv0 = self._block(x, h, pos, s, kvs[0], bias, self.wqkv, self.wo, self.post_attention_layernorm,
                             self.w_gate_up, self.w_down)
        out = (kv0,)
        for i, blk in enumerate(self.blocks):
            h, kvi = self._block(blk.input_layernorm(h), h, pos, s, kvs[i + 1], bias, blk.wqkv, blk.wo,
                                 blk.post_attention_layernorm, blk.w_gate_up, blk.w_down)
            out = out + (kvi,)
        return h, out

    def _block(self, x, h, pos, s, kv, bias, wqkv, wo, post_ln, w_gate_up, w_down):
        """One layer: attention of the normed input x over this layer's keys of steps 0..s, residual h, MLP."""
        q, k, v = self._qkv(x, wqkv, pos, s)
        ks, vs = kv[0] + (k,), kv[1] + (v,)
        h = h + self._lin(self._attend(q, ks, vs, bias), wo)
        gu = self._lin(post_ln(h), w_gate_up)
        return h + self._lin(ops.silu(gu[..., :self.ffn]) * gu[..., self.ffn:], w_down), (ks, vs)

    def _fc_in(self, aux):
        """The input of ``fc``: aux [B, T, 3Ht] as it is, or with ``cfg.fc_norm`` each chunk RMS-normed (float32)
        and scaled by its weight (``fc_norm`` [3Ht], the three chunks' weights end to end)."""
        if self.fc_norm is None:
            return aux
        B, T, w = aux.shape
        x = aux.reshape(B, T, 3, w // 3)
        x = x * ops.rsqrt((x * x).mean(-1, keep_dims=True) + self.cfg.rms_norm_eps)
        return x.reshape(B, T, w) * self.fc_norm

    def _no_kv(self):
        """Empty per-layer key / value history (before step 0)."""
        return tuple(((), ()) for _ in range(self.cfg.num_hidden_layers))

    def _bias(self, seg):
        """Additive mask [B, T, T]: 0 where key u <= query t and seg[u] == seg[t], -1e9 elsewhere."""
        same = ops.cast(ops.equal(seg.expand_dims(2), seg.expand_dims(1)), ms.float32)
        return (same * self.tri - 1.0) * (-NEG)

    def _forward(self, aux, ids, hid, tgt, pos_mask, seg, pos, n_samples, with_topk: bool):
        T = self.T
        tl = self._lin(ops.stop_gradient(hid), self.head_rows)          # teacher logits over Vd [B, T+S, Vd]
        tp = ops.stop_gradient(ops.softmax(tl, -1))
        h = self._lin(self._fc_in(aux), self.fc)
        bias = self._bias(seg)
        denom = n_samples * self.max_len
        kvs = self._no_kv()
        losses, correct, tops = (), (), ()
        total = 0.0
        for s in range(self.S):
            e = ops.gather(self.embed, ids[s], 0)
            h, kvs = self._mid(e, h, pos, s, kvs, bias)
            logp = ops.log_softmax(self._lin(self.norm(h), self.lm_head), -1)   # [B, T, Vd]
            ce = -(tp[:, s + 1:s + 1 + T] * logp).sum(-1)                     # [B, T]
            if self.argmax_weight > 0.0:                                       # part of the target on the argmax
                top = ops.argmax(tl[:, s + 1:s + 1 + T], -1).astype(ms.int32)  # draft index of the teacher's pick
                nll = -ops.gather_elements(logp, -1, top.expand_dims(-1)).squeeze(-1)
                ce = (1.0 - self.argmax_weight) * ce + self.argmax_weight * nll
            loss_s = (ce * pos_mask[s]).sum() / denom
            am = ops.argmax(logp, -1).astype(ms.int32)
            hit = ops.cast(ops.equal(am + ops.gather(self.d2t, am, 0), tgt[s]), ms.float32)
            losses = losses + (loss_s,)
            correct = correct + ((hit * pos_mask[s]).sum(),)
            total = total + self.weights[s] * loss_s
            if with_topk:
                _, idx = ops.topk(ops.stop_gradient(logp), self.kmax)
                tops = tops + (idx + ops.gather(self.d2t, idx, 0),)
        out = (total, ops.stack(losses), ops.stop_gradient(ops.stack(correct)))
        return out + (ops.stack(tops),) if with_topk else out

    def construct(self, aux, ids, hid, tgt, pos_mask, seg, pos, n_samples):
        return self._forward(aux, ids, hid, tgt, pos_mask, seg, pos, n_samples, False)

    def eval_topk(self, aux, ids, hid, tgt, pos_mask, seg, pos, n_samples):
        """construct's outputs plus the d2t-mapped top-kmax draft ids int32 [S, B, T, kmax] (forward only)."""
        return self._forward(aux, ids, hid, tgt, pos_mask, seg, pos, n_samples, True)

    def step0_logp(self, aux, ids0):
        """Log-softmax over Vd of TTT step 0 for one unpacked row: aux [T, 3Ht] f32, ids0 [T] i32 -> [T, Vd]."""
        T = self.T
        h = self._lin(self._fc_in(aux.expand_dims(0)), self.fc)
        pos = ops.arange(0, T, dtype=ms.int32).expand_dims(0)
        bias = self._bias(ops.zeros((1, T), ms.int32))
        h, _ = self._mid(ops.gather(self.embed, ids0.expand_dims(0), 0), h, pos, 0, self._no_kv(), bias)
        return ops.log_softmax(self._lin(self.norm(h), self.lm_head), -1)[0]

    # ------------------------------------------------------------------ tensors
    def trainable(self) -> list:
        """The trained Parameters (fc, midlayer, norms, lm_head, then each later layer's, then ``fc_norm`` when the
        config has it), in a fixed order."""
        out = [self.fc, self.wqkv, self.wo, self.w_gate_up, self.w_down, self.hidden_norm.weight,
               self.input_layernorm.weight, self.post_attention_layernorm.weight, self.norm.weight, self.lm_head]
        for blk in self.blocks:
            out += [blk.wqkv, blk.wo, blk.w_gate_up, blk.w_down, blk.input_layernorm.weight,
                    blk.post_attention_layernorm.weight]
        return out + ([self.fc_norm] if self.fc_norm is not None else [])

    def load_tensors(self, t: dict) -> None:
        """Copy SpecForge-keyed float tensors (as from init_drafter_tensors / load_drafter) into the Parameters."""
        load_fused_weights(self, t)

    def export_tensors(self) -> dict:
        """SpecForge-keyed float32 numpy tensors of the trained Parameters (no embedding, no d2t/t2d)."""
        return export_fused_weights(self)


def lr_at(step: int, peak: float, warmup: int, total: int, schedule: str = "cosine", floor: float = 0.1) -> float:
    """Learning rate of optimiser step ``step`` (0-based): linear warmup to ``peak`` over ``warmup`` steps, then
    cosine decay to ``floor * peak`` at ``total`` (schedule "cosine") or constant (schedule "constant")."""
    if warmup > 0 and step < warmup:
        return peak * (step + 1) / warmup
    if schedule == "constant" or total <= warmup:
        return peak
    frac = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * frac)))


def _identity(grads):
    return grads


class TrainStep:
    """``value_and_grad`` + global-norm clipping + ``nn.AdamWeightDecay`` (betas 0.9/0.95, wd 0) in one ms.jit.

    ``__call__(batch: Batch, lr: float) -> (loss, step_losses [S], step_correct [S])`` as numpy.
    ``grads(batch) -> list of float32 numpy arrays`` (the unclipped gradients of the batch loss, in the order
    of ``net.trainable()``; no update; for tests).

    One optimiser step per batch of any number of samples: the batch loss is the mean of the per-sample losses
    (``TTTDrafter``), so the step's gradient is the mean of the per-sample gradients before clipping.

    **Data-parallel hook.** ``grad_reduce`` (default: identity) is applied to the gradient tuple inside the
    jitted step right after ``value_and_grad`` and **before** global-norm clipping and the optimiser; that is
    the one place for a per-worker gradient all-reduce (mean over workers of each worker's batch-mean gradient
    equals the gradient of the mean loss when every worker holds the same number of samples; otherwise weight
    each worker by its ``n_samples``). Clipping after the reduction keeps every worker's update identical.
    ``grad_reduce`` is called inside ``ms.jit`` on the tuple of float32 gradient Tensors (shapes of
    ``net.trainable()``) and must return a tuple of the same shapes: a Cell such as ``distributed.GradMean``
    (msrun: all-reduce SUM, times 1/W) or a graph-compilable function.

    The learning rate is an input of the jitted step, assigned to the optimiser's learning-rate Parameter inside
    the graph (a host ``set_data`` after compilation is not seen by the graph on MindSpore 2.9 CPU); the schedule
    (``lr_at``) is a function of the step, so resuming needs only the step number; optimiser moments are in
    :meth:`state` / :meth:`load_state`. MindSpore's AdamWeightDecay has no bias correction.
    """

    def __init__(self, net: TTTDrafter, clip: float = 0.5, eps: float = 1e-8, grad_reduce=None):
        self.net = net
        self.opt = nn.AdamWeightDecay(net.trainable(), learning_rate=Tensor(np.float32(1e-4)), beta1=0.9,
                                      beta2=0.95, eps=eps, weight_decay=0.0)
        grad_fn = ms.value_and_grad(net, None, self.opt.parameters, has_aux=True)
        opt = self.opt
        reduce = grad_reduce if grad_reduce is not None else _identity

        def step(aux, ids, hid, tgt, pos_mask, seg, pos, n_samples, lr):
            (loss, losses, correct), grads = grad_fn(aux, ids, hid, tgt, pos_mask, seg, pos, n_samples)
            grads = reduce(grads)                 # <- the data-parallel all-reduce goes here (see docstring)
            grads = ops.depend(ops.clip_by_global_norm(grads, clip), ops.assign(opt.learning_rate, lr))
            loss = ops.depend(loss, opt(grads))
            return loss, losses, correct

        self._step = ms.jit(step)
        self._grad_fn = grad_fn

    def __call__(self, batch: Batch, lr: float):
        loss, losses, correct = self._step(*batch.tensors(), Tensor(np.float32(lr)))
        return float(loss.asnumpy()), losses.asnumpy(), correct.asnumpy()

    def grads(self, batch: Batch) -> list:
        """Unclipped gradients of the batch loss w.r.t. ``net.trainable()`` (float32 numpy, PyNative)."""
        _, g = self._grad_fn(*batch.tensors())
        return [x.asnumpy() for x in g]

    def state(self) -> dict:
        """Optimiser state as numpy: moments (name 'm:<param>' / 'v:<param>') and the global step."""
        out = {}
        for p, m1, m2 in zip(self.opt.parameters, self.opt.moments1, self.opt.moments2):
            out["m:" + p.name] = m1.asnumpy()
            out["v:" + p.name] = m2.asnumpy()
        out["global_step"] = self.opt.global_step.asnumpy()
        return out

    def load_state(self, state: dict) -> None:
        """Inverse of :meth:`state`. Raises KeyError naming a missing entry."""
        for p, m1, m2 in zip(self.opt.parameters, self.opt.moments1, self.opt.moments2):
            m1.set_data(Tensor(state["m:" + p.name]))
            m2.set_data(Tensor(state["v:" + p.name]))
        self.opt.global_step.set_data(Tensor(state["global_step"]))
