"""The Gated DeltaNet mixer (Qwen3-Next's linear attention) on a packed batch of
sequences, each with its conv and delta-rule state in a state slot.

Per value head ``h`` (its key head ``h // (num_v_heads / num_k_heads)``) and token
``t`` (Yang, Kautz & Hatamizadeh, "Gated Delta Networks", arXiv:2412.06464, eq. 10):

* ``q_t, k_t`` l2-normalised (eps 1e-6), ``q_t`` times ``head_k_dim ** -0.5``;
* ``beta_t = sigmoid(b_t)``, ``g_t = -exp(A_log) * softplus(a_t + dt_bias)`` (log decay);
* ``S_t = exp(g_t) S_{t-1}``; ``S_t += k_t (beta_t (v_t - S_t^T k_t))^T``
  (``S [head_k_dim, head_v_dim]``); ``o_t = S_t^T q_t``;
* ``out = out_proj(gated_rmsnorm(o, z))`` (norm per head, then ``* silu(z)``).

q, k, v come from the causal conv (:mod:`kvpage.models.causal_conv`) of ``in_proj_qkvz``'s
q/k/v parts; z, b, a from ``in_proj_qkvz`` / ``in_proj_ba`` (both laid out per key head:
``[q, k, v-group, z-group]`` and ``[b-group, a-group]``). Prefill runs the chunked form
(the UT transform of each chunk solved by a unit-lower-triangular system, state passed
between chunks of 64), decode the recurrent step. Weight names and numerics follow
transformers 5.23 ``Qwen3NextGatedDeltaNet``, ``torch_chunk_gated_delta_rule``,
``torch_recurrent_gated_delta_rule`` (models/qwen3_next/modeling_qwen3_next.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvpage.attention.state import StateBatch, StateCache
from kvpage.models.causal_conv import conv_packed, reference_conv
from kvpage.models.gated_norm import GatedRMSNorm

#: tokens per chunk of the prefill form (FLA's and transformers' chunk size)
CHUNK_SIZE = 64


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def delta_rule_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule of one sequence, chunk by chunk (float32 math).

    Within a chunk with cumulative log decay ``G_t`` and start state ``S0``, the
    corrections ``u_j = beta_j (v_j - k_j^T S_j^-)`` solve ``(I + A) U = beta V -
    diag(beta e^G) K S0`` with ``A[j, i] = beta_j e^{G_j - G_i} k_j . k_i`` (i < j);
    then ``o_t = e^{G_t} q_t^T S0 + sum_{j<=t} e^{G_t - G_j} (q_t . k_j) u_j`` and
    ``S_end = e^{G_l} S0 + sum_j e^{G_l - G_j} k_j u_j^T``.

    Args:
        q, k: ``[L, H, dk]`` (normalised, q scaled, key heads expanded to value heads).
        v: ``[L, H, dv]``; g, beta: ``[L, H]``; state: ``[H, dk, dv]``.

    Returns:
        ``(o [L, H, dv], end state [H, dk, dv])`` in float32.
    """
    q, k, v, g, beta = (t.float().transpose(0, 1) for t in (q, k, v, g, beta))  # head first
    s = state.float()
    length = q.shape[1]
    outs = []
    for lo in range(0, length, chunk_size):
        hi = min(lo + chunk_size, length)
        qc, kc, vc, bc = q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], beta[:, lo:hi]
        cg = torch.cumsum(g[:, lo:hi], dim=1)  # [H, l]
        n = hi - lo
        lower = torch.ones(n, n, dtype=torch.bool, device=q.device).tril(-1)
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        diff = cg[:, :, None] - cg[:, None, :]  # [H, i, j]
        dec_strict = torch.exp(diff.masked_fill(~lower, float("-inf")))
        dec = torch.exp(diff.masked_fill(~causal, float("-inf")))
        kk = kc @ kc.transpose(1, 2)  # [H, l, l]
        a_mat = bc[:, :, None] * kk * dec_strict
        eye = torch.eye(n, dtype=q.dtype, device=q.device).expand_as(a_mat)
        rhs = bc[:, :, None] * vc - (bc * torch.exp(cg))[:, :, None] * (kc @ s)
        u = torch.linalg.solve_triangular(eye + a_mat, rhs, upper=False, unitriangular=True)
        o = torch.exp(cg)[:, :, None] * (qc @ s) + ((qc @ kc.transpose(1, 2)) * dec) @ u
        outs.append(o)
        to_end = torch.exp(cg[:, -1:] - cg)  # [H, l]
        s = torch.exp(cg[:, -1])[:, None, None] * s + (kc * to_end[:, :, None]).transpose(1, 2) @ u
    o = torch.cat(outs, dim=1) if outs else v.new_zeros(v.shape)
    return o.transpose(0, 1), s


