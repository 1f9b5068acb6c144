"""The Mamba-2 mixer (SSD: structured state-space duality) on a packed batch of
sequences, each with its conv and SSM state in a state slot.

Per head ``h`` (``head_dim`` channels ``p``, state size ``N``, the head's group ``g``
of ``n_groups`` B/C projections) and token ``t`` (Dao & Gu, "Transformers are SSMs",
arXiv:2405.21060, eq. 1 and the SSD algorithm of section 6):

* ``dt_t = clamp(softplus(dt_raw_t + dt_bias), *time_step_limit)``, ``A = -exp(A_log)``;
* ``S_t = exp(dt_t A) S_{t-1} + dt_t x_t B_t^T`` (``S [head_dim, N]``);
* ``y_t = S_t C_t + D x_t``;
* ``out = out_proj(gated_rmsnorm(y, z))`` with ``gated_rmsnorm(y, z) = w *
  rmsnorm_per_group(y * silu(z))`` over ``intermediate_size / n_groups`` channels.

``x``, ``B``, ``C`` come from the causal conv (:mod:`kvpage.models.causal_conv`) of
``in_proj``'s middle part; ``z`` (the gate) and ``dt_raw`` are its first and last parts.
Prefill runs the chunked SSD form (intra-chunk quadratic term + state passing between
chunks of ``chunk_size``), decode the recurrent step; both start at the slot's state.
Weight names and numerics follow transformers 5.23 ``Mamba2Mixer`` /
``MambaRMSNormGated`` (models/mamba2/modeling_mamba2.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvpage.attention.state import StateBatch, StateCache
from kvpage.models.causal_conv import conv_packed, reference_conv
from kvpage.models.gated_norm import GatedRMSNorm


def ssd_chunked(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The SSD scan of one sequence, chunk by chunk (float32 math).

    Args:
        x: ``[L, H, P]`` inputs.
        dt: ``[L, H]`` step sizes (after softplus and clamp).
        a: ``[H]`` ``A`` (negative).
        b, c: ``[L, H, N]`` B and C per head (groups already expanded).
        state: ``[H, P, N]`` state before the first token.
        chunk_size: tokens per chunk.

    Returns:
        ``(y [L, H, P]`` without the D skip, ``end state [H, P, N])`` in float32.
    """
    x, dt, b, c = x.float(), dt.float(), b.float(), c.float()
    s = state.float()
    length = x.shape[0]
    ys = []
    for lo in range(0, length, chunk_size):
        hi = min(lo + chunk_size, length)
        xc, dtc, bc, cc = x[lo:hi], dt[lo:hi], b[lo:hi], c[lo:hi]
        cs = torch.cumsum(dtc * a, dim=0)  # [l, H] log decay from the chunk start
        n = hi - lo
        diff = cs[:, None, :] - cs[None, :, :]  # [i, j, H]: log decay j -> i
        causal = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
        decay = torch.exp(diff.masked_fill(~causal[:, :, None], float("-inf")))
        scores = torch.einsum("ihn,jhn->ijh", cc, bc) * decay  # [i, j, H]
        xdt = xc * dtc[:, :, None]  # [l, H, P]
        y = torch.einsum("ijh,jhp->ihp", scores, xdt)
        y = y + torch.einsum("ihn,hpn->ihp", cc, s) * torch.exp(cs)[:, :, None]
        ys.append(y)
        to_end = torch.exp(cs[-1:] - cs)  # [l, H]
        s = s * torch.exp(cs[-1])[:, None, None] + torch.einsum(
            "jhp,jhn->hpn", xdt * to_end[:, :, None], bc
        )
    y = torch.cat(ys) if ys else x.new_zeros(x.shape)
    return y, s


