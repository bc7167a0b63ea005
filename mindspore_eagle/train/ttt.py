"""EAGLE-3 training-time-test (TTT) drafter Cell, its batch layout, and the jitted optimiser step.

Legend: T = max_len (fixed sequence length of a batch), S = ttt_length (unrolled draft steps), H = drafter hidden,
Ht = teacher hidden, V = teacher vocab, Vd = draft vocab, nh / n_kv / hd = heads / KV heads / head dim.

Math (eagle3.md §1 and §4; E ``eagle/traineagle3/cnets.py``, SF ``specforge/algorithms/eagle3/model.py``):

* ``h = fc(aux)`` once; for s = 0..S-1: ``e = embed(ids_s)``, ``h_out = midlayer(e, h)`` (same math as
  :class:`~mindspore_eagle.models.eagle3.Eagle3Drafter`), ``logits_s = lm_head(norm(h_out))`` over Vd,
  then ``h <- h_out`` (the **pre-norm** output, P6) and ids/targets/mask move one position left.
* Attention at step s (:func:`ttt_layout` is the reference): the query at position t sees the step-0 keys
  K0[0..t] (causal) plus the diagonal keys K1[t] .. Ks[t] of the same position at every later step, itself
  included; RoPE position t + s for the queries and keys of step s. Implemented in compact form: causal scores
  against K0 concatenated with one dot product per later step (E ``LlamaAttention.forward``).
* Alignment for position t at step s: token ``ids_s[t] = x[t+s+1]``, teacher target = teacher logits at row
  t+s+1 (the distribution of x[t+s+2]), loss mask ``m[t+s+2]`` (the predicted token is an assistant token; the
  mask moves with ids and targets, P11). Ids, targets and masks are shifted on the host (:func:`make_batch`).
* Loss: ``p = softmax(teacher_logits restricted to the draft vocab)`` (rows of the frozen teacher head at the
  draft ids, SF TargetHead), ``pos_mask = loss_mask * t2d[teacher argmax]``,
  ``L_s = -sum_t pos_mask * sum_v p log_softmax(logits_s) / T`` (mean over **all** T positions, P10),
  total = sum_s 0.8^s L_s. Accuracy: d2t-mapped draft argmax == teacher argmax on loss-masked positions
  (positions whose teacher argmax lies outside the draft vocab count as misses, as in E).

Parameters carry the fused layout of the inference Cell (``wqkv`` = q;k;v rows, ``w_gate_up`` = gate;up rows);
:meth:`TTTDrafter.export_tensors` / :meth:`TTTDrafter.load_tensors` convert to / from SpecForge keys.
The embedding and the teacher head rows are frozen (never trained, never exported, P12).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import mindspore as ms
from mindspore import nn, ops, Parameter, Tensor

from ..models.eagle3 import DrafterConfig, load_fused_weights
from ..models.pangu import RMSNorm, apply_rope, rope_swap_index, rope_tables

NEG = -1e9
LOSS_DECAY = 0.8


def ttt_layout(T: int, step: int, n_valid: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Reference attention pattern of TTT step ``step`` in expanded form (keys of steps 0..step concatenated).

    Args:
        T: sequence length; step: s >= 0; n_valid: real tokens (rest is right padding; default T).
    Returns:
        visible bool [T, (s+1) T]: entry [t, j T + u] is True iff query t of step s sees key u of step j;
        j = 0: u <= t (causal over step-0 keys; padded queries t >= n_valid see only key 0, keeping the softmax
        finite), j >= 1: u == t (same position of each later step, itself included).
        q_pos int [T] = t + s (RoPE positions of the queries), k_pos int [(s+1) T] = u + j.
    """
    n = T if n_valid is None else n_valid
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


@dataclass
class Batch:
    """One fixed-shape training batch (numpy), built by :func:`make_batch`.

    Fields: aux float32 [T, 3Ht]; ids int32 [S, T]; hid float32 [T + S, H] (teacher final-normed hidden,
    zero rows after the sequence); tgt int32 [S, T] teacher argmax ids; pos_mask float32 [S, T];
    loss_mask float32 [S, T] (accuracy denominators); n_valid int.
    """
    aux: np.ndarray
    ids: np.ndarray
    hid: np.ndarray
    tgt: np.ndarray
    pos_mask: np.ndarray
    loss_mask: np.ndarray
    n_valid: int

    def tensors(self) -> tuple:
        return (Tensor(self.aux), Tensor(self.ids), Tensor(self.hid), Tensor(self.tgt), Tensor(self.pos_mask))


