"""The bench's model-FLOPs count (MFU) of mixture-of-experts models: a token's linear FLOPs are
2 x the weights it multiplies by, counted here from the parameters of the model we build (the
routed experts scaled by top_k / num_experts), independently of the engine's FlopsEstimator."""

from __future__ import annotations

import pytest
import torch
from tiny_moe_models import save_tiny_moe


def _active_linear_params(model: torch.nn.Module, cfg) -> float:
    """Weights one token multiplies by in the decoder layers (no embedding, LM head or norms)."""
    total = 0.0
    for name, p in model.named_parameters():
        if not name.startswith("layers.") or p.dim() < 2:
            continue
        if ".shared_gate." in name:  # Qwen2-MoE's one-row shared-expert gate: not counted (2h a layer)
            continue
        share = cfg.moe.top_k / cfg.moe.num_experts if ".experts." in name else 1.0
        total += p.numel() * share
    return total


@pytest.mark.parametrize("arch, over", [("mixtral", {}), ("qwen3_moe", {}),  # qwen3: layer 1 is dense
                                        ("qwen2_moe", {"shared_expert_intermediate_size": 64})])
def test_moe_flops_count_the_routed_and_shared_experts_a_token_uses(arch, over, tmp_path):
    from deepinfer.runtime.bench_metrics import flops_estimator
    from deepinfer.runtime.loading.model_loader import model_class, read_config

    save_tiny_moe(tmp_path, arch, **over)
    cfg = read_config(tmp_path)
    with torch.device("meta"):
        model = model_class(cfg)(cfg)
    est = flops_estimator(cfg)
    assert est.linear_flops_per_token == pytest.approx(2 * _active_linear_params(model, cfg), rel=1e-12)
    # the dense count (every expert's weights, or the dense intermediate size) is not what it gives
    dense = sum(p.numel() for n, p in model.named_parameters() if n.startswith("layers.") and p.dim() >= 2)
    assert est.linear_flops_per_token < 2 * dense