def ssd_step(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrent step for one token of each of ``S`` sequences (float32 math).

    Args:
        x: ``[S, H, P]``; dt: ``[S, H]``; a: ``[H]``; b, c: ``[S, H, N]``;
        state: ``[S, H, P, N]``.

    Returns:
        ``(y [S, H, P]`` without the D skip, ``new state [S, H, P, N])``.
    """
    x, dt, b, c = x.float(), dt.float(), b.float(), c.float()
    da = torch.exp(dt * a)[:, :, None, None]
    s = state.float() * da + (dt[:, :, None] * x)[:, :, :, None] * b[:, :, None, :]
    y = torch.einsum("shpn,shn->shp", s, c)
    return y, s


class Mamba2Mixer(nn.Module):
    """One Mamba-2 mixer (see the module docstring).

    Args:
        hidden_size: model width.
        num_heads, head_dim: SSM heads (``num_heads * head_dim`` = the mixer width).
        d_state: the state size ``N``.
        n_groups: B/C groups (heads per group ``num_heads / n_groups``).
        conv_kernel: the conv1d width.
        chunk_size: SSD chunk length of the prefill scan.
        eps: the gated RMSNorm's epsilon.
        use_bias, use_conv_bias: biases of in/out_proj and of the conv.
        time_step_limit: ``(lo, hi)`` clamp of ``dt``.
        out_bias: out_proj's bias when it differs from in_proj's (Falcon-H1
            ``projectors_bias``); None = ``use_bias``.
        gated_norm: the output goes through the gated RMSNorm (else ``y * silu(z)``:
            Falcon-H1 without ``mamba_rms_norm``).
        norm_before_gate: the gated norm's order (Falcon-H1 ``mamba_norm_before_gate``).
        in_multiplier: the input is scaled by this (Falcon-H1 ``ssm_in_multiplier``).
        zxbcdt_multipliers: 5 scales of in_proj's z, x, B, C, dt sections (Falcon-H1
            ``ssm_multipliers``, its ``mup_vector``), or None.

    Parameters (HF names): ``in_proj`` ``[2I + 2GN + H, hidden]``, ``conv1d``
    (``[I + 2GN, 1, K]``), ``dt_bias``, ``A_log``, ``D`` ``[H]``, ``norm.weight`` ``[I]``,
    ``out_proj`` ``[hidden, I]``.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        head_dim: int,
        d_state: int,
        n_groups: int,
        conv_kernel: int,
        chunk_size: int,
        eps: float,
        use_bias: bool = False,
        use_conv_bias: bool = True,
        time_step_limit: tuple[float, float] = (0.0, float("inf")),
        out_bias: bool | None = None,
        gated_norm: bool = True,
        norm_before_gate: bool = False,
        in_multiplier: float = 1.0,
        zxbcdt_multipliers: tuple[float, ...] | None = None,
    ) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.d_state = num_heads, head_dim, d_state
        self.n_groups, self.chunk_size, self.eps = n_groups, chunk_size, eps
        self.inter = num_heads * head_dim
        self.conv_dim = self.inter + 2 * n_groups * d_state
        self.time_step_limit = (float(time_step_limit[0]), float(time_step_limit[1]))
        self.in_proj = nn.Linear(hidden_size, self.inter + self.conv_dim + num_heads, bias=use_bias)
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, conv_kernel, groups=self.conv_dim, bias=use_conv_bias
        )
        self.dt_bias = nn.Parameter(torch.ones(num_heads))
        self.A_log = nn.Parameter(torch.zeros(num_heads))
        self.D = nn.Parameter(torch.ones(num_heads))
        self.norm: GatedRMSNorm | None = None
        if gated_norm:
            self.norm = GatedRMSNorm(self.inter, self.inter // n_groups, eps, norm_before_gate)
        self.out_proj = nn.Linear(
            self.inter, hidden_size, bias=use_bias if out_bias is None else out_bias
        )
        self.in_multiplier = float(in_multiplier)
        self.mup: torch.Tensor | None = None
        if zxbcdt_multipliers is not None:
            gn = n_groups * d_state
            sizes = (self.inter, self.inter, gn, gn, num_heads)
            self.mup = torch.cat(
                [  # on the CPU even when the model is built on the meta device
                    torch.full((n,), float(m), device="cpu")
                    for n, m in zip(sizes, zxbcdt_multipliers, strict=True)
                ]
            )

    # ---- pieces shared by the model path and the reference --------------------------
    def _project(self, hidden: torch.Tensor, double: bool = False) -> torch.Tensor:
        """``in_proj(hidden * in_multiplier) * mup`` (``[T, in_proj rows]``)."""
        w: torch.Tensor = self.in_proj.weight
        b: torch.Tensor | None = self.in_proj.bias
        if double:
            hidden, w = hidden.double(), w.double()
            b = None if b is None else b.double()
        if self.in_multiplier != 1.0:
            hidden = hidden * self.in_multiplier
        proj = F.linear(hidden, w, b)
        if self.mup is not None:
            proj = proj * self.mup.to(device=proj.device, dtype=proj.dtype)
        return proj

    def _out(self, y: torch.Tensor, z: torch.Tensor, double: bool = False) -> torch.Tensor:
        """The gated norm (or ``y * silu(z)``) of ``y [T, I]``."""
        if self.norm is None:
            return y * F.silu(z.double() if double else z.float())
        return self.norm.reference(y, z) if double else self.norm(y, z)

    def _split(self, proj: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(z [T, I], xBC [T, conv_dim], dt_raw [T, H])`` of ``in_proj``'s output."""
        i, c = self.inter, self.conv_dim
        return proj[:, :i], proj[:, i : i + c], proj[:, i + c :]

    def _dt(self, dt_raw: torch.Tensor) -> torch.Tensor:
        dt = F.softplus(dt_raw.float() + self.dt_bias.float())
        lo, hi = self.time_step_limit
        return dt.clamp(min=lo, max=hi)

    def _xbc(self, xbc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x [T, H, P]``, ``B``, ``C`` ``[T, H, N]`` (groups expanded to heads)."""
        t = xbc.shape[0]
        i, gn = self.inter, self.n_groups * self.d_state
        x = xbc[:, :i].reshape(t, self.num_heads, self.head_dim)
        rep = self.num_heads // self.n_groups
        b = xbc[:, i : i + gn].reshape(t, self.n_groups, self.d_state)
        c = xbc[:, i + gn :].reshape(t, self.n_groups, self.d_state)
        return x, b.repeat_interleave(rep, dim=1), c.repeat_interleave(rep, dim=1)

    # ---- the packed batch ------------------------------------------------------------
    def forward(self, hidden: torch.Tensor, cache: StateCache, batch: StateBatch) -> torch.Tensor:
        """Mix ``hidden`` ``[num_tokens, hidden_size]`` (sequences packed as in
        ``batch``); returns the same shape and dtype.

        Mutates ``cache``: slot ``batch.state_indices[s]`` of ``conv`` and ``ssm`` ends
        holding sequence ``s``'s state after its last new token (read as zeros first
        where ``has_initial_state[s]`` is False).
        """
        dtype = hidden.dtype
        z, xbc, dt_raw = self._split(self._project(hidden))
        w = self.conv1d.weight[:, 0, :]
        xbc = conv_packed(xbc, w, self.conv1d.bias, cache.conv, batch)
        x, b, c = self._xbc(xbc)
        dt = self._dt(dt_raw)
        a = -torch.exp(self.A_log.float())
        idx, init = batch.initial_rows(cache.ssm)
        init = init.float()
        n = hidden.shape[0]
        if batch.is_decode and n == batch.num_seqs:
            y, s = ssd_step(x, dt, a, b, c, init)
            cache.ssm[idx] = s.to(cache.ssm.dtype)
        else:
            y = torch.empty(x.shape, dtype=torch.float32, device=x.device)
            qsl = batch.query_start_loc.tolist()
            for i in range(batch.num_seqs):
                lo, hi = qsl[i], qsl[i + 1]
                ys, s1 = ssd_chunked(
                    x[lo:hi], dt[lo:hi], a, b[lo:hi], c[lo:hi], init[i], self.chunk_size
                )
                y[lo:hi] = ys
                cache.ssm[idx[i]] = s1.to(cache.ssm.dtype)
        y = y + x.float() * self.D.float()[:, None]
        out = self._out(y.reshape(n, self.inter), z)  # float32 in, as HF's scan output
        res: torch.Tensor = self.out_proj(out.to(dtype))
        return res

    # ---- the float64 reference -------------------------------------------------------
    @torch.no_grad()
    def reference(
        self, hidden: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One sequence token by token in float64 (the recurrence of the module
        docstring as a plain loop): ``hidden [L, hidden_size]``, ``conv_state [conv_dim,
        K - 1]``, ``ssm_state [H, P, N]`` -> ``(out [L, hidden_size], conv_state,
        ssm_state)``, all float64."""
        h64 = hidden.double()
        proj = self._project(hidden, double=True)
        z, xbc, dt_raw = self._split(proj)
        bias = self.conv1d.bias
        xbc, conv_new = reference_conv(xbc, conv_state, self.conv1d.weight[:, 0, :], bias)
        x, b, c = self._xbc(xbc)
        dt = F.softplus(dt_raw + self.dt_bias.double()).clamp(*self.time_step_limit)
        a = -torch.exp(self.A_log.double())
        s = ssm_state.double().clone()
        ys = []
        for t in range(h64.shape[0]):
            for h in range(self.num_heads):
                s[h] = torch.exp(dt[t, h] * a[h]) * s[h] + dt[t, h] * torch.outer(x[t, h], b[t, h])
            ys.append(torch.einsum("hpn,hn->hp", s, c[t]) + self.D.double()[:, None] * x[t])
        y = torch.stack(ys).reshape(len(ys), self.inter) if ys else proj.new_zeros(0, self.inter)
        out = self._out(y, z, double=True)
        o_b = None if self.out_proj.bias is None else self.out_proj.bias.double()
        return F.linear(out, self.out_proj.weight.double(), o_b), conv_new, s


__all__ = ["Mamba2Mixer", "ssd_chunked", "ssd_step"]