def make_batch(input_ids, loss_mask, aux, hidden, argmax, t2d: np.ndarray, T: int, S: int) -> Batch:
    """Shift and pad one sample into the TTT layout (eagle3.md §4 "Alignment").

    Args:
        input_ids int [n], loss_mask {0,1} [n] (1 on assistant tokens), aux [n, 3Ht], hidden [n, H] (any float
        dtype; teacher final-normed), argmax int [n] (teacher argmax at each row over the full V), t2d bool [V];
        T: fixed length (n is truncated to T); S: ttt_length.
    Returns:
        Batch (see its fields). Position t of step s uses ids x[t+s+1], target row t+s+1, mask m[t+s+2].
    """
    n = min(len(input_ids), T)
    pad = T + S + 2
    x = np.zeros(pad, np.int64)
    x[:n] = np.asarray(input_ids[:n])
    m = np.zeros(pad, np.float32)
    m[:n] = np.asarray(loss_mask[:n], np.float32)
    g = np.zeros(pad, np.int64)
    g[:n] = np.asarray(argmax[:n])
    a = np.zeros((T, aux.shape[1]), np.float32)
    a[:n] = aux[:n]
    hid = np.zeros((T + S, hidden.shape[1]), np.float32)
    hid[:n] = hidden[:n]
    t = np.arange(T)
    ids = np.stack([x[t + s + 1] for s in range(S)]).astype(np.int32)
    tgt = np.stack([g[t + s + 1] for s in range(S)]).astype(np.int32)
    lm = np.stack([m[t + s + 2] for s in range(S)])
    in_vocab = t2d[tgt].astype(np.float32)
    return Batch(a, ids, hid, tgt, lm * in_vocab, lm, n)


