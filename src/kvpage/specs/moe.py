"""Mixture-of-experts settings of an HF ``config.json``: expert counts, top-k, the
family's routing rule and expert activation, and which layers are sparse.

The one reader of these keys: ``kvpage.models.moe`` builds the MoE MLP from them and
``kvpage.capacity`` counts the parameters with them. Sources per family (transformers
5.23): ``MixtralTopKRouter`` / ``MixtralExperts`` (models/mixtral/modeling_mixtral.py),
``Qwen3MoeTopKRouter`` / ``Qwen3MoeDecoderLayer`` (models/qwen3_moe/modeling_qwen3_moe.py),
``GptOssTopKRouter`` / ``GptOssExperts`` (models/gpt_oss/modeling_gpt_oss.py),
``DeepseekV3TopkRouter`` / ``DeepseekV3MoE`` / ``DeepseekV3DecoderLayer``
(models/deepseek_v3/modeling_deepseek_v3.py; DeepSeek-V3 report arXiv:2412.19437,
section 2.1.2: sigmoid affinities, the auxiliary-loss-free bias used for selection
only, node/group-limited routing).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvpage.errors import SpecError
from kvpage.specs.architectures import MOE_MODEL_TYPES


@dataclass(frozen=True)
class MoEParams:
    """The MoE settings of one model.

    Attributes:
        family: ``mixtral`` | ``qwen3_moe`` | ``gpt_oss`` | ``deepseek_v3`` (checkpoint
            layout and rules).
        num_experts: experts per MoE layer (``num_local_experts`` / ``num_experts``).
        top_k: experts per token (``num_experts_per_tok``), ``1 <= top_k <= num_experts``.
        intermediate_size: each expert's hidden width (``moe_intermediate_size`` for
            Qwen3-MoE, ``intermediate_size`` otherwise).
        routing: ``softmax_topk`` (softmax over all experts, then the top-k),
            ``topk_softmax`` (top-k of the logits, softmax over them: gpt-oss) or
            ``noaux_tc`` (DeepSeek-V3: ``s = sigmoid(logits)`` in float32; experts
            chosen by ``s + e_score_correction_bias`` within the ``topk_group`` best of
            ``n_group`` groups (a group's score: the sum of its two best); weights
            ``s`` of the chosen, divided by their sum + 1e-20 when ``norm_topk_prob``,
            times ``routed_scaling_factor``).
        norm_topk_prob: renormalise the top-k probabilities to sum 1 (``softmax_topk``).
        weights_in_model_dtype: cast the routing weights to the model dtype (Qwen3-MoE)
            rather than keeping them float32 (Mixtral).
        bias: router and experts carry biases (gpt-oss).
        activation: ``silu`` (SwiGLU) or ``clamped_swiglu`` (gpt-oss).
        swiglu_alpha, swiglu_limit: gpt-oss's ``alpha`` and clamp ``L``.
        sparse_layers: the layers whose MLP is the MoE (others: a dense MLP).
        shared_intermediate_size: width of the shared expert every token also runs
            (Qwen3-Next ``shared_expert_intermediate_size``; DeepSeek
            ``moe_intermediate_size * n_shared_experts``; 0 = none).
        shared_expert_gate: the shared expert's output is multiplied by
            ``sigmoid(shared_expert_gate(x))`` (Qwen3-Next ``Qwen3NextSparseMoeBlock``;
            DeepSeek's is added ungated).
        n_group, topk_group: ``noaux_tc`` group limiting (experts in ``n_group``
            equal groups, only the ``topk_group`` best groups eligible).
        routed_scaling_factor: ``noaux_tc`` weight multiplier.
    """

    family: str
    num_experts: int
    top_k: int
    intermediate_size: int
    routing: str
    norm_topk_prob: bool
    weights_in_model_dtype: bool
    bias: bool
    activation: str
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    sparse_layers: tuple[int, ...] = ()
    shared_intermediate_size: int = 0
    shared_expert_gate: bool = False
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0


def _int(cfg: Mapping[str, Any], *keys: str) -> int:
    for k in keys:
        v = cfg.get(k)
        if v is not None:
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise SpecError(f"config.{k}: expected a positive integer, got {v!r}")
            return v
    raise SpecError(f"config.{keys[0]}: expected a value, got nothing")


def moe_params_from_hf(cfg: Mapping[str, Any], num_layers: int) -> MoEParams | None:
    """The MoE settings of an HF ``config.json`` mapping, None for a dense family.

    Raises:
        SpecError: missing or invalid expert counts, ``top_k`` above the expert count,
            a gpt-oss activation other than SiLU, or a non-positive SwiGLU limit.
    """
    mt = cfg.get("model_type")
    if mt not in MOE_MODEL_TYPES:
        return None
    if mt == "deepseek_v3":
        return _deepseek_params(cfg, num_layers)
    if mt == "qwen3_next" and not cfg.get("num_experts"):
        return None  # Qwen3NextDecoderLayer: num_experts 0 = dense MLPs only
    if mt == "granitemoehybrid":  # GraniteMoeHybridTopKRouter: softmax of the top-k logits
        if not cfg.get("num_local_experts"):
            return None  # only the shared MLP
        n, k = _int(cfg, "num_local_experts"), _int(cfg, "num_experts_per_tok")
        if k > n:
            raise SpecError(f"config.num_experts_per_tok: expected <= {n} experts, got {k}")
        return MoEParams(
            family=mt,
            num_experts=n,
            top_k=k,
            intermediate_size=_int(cfg, "intermediate_size"),
            routing="topk_softmax",
            norm_topk_prob=False,
            weights_in_model_dtype=True,
            bias=False,
            activation="silu",
            sparse_layers=tuple(range(num_layers)),
        )
    qwen = mt in ("qwen3_moe", "qwen3_next")
    if qwen:
        n = _int(cfg, "num_experts", "num_local_experts")
        inter = _int(cfg, "moe_intermediate_size")
    else:
        n = _int(cfg, "num_local_experts", "num_experts")
        inter = _int(cfg, "intermediate_size")
    k = _int(cfg, "num_experts_per_tok")
    if k > n:
        raise SpecError(f"config.num_experts_per_tok: expected <= {n} experts, got {k}")
    layers = tuple(range(num_layers))
    if qwen:  # Qwen3MoeDecoderLayer / Qwen3NextDecoderLayer: which layers are sparse
        only = set(cfg.get("mlp_only_layers") or [])
        step = int(cfg.get("decoder_sparse_step") or 1)
        layers = tuple(i for i in layers if i not in only and (i + 1) % step == 0)
    if mt == "gpt_oss":
        _check_silu(cfg, mt)
        limit = float(cfg.get("swiglu_limit", 7.0))
        if not limit > 0:
            raise SpecError(f"config.swiglu_limit: expected > 0, got {limit}")
        return MoEParams(
            family=mt,
            num_experts=n,
            top_k=k,
            intermediate_size=inter,
            routing="topk_softmax",
            norm_topk_prob=False,
            weights_in_model_dtype=True,
            bias=True,
            activation="clamped_swiglu",
            swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
            swiglu_limit=limit,
            sparse_layers=layers,
        )
    return MoEParams(
        family=mt,
        num_experts=n,
        top_k=k,
        intermediate_size=inter,
        routing="softmax_topk",
        norm_topk_prob=True if mt == "mixtral" else bool(cfg.get("norm_topk_prob", False)),
        weights_in_model_dtype=qwen,
        bias=False,
        activation="silu",
        sparse_layers=layers,
        shared_intermediate_size=(
            _int(cfg, "shared_expert_intermediate_size") if mt == "qwen3_next" else 0
        ),
        shared_expert_gate=mt == "qwen3_next",
    )


def _check_silu(cfg: Mapping[str, Any], family: str) -> None:
    """Raise SpecError unless ``hidden_act`` is SiLU (the experts' SwiGLU gate)."""
    act = cfg.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise SpecError(f"config.hidden_act: expected silu for {family}, got {act!r}")


def _deepseek_params(cfg: Mapping[str, Any], num_layers: int) -> MoEParams:
    """``DeepseekV3MoE`` settings: ``n_routed_experts`` of ``moe_intermediate_size``,
    ``n_shared_experts`` shared ones fused into one of ``n_shared_experts`` times that
    width, ``noaux_tc`` routing; the first ``first_k_dense_replace`` layers dense
    (``DeepseekV3DecoderLayer``).

    Raises:
        SpecError: missing or invalid counts, ``n_group`` not dividing the experts,
            ``topk_group`` above ``n_group``, too few eligible experts for the top-k, a
            ``topk_method`` or ``scoring_func`` other than ``noaux_tc`` / ``sigmoid``.
    """
    n = _int(cfg, "n_routed_experts", "num_local_experts")
    inter = _int(cfg, "moe_intermediate_size")
    k = _int(cfg, "num_experts_per_tok")
    groups = _int(cfg, "n_group") if cfg.get("n_group") is not None else 1
    top_groups = _int(cfg, "topk_group") if cfg.get("topk_group") is not None else 1
    for key, want in (("topk_method", "noaux_tc"), ("scoring_func", "sigmoid")):
        v = cfg.get(key)
        if v is not None and v != want:
            raise SpecError(f"config.{key}: expected {want!r} (DeepSeek-V3 routing), got {v!r}")
    if n % groups:
        raise SpecError(f"config.n_group: expected a divisor of n_routed_experts={n}, got {groups}")
    if top_groups > groups:
        raise SpecError(f"config.topk_group: expected <= n_group={groups}, got {top_groups}")
    per_group = n // groups
    if per_group < 2:  # each group's score is the sum of its two best experts
        raise SpecError(
            f"config.n_group: expected >= 2 experts per group, got {per_group} ({n} / {groups})"
        )
    if k > top_groups * per_group:
        raise SpecError(
            f"config.num_experts_per_tok: expected <= {top_groups * per_group} experts "
            f"(topk_group x experts per group), got {k}"
        )
    shared = cfg.get("n_shared_experts")
    shared_n = 0 if shared in (None, 0) else _int(cfg, "n_shared_experts")
    dense = cfg.get("first_k_dense_replace") or 0
    if isinstance(dense, bool) or not isinstance(dense, int) or dense < 0:
        raise SpecError(f"config.first_k_dense_replace: expected an integer >= 0, got {dense!r}")
    _check_silu(cfg, "deepseek_v3")
    rsf = float(cfg.get("routed_scaling_factor", 1.0))
    if not rsf > 0:
        raise SpecError(f"config.routed_scaling_factor: expected > 0, got {rsf}")
    return MoEParams(
        family="deepseek_v3",
        num_experts=n,
        top_k=k,
        intermediate_size=inter,
        routing="noaux_tc",
        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
        weights_in_model_dtype=False,
        bias=False,
        activation="silu",
        sparse_layers=tuple(range(dense, num_layers)),
        shared_intermediate_size=inter * shared_n,
        n_group=groups,
        topk_group=top_groups,
        routed_scaling_factor=rsf,
    )


def moe_parameter_count(params: MoEParams, hidden_size: int) -> int:
    """Parameters of one MoE layer's MLP: the router (``E * hidden``, plus ``E`` bias;
    ``noaux_tc``: plus the ``E`` selection biases ``e_score_correction_bias``), ``E``
    experts of three ``hidden x I`` matrices (plus ``2I + hidden`` biases), the shared
    expert (three ``hidden x shared_intermediate_size``) and its ``[1, hidden]`` gate
    where the family has one."""
    e, i, h = params.num_experts, params.intermediate_size, hidden_size
    per = 3 * h * i + (2 * i + h if params.bias else 0)
    router = e * h + (e if params.bias or params.routing == "noaux_tc" else 0)
    shared = 3 * h * params.shared_intermediate_size + (h if params.shared_expert_gate else 0)
    return router + e * per + shared


__all__ = ["MOE_MODEL_TYPES", "MoEParams", "moe_parameter_count", "moe_params_from_hf"]
