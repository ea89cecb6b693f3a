"""FP8 runtime copies: quantize a high-precision master into an FP8 weight and its scales.

ultracomm moves FP8 weights and their scales as bytes (no conversion inside, as DeepEP's
``lb_prefetch_weights``); the caller quantizes its masters each step into the tensors it
registered, with these functions or its own (Transformer Engine, torchao) -- any bytes of
the member dtypes are moved exactly.  Two scalings, the shapes :meth:`ExpertLayout.fp8_swiglu`
lays out:

* ``"mxfp8"`` (OCP Microscaling): one ``float8_e8m0fnu`` power-of-two scale per block of 32
  consecutive elements of a row, ``scale [*lead, cols / 32]``;
* ``"row"``: one fp32 scale per row, ``scale [*lead, 1]``.

``dequantize(q, scale)`` is ``q * scale`` broadcast over each scale's block, in fp32.
"""

from __future__ import annotations

import torch

from .errors import InputError, LayoutError

__all__ = ["MX_BLOCK", "SCALINGS", "scale_shape", "quantize", "dequantize", "quantized_weight"]

#: Elements that share one MXFP8 scale.
MX_BLOCK = 32

SCALINGS = ("mxfp8", "row")


def _e8m0() -> torch.dtype:
    d = getattr(torch, "float8_e8m0fnu", None)
    if d is None:  # pragma: no cover - torch < 2.7
        raise LayoutError("MXFP8 scales need torch.float8_e8m0fnu (torch >= 2.7); use scaling='row'")
    return d


def scale_shape(shape: tuple[int, ...], scaling: str) -> tuple[tuple[int, ...], torch.dtype]:
    """``(shape, dtype)`` of the scales of an FP8 tensor of ``shape`` under ``scaling``."""
    shape = tuple(shape)
    if scaling == "mxfp8":
        if not shape or shape[-1] % MX_BLOCK:
            raise LayoutError(
                f"MXFP8 scales one block of {MX_BLOCK} elements along the last dimension: shape "
                f"{list(shape)} needs a last dimension that is a multiple of {MX_BLOCK}"
            )
        return (*shape[:-1], shape[-1] // MX_BLOCK), _e8m0()
    if scaling == "row":
        return (*shape[:-1], 1), torch.float32
    raise LayoutError(f"scaling must be one of {SCALINGS}, got {scaling!r}")


def quantize(
    w: torch.Tensor,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    scaling: str = "mxfp8",
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``w`` (any float dtype, ``[..., cols]``) to ``(q, scale)``: ``q`` in ``fp8_dtype``
    shaped like ``w``, ``scale`` as :func:`scale_shape` says.  Values beyond the FP8 range after
    scaling saturate to its largest finite value (none do: each scale is chosen so that
    its block's largest magnitude fits).  ``out``: write into these tensors (the ones
    registered with ultracomm) instead of new ones; returns them."""
    fmax = torch.finfo(fp8_dtype).max
    sshape, sdtype = scale_shape(tuple(w.shape), scaling)
    x = w.detach().float()
    if scaling == "mxfp8":
        blocks = x.reshape(*sshape, MX_BLOCK)
        amax = blocks.abs().amax(-1)
        # the smallest power of two that brings amax within the FP8 range (NVIDIA's round-up choice;
        # OCP's floor(log2 amax) - emax would clip up to ~14% of a block's largest values)
        exp = torch.ceil(torch.log2(amax / fmax))
        exp = torch.where(amax > 0, exp, torch.zeros_like(exp)).clamp(-127, 127)
        scale = torch.exp2(exp)
        q = (blocks / scale.unsqueeze(-1)).clamp(-fmax, fmax).reshape(w.shape).to(fp8_dtype)
    else:
        amax = x.abs().amax(-1, keepdim=True)
        scale = torch.where(amax > 0, amax / fmax, torch.ones_like(amax))
        q = (x / scale).clamp(-fmax, fmax).to(fp8_dtype)
    scale = scale.to(sdtype)
    if out is None:
        return q, scale
    out[0].copy_(q)
    out[1].copy_(scale)
    return out[0], out[1]


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 ``q * scale``, each scale applied to its block of the last dimension."""
    if q.shape[:-1] != scale.shape[:-1] or scale.shape[-1] == 0 or q.shape[-1] % scale.shape[-1]:
        raise InputError(
            f"ultracomm: scale {list(scale.shape)} does not tile q {list(q.shape)} along its last "
            "dimension (blocks of q.shape[-1] / scale.shape[-1] elements)"
        )
    block = q.shape[-1] // scale.shape[-1]
    return q.float() * scale.float().repeat_interleave(block, dim=-1)


class _Quantized(torch.autograd.Function):
    @staticmethod
    def forward(ctx, master: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return dequantize(q, scale).to(master.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad, None, None


def quantized_weight(master: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The weight a home expert computes with: ``dequantize(q, scale)`` in ``master``'s dtype,
    its gradient passed straight through to ``master`` (the usual FP8 training estimator).
    ``q, scale = quantize(master)``, refreshed each step."""
    return _Quantized.apply(master, q, scale)