class TTTDrafter(nn.Cell):
    """The drafter with the TTT unroll; ``construct`` returns the weighted loss and per-step statistics.

    construct(aux [T, 3Ht] f32, ids [S, T] i32, hid [T+S, H] f32, tgt [S, T] i32, pos_mask [S, T] f32)
        -> (loss f32 scalar, step_losses f32 [S], step_correct f32 [S])
    ``step_logits(aux, ids0)`` -> log-softmax [T, Vd] of step 0 (used by the consistency test).

    Args:
        cfg: drafter config (H must equal the embedding width).
        embed: teacher embedding float32 [V, H] (frozen). head_rows: teacher lm_head rows at the draft ids,
        float32 [Vd, H] (frozen; SF TargetHead restricted to the draft vocab). d2t: int [Vd] offsets.
        T: sequence length; S: ttt_length.
    """

    def __init__(self, cfg: DrafterConfig, embed: np.ndarray, head_rows: np.ndarray, d2t: np.ndarray,
                 T: int, S: int = 7):
        super().__init__()
        H, F, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
        if embed.shape[1] != H:
            raise ValueError(f"drafter hidden_size {H} != teacher embedding width {embed.shape[1]}")
        self.cfg, self.T, self.S = cfg, T, S
        self.nh, self.nkv, self.hd, self.ffn = cfg.num_attention_heads, cfg.num_key_value_heads, hd, F
        self.group = self.nh // self.nkv
        z = lambda *s: Tensor(np.zeros(s, np.float32))  # noqa: E731
        self.embed = Parameter(Tensor(np.asarray(embed, np.float32)), name="embed", requires_grad=False)
        self.head_rows = Parameter(Tensor(np.asarray(head_rows, np.float32)), name="head_rows",
                                   requires_grad=False)
        self.d2t = Parameter(Tensor(np.asarray(d2t, np.int32)), name="d2t", requires_grad=False)
        self.fc = Parameter(z(H, 3 * cfg.target_hidden_size), name="fc")
        self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.input_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.wqkv = Parameter(z((self.nh + 2 * self.nkv) * hd, 2 * H), name="wqkv")
        self.wo = Parameter(z(H, self.nh * hd), name="wo")
        self.w_gate_up = Parameter(z(2 * F, H), name="w_gate_up")
        self.w_down = Parameter(z(H, F), name="w_down")
        self.lm_head = Parameter(z(cfg.draft_vocab_size, H), name="lm_head")
        cos, sin = rope_tables(hd, T + S, cfg.rope_theta)
        self.cos, self.sin = Tensor(cos[:, None, :]), Tensor(sin[:, None, :])
        self.swap = rope_swap_index(hd)
        self.mask0 = Tensor(causal_bias(T))
        self.matmul_t = ops.MatMul(transpose_b=True)
        self.scale = 1.0 / math.sqrt(hd)
        self.weights = Tensor(np.array([LOSS_DECAY ** s for s in range(S)], np.float32))

    # ------------------------------------------------------------------ network
    def _qkv(self, e, h, s):
        """Projections of step s: q [T, nh, hd], k / v [T, n_kv, hd]; RoPE at positions t + s."""
        T = self.T
        x = ops.concat((self.input_layernorm(e), self.hidden_norm(h)), -1)
        qkv = self.matmul_t(x, self.wqkv)
        nq, nk = self.nh * self.hd, self.nkv * self.hd
        cos, sin = self.cos[s:s + T], self.sin[s:s + T]
        q = apply_rope(qkv[:, :nq].reshape(T, self.nh, self.hd), cos, sin, self.swap)
        k = apply_rope(qkv[:, nq:nq + nk].reshape(T, self.nkv, self.hd), cos, sin, self.swap)
        v = qkv[:, nq + nk:].reshape(T, self.nkv, self.hd)
        return q, k, v

    def _attend(self, q, ks, vs):
        """Compact TTT attention: causal over ks[0], diagonal over ks[1:]; returns [T, nh * hd]."""
        T, nkv, g, hd = self.T, self.nkv, self.group, self.hd
        q4 = q.reshape(T, nkv, g, hd)
        qb = q4.transpose(1, 2, 0, 3).reshape(nkv, g * T, hd)
        scores = ops.bmm(qb, ks[0].transpose(1, 2, 0)).reshape(nkv, g, T, T) * self.scale + self.mask0
        parts = [scores]
        for j in range(1, len(ks)):
            d = (q4 * ks[j].expand_dims(2)).sum(-1) * self.scale          # [T, nkv, g]
            parts.append(d.transpose(1, 2, 0).expand_dims(-1))          # [nkv, g, T, 1]
        probs = ops.softmax(ops.concat(parts, -1) if len(parts) > 1 else scores, -1)
        p0 = probs[..., :T].reshape(nkv, g * T, T)
        ctx = ops.bmm(p0, vs[0].transpose(1, 0, 2)).reshape(nkv, g, T, hd).transpose(2, 0, 1, 3)  # [T,nkv,g,hd]
        for j in range(1, len(ks)):
            pj = probs[..., T + j - 1].transpose(2, 0, 1).expand_dims(-1)  # [T, nkv, g, 1]
            ctx = ctx + pj * vs[j].expand_dims(2)
        return ctx.reshape(T, self.nh * hd)

    def _mid(self, e, h, s, ks, vs):
        q, k, v = self._qkv(e, h, s)
        ks, vs = ks + (k,), vs + (v,)
        h = h + self.matmul_t(self._attend(q, ks, vs), self.wo)
        gu = self.matmul_t(self.post_attention_layernorm(h), self.w_gate_up)
        h_out = h + self.matmul_t(ops.silu(gu[:, :self.ffn]) * gu[:, self.ffn:], self.w_down)
        return h_out, ks, vs

    def construct(self, aux, ids, hid, tgt, pos_mask):
        T = self.T
        tl = self.matmul_t(ops.stop_gradient(hid), self.head_rows)       # teacher logits over Vd [T+S, Vd]
        tp = ops.stop_gradient(ops.softmax(tl, -1))
        h = self.matmul_t(aux, self.fc)
        ks, vs = (), ()
        losses, correct = (), ()
        total = 0.0
        for s in range(self.S):
            e = ops.gather(self.embed, ids[s], 0)
            h, ks, vs = self._mid(e, h, s, ks, vs)
            logp = ops.log_softmax(self.matmul_t(self.norm(h), self.lm_head), -1)
            ce = -(tp[s + 1:s + 1 + T] * logp).sum(-1)                   # [T]
            loss_s = (ce * pos_mask[s]).sum() / T
            am = ops.argmax(logp, -1).astype(ms.int32)
            hit = ops.cast(ops.equal(am + ops.gather(self.d2t, am, 0), tgt[s]), ms.float32)
            losses = losses + (loss_s,)
            correct = correct + ((hit * pos_mask[s]).sum(),)
            total = total + self.weights[s] * loss_s
        return total, ops.stack(losses), ops.stop_gradient(ops.stack(correct))

    def step0_logp(self, aux, ids0):
        """Log-softmax over Vd of TTT step 0: aux [T, 3Ht] f32, ids0 [T] i32 -> [T, Vd] f32."""
        h = self.matmul_t(aux, self.fc)
        h, _, _ = self._mid(ops.gather(self.embed, ids0, 0), h, 0, (), ())
        return ops.log_softmax(self.matmul_t(self.norm(h), self.lm_head), -1)

    # ------------------------------------------------------------------ tensors
    def trainable(self) -> list:
        """The trained Parameters (fc, midlayer, norms, lm_head), in a fixed order."""
        return [self.fc, self.wqkv, self.wo, self.w_gate_up, self.w_down, self.hidden_norm.weight,
                self.input_layernorm.weight, self.post_attention_layernorm.weight, self.norm.weight, self.lm_head]

    def load_tensors(self, t: dict) -> None:
        """Copy SpecForge-keyed float tensors (as from init_drafter_tensors / load_drafter) into the Parameters."""
        load_fused_weights(self, t)

    def export_tensors(self) -> dict:
        """SpecForge-keyed float32 numpy tensors of the trained Parameters (no embedding, no d2t/t2d)."""
        p, hd = "midlayer.", self.hd
        qkv = self.wqkv.asnumpy()
        nq, nk = self.nh * hd, self.nkv * hd
        gu = self.w_gate_up.asnumpy()
        return {
            "fc.weight": self.fc.asnumpy(),
            p + "self_attn.q_proj.weight": qkv[:nq], p + "self_attn.k_proj.weight": qkv[nq:nq + nk],
            p + "self_attn.v_proj.weight": qkv[nq + nk:], p + "self_attn.o_proj.weight": self.wo.asnumpy(),
            p + "mlp.gate_proj.weight": gu[:self.ffn], p + "mlp.up_proj.weight": gu[self.ffn:],
            p + "mlp.down_proj.weight": self.w_down.asnumpy(),
            p + "hidden_norm.weight": self.hidden_norm.weight.asnumpy(),
            p + "input_layernorm.weight": self.input_layernorm.weight.asnumpy(),
            p + "post_attention_layernorm.weight": self.post_attention_layernorm.weight.asnumpy(),
            "norm.weight": self.norm.weight.asnumpy(), "lm_head.weight": self.lm_head.asnumpy(),
        }


