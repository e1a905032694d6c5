"""The Qwen3-MoE family (`qwen3_moe`, HF `Qwen3MoeForCausalLM`): Qwen3's attention (per-head q/k
RMSNorm, explicit head_dim) with every layer's MLP a sparse mixture of experts
(`grpo_core.models.moe`): a top-k router over `num_experts` SwiGLU experts of
`moe_intermediate_size`, weights renormalised when `norm_topk_prob`.

Every layer is sparse: HF's `decoder_sparse_step` > 1 and `mlp_only_layers` (dense layers among
sparse ones, unused by the released Qwen3-MoE models) are refused. Checkpoints name each expert's
weights separately (`mlp.experts.{e}.{gate,up,down}_proj.weight`, as `save_pretrained` writes
them); they are stacked here on the `expert` axis.
"""

from __future__ import annotations

from typing import Any

from grpo_core.model_families import unsupported
from grpo_core.models.hf_names import HF_TABLE, Linear
from grpo_core.models.moe import SparseMoE
from grpo_core.models.qwen_family import Qwen3Family

MOE_ROWS = (
    ("model.layers.{layer}.mlp.gate.weight", "layers.mlp.gate.kernel", Linear()),
    ("model.layers.{layer}.mlp.experts.{expert}.{gate_up}_proj.weight", "layers.mlp.experts.{gate_up}_proj", Linear()),
    ("model.layers.{layer}.mlp.experts.{expert}.down_proj.weight", "layers.mlp.experts.down_proj", Linear()),
)


class Qwen3MoeFamily(Qwen3Family):
    name = "qwen3_moe"
    architecture = "Qwen3MoeForCausalLM"
    sparse_mlp = True
    hf_table = HF_TABLE + MOE_ROWS

    def read_hf(self, d: dict[str, Any]) -> None:
        # transformers 5 writes `num_local_experts` (its attribute for num_experts).
        if "num_local_experts" in d:
            d.setdefault("num_experts", d.pop("num_local_experts"))
        if d.get("mlp_only_layers") is None:
            d.pop("mlp_only_layers", None)

    def validate(self, cfg: Any) -> None:
        if cfg.num_experts <= 0 or cfg.moe_intermediate_size <= 0:
            raise unsupported("num_experts, moe_intermediate_size", (cfg.num_experts, cfg.moe_intermediate_size),
                              "both positive for qwen3_moe")
        if not 0 < cfg.num_experts_per_tok <= cfg.num_experts:
            raise unsupported("num_experts_per_tok", cfg.num_experts_per_tok, f"1 to num_experts={cfg.num_experts}")
        if cfg.decoder_sparse_step != 1 or cfg.mlp_only_layers:
            raise unsupported("decoder_sparse_step, mlp_only_layers", (cfg.decoder_sparse_step, cfg.mlp_only_layers),
                              "1 and [] (every layer sparse; mixed dense/sparse layers are not implemented)")
        if cfg.router_aux_loss_coef < 0:
            raise unsupported("router_aux_loss_coef", cfg.router_aux_loss_coef, "a value >= 0")

    def mlp(self, cfg: Any, *, dtype: Any, rngs: Any) -> SparseMoE:
        return SparseMoE(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok,
                         cfg.norm_topk_prob, dtype=dtype, rngs=rngs)

    def mlp_matmul_params(self, cfg: Any) -> int:
        # The router, then the k experts each token runs through (active, not total, weights).
        experts = 3 * cfg.hidden_size * cfg.moe_intermediate_size * cfg.num_experts_per_tok
        return cfg.hidden_size * cfg.num_experts + experts

    def hf_extras(self, cfg: Any) -> dict[str, Any]:
        return {**super().hf_extras(cfg), "num_experts": cfg.num_experts,
                "num_experts_per_tok": cfg.num_experts_per_tok, "moe_intermediate_size": cfg.moe_intermediate_size, "norm_topk_prob": cfg.norm_topk_prob,
                "decoder_sparse_step": cfg.decoder_sparse_step, "mlp_only_layers": list(cfg.mlp_only_layers),
                "router_aux_loss_coef": cfg.router_aux_loss_coef}

    def tiny_changes(self) -> dict[str, Any]:
        return {**super().tiny_changes(), "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                "norm_topk_prob": True}


QWEN3_MOE = Qwen3MoeFamily()
