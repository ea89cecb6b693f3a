"""MoE model presets: the shape of one model's routed experts (:class:`ModelSpec`, :data:`MODELS`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..layout import ExpertLayout
from ..errors import InputError

__all__ = ["ModelSpec", "MODELS", "get_model"]


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class ModelSpec:
    """Shape of one MoE model's routed experts.

    Attributes:
        name: preset name (lower case, e.g. ``"qwen3-235b-a22b"``).
        hidden: model hidden size H.
        moe_inter: expert intermediate size I.
        num_experts: routed experts per MoE layer E.
        top_k: experts each token is routed to.
        moe_layers: number of MoE layers.
    """

    name: str
    hidden: int
    moe_inter: int
    num_experts: int
    top_k: int
    moe_layers: int

    def __post_init__(self) -> None:
        for f in ("hidden", "moe_inter", "num_experts", "top_k", "moe_layers"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise InputError(f"ModelSpec {self.name!r}: {f} must be a positive int, got {v!r}")
        if self.top_k > self.num_experts:
            raise InputError(f"ModelSpec {self.name!r}: top_k = {self.top_k} exceeds num_experts = {self.num_experts}")

    def expert_weight_bytes(self, dtype: torch.dtype = torch.bfloat16) -> int:
        """Bytes of one expert's weights: gate + up + down = ``3 * H * I * itemsize``
        (bf16: 37,748,736 for Qwen3-235B-A22B)."""
        return 3 * self.hidden * self.moe_inter * _itemsize(dtype)

    def expert_grad_bytes(self, grad_dtype: torch.dtype = torch.float32) -> int:
        """Bytes of one expert's gradients: ``3 * H * I * itemsize(grad_dtype)``."""
        return 3 * self.hidden * self.moe_inter * _itemsize(grad_dtype)

    def layout(self, dtype: torch.dtype = torch.bfloat16, grad_dtype: torch.dtype = torch.float32) -> ExpertLayout:
        """The SwiGLU :class:`ExpertLayout`: ``fc1 [2I, H]``, ``fc2 [H, I]`` in ``dtype``,
        gradients in ``grad_dtype``."""
        return ExpertLayout.swiglu(self.hidden, self.moe_inter, dtype, grad_dtype)

    def experts_per_rank(self, world: int) -> int:
        """``num_experts // world``; raises ValueError unless ``world`` divides E."""
        if not isinstance(world, (int, np.integer)) or world < 1 or self.num_experts % world:
            raise InputError(
                f"{self.name} has {self.num_experts} experts, which do not divide evenly over "
                f"world = {world} ranks; pick a world size that divides {self.num_experts}"
            )
        return self.num_experts // int(world)


#: Model presets, keyed by lower-case name (sizes as in shared/FACTS.md).
MODELS: dict[str, ModelSpec] = {
    m.name: m
    for m in (
        ModelSpec("qwen3-30b-a3b", 2048, 768, 128, 8, 48),
        ModelSpec("qwen3-235b-a22b", 4096, 1536, 128, 8, 94),
        ModelSpec("deepseek-v3", 7168, 2048, 256, 8, 58),
        ModelSpec("glm-4.5", 5120, 1536, 160, 8, 89),
        ModelSpec("glm-4.5-air", 4096, 1408, 128, 8, 45),
        ModelSpec("kimi-k2", 7168, 2048, 384, 8, 60),
        ModelSpec("gpt-oss-120b", 2880, 2880, 128, 4, 36),
        ModelSpec("mixtral-8x7b", 4096, 14336, 8, 2, 32),
    )
}


def get_model(name: str) -> ModelSpec:
    """The preset called ``name`` (case-insensitive); ValueError listing the presets
    otherwise."""
    if not isinstance(name, str) or name.strip().lower() not in MODELS:
        raise InputError(f"unknown model {name!r}; known models: {', '.join(MODELS)}")
    return MODELS[name.strip().lower()]