def lr_at(step: int, peak: float, warmup: int, total: int, schedule: str = "cosine", floor: float = 0.1) -> float:
    """Learning rate of optimiser step ``step`` (0-based): linear warmup to ``peak`` over ``warmup`` steps, then
    cosine decay to ``floor * peak`` at ``total`` (schedule "cosine") or constant (schedule "constant")."""
    if warmup > 0 and step < warmup:
        return peak * (step + 1) / warmup
    if schedule == "constant" or total <= warmup:
        return peak
    frac = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * frac)))


def _same(grads):
    """Identity gradient reducer (one process)."""
    return grads


class TrainStep:
    """``value_and_grad`` + global-norm clipping + ``nn.AdamWeightDecay`` (betas 0.9/0.95, wd 0) in one ms.jit.

    ``__call__(batch: Batch, lr: float) -> (loss, step_losses [S], step_correct [S])`` as numpy.
    The learning rate is an input of the jitted step, assigned to the optimiser's learning-rate Parameter inside
    the graph (a host ``set_data`` after compilation is not seen by the graph on MindSpore 2.9 CPU); the schedule
    (``lr_at``) is a function of the step, so resuming needs only the step number; optimiser moments are in
    :meth:`state` / :meth:`load_state`. MindSpore's AdamWeightDecay has no bias correction.
    ``grad_reducer``: a Cell applied to the gradient tuple before clipping (``distributed.GradMean``: the mean
    over msrun ranks; default identity). :meth:`grads` + :meth:`apply` split the step for gradient accumulation.
    """

    def __init__(self, net: TTTDrafter, clip: float = 0.5, eps: float = 1e-8, grad_reducer: nn.Cell | None = None):
        self.net = net
        self.opt = nn.AdamWeightDecay(net.trainable(), learning_rate=Tensor(np.float32(1e-4)), beta1=0.9,
                                      beta2=0.95, eps=eps, weight_decay=0.0)
        grad_fn = ms.value_and_grad(net, None, self.opt.parameters, has_aux=True)
        opt = self.opt
        reduce = grad_reducer if grad_reducer is not None else _same

        def apply(grads, lr):   # hook: data-parallel mean over ranks (distributed.GradMean), then clip + AdamW
            grads = ops.depend(ops.clip_by_global_norm(reduce(grads), clip), ops.assign(opt.learning_rate, lr))
            return opt(grads)

        def step(aux, ids, hid, tgt, pos_mask, lr):
            (loss, losses, correct), grads = grad_fn(aux, ids, hid, tgt, pos_mask)
            loss = ops.depend(loss, apply(grads, lr))
            return loss, losses, correct

        self._step = ms.jit(step)
        self._grads = ms.jit(grad_fn)
        self._apply = ms.jit(apply)

    def __call__(self, batch: Batch, lr: float):
        loss, losses, correct = self._step(*batch.tensors(), Tensor(np.float32(lr)))
        return float(loss.asnumpy()), losses.asnumpy(), correct.asnumpy()

    def grads(self, batch: Batch):
        """Forward + backward only: ``((loss, step_losses [S], step_correct [S]), grads)``, Tensors; grads is a
        float32 tuple in the order of :meth:`TTTDrafter.trainable`. Used with :meth:`apply` to accumulate."""
        return self._grads(*batch.tensors())

    def apply(self, grads: tuple, lr: float) -> None:
        """One optimiser step from ``grads`` (as from :meth:`grads`, e.g. a mean over samples): the gradient
        reducer (mean over ranks), global-norm clipping and AdamW, as in ``__call__``."""
        self._apply(ms.mutable(tuple(grads)), Tensor(np.float32(lr)))   # variable input: no recompile per call

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