def delta_rule_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrent step for one token of each of ``S`` sequences (float32 math):
    q, k ``[S, H, dk]``, v ``[S, H, dv]``, g, beta ``[S, H]``, state ``[S, H, dk, dv]``
    -> ``(o [S, H, dv], new state)``."""
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    s = state.float() * torch.exp(g)[:, :, None, None]
    mem = torch.einsum("shkv,shk->shv", s, k)
    delta = (v - mem) * beta[:, :, None]
    s = s + k[:, :, :, None] * delta[:, :, None, :]
    return torch.einsum("shkv,shk->shv", s, q), s


class GatedDeltaNet(nn.Module):
    """One Gated DeltaNet mixer (see the module docstring).

    Args:
        hidden_size: model width.
        num_k_heads, num_v_heads: key and value heads (``num_v_heads`` a multiple).
        head_k_dim, head_v_dim: their widths.
        conv_kernel: the conv1d width.
        eps: the gated RMSNorm's epsilon.
        chunk_size: tokens per chunk of the prefill form.

    Parameters (HF names): ``in_proj_qkvz``, ``in_proj_ba``, ``conv1d`` (no bias),
    ``dt_bias``, ``A_log`` ``[num_v_heads]``, ``norm.weight`` ``[head_v_dim]``,
    ``out_proj``.
    """

    def __init__(
        self,
        hidden_size: int,
        num_k_heads: int,
        num_v_heads: int,
        head_k_dim: int,
        head_v_dim: int,
        conv_kernel: int,
        eps: float,
        chunk_size: int = CHUNK_SIZE,
    ) -> None:
        super().__init__()
        self.chunk_size = chunk_size
        self.nk, self.nv, self.dk, self.dv = num_k_heads, num_v_heads, head_k_dim, head_v_dim
        self.key_dim, self.value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.in_proj_qkvz = nn.Linear(
            hidden_size, 2 * self.key_dim + 2 * self.value_dim, bias=False
        )
        self.in_proj_ba = nn.Linear(hidden_size, 2 * num_v_heads, bias=False)
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, conv_kernel, groups=self.conv_dim, bias=False
        )
        self.dt_bias = nn.Parameter(torch.ones(num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(num_v_heads))
        self.norm = GatedRMSNorm(head_v_dim, head_v_dim, eps, norm_before_gate=True)
        self.out_proj = nn.Linear(self.value_dim, hidden_size, bias=False)

    def _project(
        self, hidden: torch.Tensor, double: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(qkv [T, conv_dim]`` (q, k, v channels), ``z [T, nv, dv]``, ``b``, ``a``
        ``[T, nv])`` from the per-key-head layouts of the two projections."""
        t = hidden.shape[0]
        r = self.nv // self.nk
        w1, w2 = self.in_proj_qkvz.weight, self.in_proj_ba.weight
        if double:
            hidden, w1, w2 = hidden.double(), w1.double(), w2.double()
        qkvz = F.linear(hidden, w1).view(t, self.nk, -1)
        ba = F.linear(hidden, w2).view(t, self.nk, 2 * r)
        dk, rv = self.dk, r * self.dv
        q, k = qkvz[..., :dk], qkvz[..., dk : 2 * dk]
        v, z = qkvz[..., 2 * dk : 2 * dk + rv], qkvz[..., 2 * dk + rv :]
        qkv = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=-1)
        b, a = ba[..., :r].reshape(t, self.nv), ba[..., r:].reshape(t, self.nv)
        return qkv, z.reshape(t, self.nv, self.dv), b, a

    def _qkv_heads(
        self, qkv: torch.Tensor, b: torch.Tensor, a: torch.Tensor, double: bool = False
    ) -> tuple[torch.Tensor, ...]:
        """Split the conv output into heads, normalise q/k (q scaled), expand key heads
        to value heads; ``beta``, ``g``. float32 (float64 with ``double``)."""
        t = qkv.shape[0]
        f = torch.float64 if double else torch.float32
        kd = self.key_dim
        q = qkv[:, :kd].reshape(t, self.nk, self.dk).to(f)
        k = qkv[:, kd : 2 * kd].reshape(t, self.nk, self.dk).to(f)
        v = qkv[:, 2 * kd :].reshape(t, self.nv, self.dv).to(f)
        r = self.nv // self.nk
        q = _l2norm(q).repeat_interleave(r, dim=1) * self.dk**-0.5
        k = _l2norm(k).repeat_interleave(r, dim=1)
        # sigmoid in the model dtype as transformers does (b.sigmoid()), then f
        beta = torch.sigmoid(b).to(f) if not double else torch.sigmoid(b.to(f))
        g = -torch.exp(self.A_log.to(f)) * F.softplus(a.to(f) + self.dt_bias.to(f))
        return q, k, v, g, beta

    def forward(self, hidden: torch.Tensor, cache: StateCache, batch: StateBatch) -> torch.Tensor:
        """Mix ``hidden`` ``[num_tokens, hidden_size]`` (sequences packed as in
        ``batch``); returns the same shape and dtype.

        Mutates ``cache``: slot ``batch.state_indices[s]`` of ``conv`` and ``ssm`` ends
        holding sequence ``s``'s state after its last new token (read as zeros first
        where ``has_initial_state[s]`` is False).
        """
        dtype = hidden.dtype
        n = hidden.shape[0]
        qkv, z, b, a = self._project(hidden)
        w = self.conv1d.weight[:, 0, :]
        qkv = conv_packed(qkv, w, None, cache.conv, batch)
        q, k, v, g, beta = self._qkv_heads(qkv, b, a)
        idx, init = batch.initial_rows(cache.ssm)
        init = init.float()
        if batch.is_decode and n == batch.num_seqs:
            o, s = delta_rule_step(q, k, v, g, beta, init)
            cache.ssm[idx] = s.to(cache.ssm.dtype)
        else:
            o = torch.empty(v.shape, dtype=torch.float32, device=v.device)
            qsl = batch.query_start_loc.tolist()
            for i in range(batch.num_seqs):
                lo, hi = qsl[i], qsl[i + 1]
                o[lo:hi], s1 = delta_rule_chunked(
                    q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], init[i], self.chunk_size
                )
                cache.ssm[idx[i]] = s1.to(cache.ssm.dtype)
        # transformers casts the rule's output to the model dtype before the norm
        o = self.norm(o.to(dtype).reshape(n * self.nv, self.dv), z.reshape(n * self.nv, self.dv))
        return F.linear(o.reshape(n, self.value_dim), self.out_proj.weight)

    @torch.no_grad()
    def reference(
        self, hidden: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One sequence token by token in float64 (the recurrence of the module
        docstring as a plain loop): ``hidden [L, hidden_size]``, ``conv_state [conv_dim,
        K - 1]``, ``ssm_state [nv, dk, dv]`` -> ``(out, conv_state, ssm_state)``, float64."""
        qkv, z, b, a = self._project(hidden, double=True)
        qkv, conv_new = reference_conv(qkv, conv_state, self.conv1d.weight[:, 0, :], None)
        q, k, v, g, beta = self._qkv_heads(qkv, b, a, double=True)
        s = ssm_state.double().clone()
        outs = []
        for t in range(hidden.shape[0]):
            for h in range(self.nv):
                s[h] = torch.exp(g[t, h]) * s[h]
                delta = beta[t, h] * (v[t, h] - s[h].T @ k[t, h])
                s[h] = s[h] + torch.outer(k[t, h], delta)
            outs.append(torch.stack([s[h].T @ q[t, h] for h in range(self.nv)]))
        length = hidden.shape[0]
        o = torch.stack(outs) if outs else hidden.new_zeros((0, self.nv, self.dv)).double()
        o = self.norm.reference(o.reshape(-1, self.dv), z.reshape(-1, self.dv))
        return F.linear(o.reshape(length, -1), self.out_proj.weight.double()), conv_new, s


__all__ = ["CHUNK_SIZE", "GatedDeltaNet", "delta_rule_chunked", "delta_rule_step"]
