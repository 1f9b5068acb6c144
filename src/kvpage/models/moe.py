"""Mixture-of-experts MLP: token-choice top-k routing over a set of GLU experts.

Each token's router logits pick ``top_k`` of ``num_experts`` experts; the token's MLP
output is the routing-weighted sum of those experts' outputs. The routing rule and the
expert's activation are the family's (transformers 5.23 modeling files):

* ``mixtral`` (``MixtralTopKRouter``, ``MixtralExperts`` in
  transformers/models/mixtral/modeling_mixtral.py): ``p = softmax(x W^T)`` in float32,
  the top-k of ``p``, renormalised to sum 1; experts ``w2(silu(w1 x) * w3 x)``.
* ``qwen3_moe`` (``Qwen3MoeTopKRouter``, modeling_qwen3_moe.py): the same, with the
  renormalisation only when ``norm_topk_prob``, weights cast to the model dtype;
  layers listed in ``mlp_only_layers`` or not on the ``decoder_sparse_step`` grid keep
  a dense MLP of ``intermediate_size`` (``Qwen3MoeDecoderLayer``).
* ``gpt_oss`` (``GptOssTopKRouter``, ``GptOssExperts``, modeling_gpt_oss.py): logits
  ``x W^T + b``, the top-k of the *logits*, softmax over those k; experts with biases
  and the clamped SwiGLU ``(clamp(u, -L, L) + 1) * g * sigmoid(alpha * g)`` with
  ``g = min(g, L)`` (``swiglu_alpha``, ``swiglu_limit``); the checkpoint stores
  ``gate_up_proj`` as ``[E, hidden, 2 * I]`` with gate and up columns interleaved.
* ``qwen3_next`` (``Qwen3NextSparseMoeBlock``, modeling_qwen3_next.py): Qwen3-MoE's
  routing plus a shared SwiGLU expert (``shared_expert``) added last, times
  ``sigmoid(shared_expert_gate(x))``.
* ``granitemoehybrid`` (``GraniteMoeHybridTopKRouter``): the top-k of the logits,
  softmax over those k (as gpt-oss, no bias), SwiGLU experts; the layer's
  ``shared_mlp`` is a dense MLP beside it (``kvpage.models.hybrid``).
* ``deepseek_v3`` (``DeepseekV3TopkRouter``, ``DeepseekV3MoE``,
  modeling_deepseek_v3.py): ``noaux_tc`` routing (``kvpage.specs.moe.MoEParams``:
  sigmoid scores in float32, selection by scores + ``e_score_correction_bias`` among
  the best ``topk_group`` of ``n_group`` groups, weights the chosen scores optionally
  renormalised, times ``routed_scaling_factor``) and a shared SwiGLU expert
  (``mlp.shared_experts``) added for every token.

kvpage's parameters: ``mlp.gate.weight`` ``[E, hidden]`` (and ``mlp.gate.bias``
``[E]`` for gpt_oss), ``mlp.experts.<e>.{gate_proj,up_proj,down_proj}`` as
``nn.Linear`` (Qwen3-MoE's checkpoint names; biases for gpt_oss);
:func:`moe_weights_from_hf` maps the other layouts (Mixtral's ``block_sparse_moe``
``w1/w2/w3``, gpt-oss's fused 3-D tensors, and transformers' in-memory fused
``experts.gate_up_proj`` / ``experts.down_proj``) to them, :func:`moe_weights_to_hf`
back to transformers' in-memory form.

The settings come from ``kvpage.specs.moe.moe_params_from_hf`` (the config reader,
shared with capacity planning). The experts run as a plain loop on the step's tokens grouped by expert (one sort of
the ``[tokens * top_k]`` choices, one host read of the per-expert counts, then per
expert that received tokens one fused gate/up matmul and one down matmul over its
rows), which is what a CPU can do without a grouped-GEMM kernel; its cost against a
dense MLP of the same active size is in docs/benchmarks.md ("MoE MLP step").
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from kvpage.attention.protocol import LayerOps
from kvpage.errors import SpecError
from kvpage.models.linears import FusedLinear
from kvpage.specs.moe import MOE_MODEL_TYPES, MoEParams, moe_params_from_hf

#: weights kept in float32 whatever the model dtype (transformers'
#: ``DeepseekV3PreTrainedModel._keep_in_fp32_modules_strict``): the selection bias of
#: ``noaux_tc`` routing, added to float32 scores
FLOAT32_WEIGHTS = ("e_score_correction_bias",)


class Expert(nn.Module):
    """One GLU expert: ``down(act(gate(x), up(x)))``; gate and up as one fused matmul."""

    def __init__(self, hidden: int, inter: int, bias: bool) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=bias)
        self.up_proj = nn.Linear(hidden, inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)
        self._gate_up = FusedLinear([self.gate_proj, self.up_proj])


class MoEMLP(nn.Module):
    """The MoE MLP of one layer (see the module docstring for the formulas).

    Args:
        hidden_size: model width.
        params: the model's :class:`MoEParams`.
    """

    def __init__(self, hidden_size: int, params: MoEParams) -> None:
        super().__init__()
        self.params = params
        self.gate = nn.Linear(hidden_size, params.num_experts, bias=params.bias)
        if params.routing == "noaux_tc":  # DeepseekV3TopkRouter.e_score_correction_bias
            self.gate.register_buffer("e_score_correction_bias", torch.zeros(params.num_experts))
        # the shared expert under its checkpoint name: DeepSeek's ``shared_experts``
        # (ungated), Qwen3-Next's ``shared_expert`` with ``shared_expert_gate``
        self.shared_experts: Expert | None = None
        self.shared_expert: Expert | None = None
        si = params.shared_intermediate_size
        if si and params.shared_expert_gate:
            self.shared_expert = Expert(hidden_size, si, False)
            self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)
        elif si:
            self.shared_experts = Expert(hidden_size, si, False)
        self.experts = nn.ModuleList(
            [
                Expert(hidden_size, params.intermediate_size, params.bias)
                for _ in range(params.num_experts)
            ]
        )

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Router of ``x`` ``[num_tokens, hidden]``: ``(weights [num_tokens, top_k]``
        (float32, or the model dtype where the family casts them), ``experts
        [num_tokens, top_k]`` int64)."""
        p = self.params
        if p.routing == "noaux_tc":
            return self._route_noaux_tc(x)
        logits = F.linear(x, self.gate.weight, self.gate.bias)
        if p.routing == "topk_softmax":
            top, idx = torch.topk(logits, p.top_k, dim=-1)
            return torch.softmax(top, dim=-1), idx
        probs = torch.softmax(logits.float(), dim=-1)
        top, idx = torch.topk(probs, p.top_k, dim=-1)
        if p.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        if p.weights_in_model_dtype:
            top = top.to(x.dtype)
        return top, idx

    def _route_noaux_tc(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """DeepSeek-V3's router (``DeepseekV3TopkRouter.forward``): float32 weights."""
        p = self.params
        t, e = x.shape[0], p.num_experts
        scores = F.linear(x.float(), self.gate.weight.float()).sigmoid()
        bias = self.gate.get_buffer("e_score_correction_bias").float()
        choice = scores + bias
        if p.n_group > 1:
            grouped = choice.view(t, p.n_group, e // p.n_group)
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)  # [t, n_group]
            best = torch.topk(group_scores, k=p.topk_group, dim=-1, sorted=False)[1]
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
            keep = keep.unsqueeze(-1).expand(t, p.n_group, e // p.n_group).reshape(t, e)
            choice = choice.masked_fill(~keep, float("-inf"))
        idx = torch.topk(choice, k=p.top_k, dim=-1, sorted=False)[1]
        w = scores.gather(1, idx)
        if p.norm_topk_prob:
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return w * p.routed_scaling_factor, idx

    def _act(self, gu: torch.Tensor, ops: LayerOps | None) -> torch.Tensor:
        p = self.params
        i = gu.shape[1] // 2  # the expert's width (the shared expert's may differ)
        if p.activation == "silu":
            if ops is not None:
                return ops.silu_mul(gu)
            return F.silu(gu[:, :i]) * gu[:, i:]
        lim = p.swiglu_limit
        g = gu[:, :i].clamp(max=lim)
        u = gu[:, i:].clamp(min=-lim, max=lim)
        return (u + 1) * (g * torch.sigmoid(g * p.swiglu_alpha))

    def _shared(self, se: Expert, x: torch.Tensor, ops: LayerOps | None) -> torch.Tensor:
        """The shared SwiGLU expert on every token of ``x`` ``[num_tokens, hidden]``."""
        return F.linear(self._act(se._gate_up(x), ops), se.down_proj.weight)

    def forward(self, x: torch.Tensor, ops: LayerOps | None = None) -> torch.Tensor:
        """x ``[num_tokens, hidden]`` -> same shape and dtype. ``ops``: a backend's
        ``LayerOps`` for SiLU·mul (None = torch ops)."""
        t = x.shape[0]
        weights, idx = self.route(x)
        out = torch.zeros_like(x)
        if t == 0:
            return out

        k = self.params.top_k
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.params.num_experts).tolist()
        tokens = order // k  # the token of each (token, choice) in expert order
        w = weights.reshape(-1)[order]
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            rows = tokens[start : start + n]
            ex = self.experts[e]
            assert isinstance(ex, Expert)
            h = self._act(ex._gate_up(x.index_select(0, rows)), ops)
            y = F.linear(h, ex.down_proj.weight, ex.down_proj.bias)
            y = y * w[start : start + n, None]
            out.index_add_(0, rows, y.to(out.dtype))
            start += n
        if self.shared_expert is not None:  # Qwen3NextSparseMoeBlock: gated, added last
            gate = torch.sigmoid(F.linear(x, self.shared_expert_gate.weight))
            out = out + gate * self._shared(self.shared_expert, x, ops)
        if self.shared_experts is not None:  # DeepseekV3MoE: routed + shared(x)
            out = out + self._shared(self.shared_experts, x, ops)
        return out


# ---- checkpoint layouts ---------------------------------------------------------------
_LAYER = re.compile(r"^(model\.layers\.\d+\.)(.*)$")


def moe_weights_from_hf(
    sd: Mapping[str, torch.Tensor], params: MoEParams
) -> dict[str, torch.Tensor]:
    """A checkpoint's MoE tensors under kvpage's names (other keys unchanged).

    Accepts the hub layouts (Mixtral ``block_sparse_moe.gate`` and
    ``experts.<e>.w1/w3/w2``; Qwen3-MoE ``mlp.gate`` and ``mlp.experts.<e>.
    {gate,up,down}_proj``, kvpage's own; gpt-oss ``mlp.router`` and fused
    ``mlp.experts.gate_up_proj [E, hidden, 2I]`` (gate/up interleaved),
    ``gate_up_proj_bias``, ``down_proj [E, I, hidden]``, ``down_proj_bias``; Granite-4
    hybrid ``block_sparse_moe.router.layer``, ``input_linear``, ``output_linear``) and
    transformers' in-memory fused form (``mlp.gate``, ``mlp.experts.gate_up_proj
    [E, 2I, hidden]`` gate rows first, ``mlp.experts.down_proj [E, hidden, I]``).

    Raises:
        SpecError: a fused expert tensor of the wrong shape.
    """
    out: dict[str, torch.Tensor] = {}
    n, i = params.num_experts, params.intermediate_size
    gpt = params.family == "gpt_oss"
    for key, v in sd.items():
        m = _LAYER.match(key)
        if m is None:
            out[key] = v
            continue
        pre, rest = m.groups()
        rest = rest.replace("block_sparse_moe.", "mlp.", 1)
        rest = rest.replace("mlp.router.", "mlp.gate.", 1)
        # Granite-4 hybrid's hub layout: router.layer, input_linear [E, 2I, hidden]
        # (gate rows first), output_linear [E, hidden, I]
        rest = rest.replace("mlp.gate.layer.", "mlp.gate.", 1)
        rest = rest.replace("mlp.input_linear.weight", "mlp.experts.gate_up_proj", 1)
        rest = rest.replace("mlp.output_linear.weight", "mlp.experts.down_proj", 1)
        em = re.match(r"^mlp\.experts\.(\d+)\.w([123])\.weight$", rest)
        if em is not None:
            name = {"1": "gate_proj", "2": "down_proj", "3": "up_proj"}[em.group(2)]
            out[f"{pre}mlp.experts.{em.group(1)}.{name}.weight"] = v
            continue
        if rest in ("mlp.experts.gate_up_proj", "mlp.experts.gate_up_proj_bias"):
            bias = rest.endswith("_bias")
            want = (
                (n, 2 * i) if bias else ((n, v.shape[1], 2 * i) if gpt else (n, 2 * i, v.shape[-1]))
            )
            if tuple(v.shape) != want:
                raise SpecError(f"weights[{key}]: expected shape {want}, got {tuple(v.shape)}")
            for e in range(n):
                t = v[e]
                if gpt:  # [hidden, 2I] interleaved columns (bias: [2I] interleaved)
                    g, u = (t[::2], t[1::2]) if bias else (t[:, ::2].T, t[:, 1::2].T)
                else:  # [2I, hidden], gate rows first
                    g, u = t[:i], t[i:]
                suffix = "bias" if bias else "weight"
                out[f"{pre}mlp.experts.{e}.gate_proj.{suffix}"] = g.contiguous()
                out[f"{pre}mlp.experts.{e}.up_proj.{suffix}"] = u.contiguous()
            continue
        if rest in ("mlp.experts.down_proj", "mlp.experts.down_proj_bias"):
            for e in range(n):
                t = v[e]
                if rest.endswith("_bias"):
                    out[f"{pre}mlp.experts.{e}.down_proj.bias"] = t.contiguous()
                else:  # gpt-oss [I, hidden]; in-memory Mixtral/Qwen [hidden, I]
                    w = t.T if gpt else t
                    out[f"{pre}mlp.experts.{e}.down_proj.weight"] = w.contiguous()
            continue
        out[pre + rest] = v
    return out


def moe_weights_to_hf(sd: Mapping[str, torch.Tensor], params: MoEParams) -> dict[str, torch.Tensor]:
    """kvpage's MoE tensors in transformers' in-memory form (the inverse of
    :func:`moe_weights_from_hf` for that form): ``mlp.gate`` (gpt-oss ``mlp.router``),
    fused ``mlp.experts.gate_up_proj`` / ``down_proj`` (and gpt-oss's biases)."""
    out: dict[str, torch.Tensor] = {}
    gpt = params.family == "gpt_oss"
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for key, v in sd.items():
        m = re.match(r"^(model\.layers\.\d+\.)mlp\.experts\.(\d+)\.(\w+)\.(weight|bias)$", key)
        if m is None:
            if gpt and ".mlp.gate." in key:
                key = key.replace(".mlp.gate.", ".mlp.router.")
            out[key] = v
            continue
        pre, e, name, kind = m.groups()
        experts.setdefault(pre, {}).setdefault(int(e), {})[f"{name}.{kind}"] = v
    for pre, by_e in experts.items():
        es = [by_e[e] for e in sorted(by_e)]
        if gpt:
            gu = []
            for x in es:
                g, u = x["gate_proj.weight"].T, x["up_proj.weight"].T  # [hidden, I]
                gu.append(torch.stack([g, u], dim=-1).reshape(g.shape[0], -1))
            out[pre + "mlp.experts.gate_up_proj"] = torch.stack(gu)
            gub = [
                torch.stack([x["gate_proj.bias"], x["up_proj.bias"]], -1).reshape(-1) for x in es
            ]
            out[pre + "mlp.experts.gate_up_proj_bias"] = torch.stack(gub)
            out[pre + "mlp.experts.down_proj"] = torch.stack([x["down_proj.weight"].T for x in es])
            out[pre + "mlp.experts.down_proj_bias"] = torch.stack([x["down_proj.bias"] for x in es])
        else:
            out[pre + "mlp.experts.gate_up_proj"] = torch.stack(
                [torch.cat([x["gate_proj.weight"], x["up_proj.weight"]]) for x in es]
            )
            out[pre + "mlp.experts.down_proj"] = torch.stack([x["down_proj.weight"] for x in es])
    return out


__all__ = [
    "FLOAT32_WEIGHTS",
    "MOE_MODEL_TYPES",
    "Expert",
    "MoEMLP",
    "MoEParams",
    "moe_params_from_hf",
    "moe_weights_from_hf",
    "moe_weights_to_hf",
]
