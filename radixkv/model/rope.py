"""Rotary position embeddings: the inverse frequencies of each RoPE variant, and the ``cos``/``sin``
tables the decoder layers apply.

Every table is laid out for rotate-half RoPE over the whole head dim: dim ``j < D/2`` pairs with
``j + D/2``. A *partial* rotary (Phi-3's ``partial_rotary_factor``: only the first ``r`` dims of a
head rotate, ``i`` with ``i + r/2``) is served by the same layout: the loader permutes each q and
k head's dims (:func:`partial_rotary_permutation`, a permutation of both sides leaves every
``q . k`` unchanged) so the rotating pairs land on ``(j, j + D/2)`` for ``j < r/2``, and the
tables hold ``cos = 1, sin = 0`` on the other dims. NoPE layers (SmolLM3) use no table at all.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

__all__ = [
    "RotaryEmbedding",
    "apply_rope",
    "partial_rotary_permutation",
    "rope_inv_freq",
    "rotary_for",
]

#: RoPE scaling kinds computed here (``rope_type`` of transformers' ``rope_parameters``).
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_inv_freq(
    rotary_dim: int, theta: float, scaling: dict[str, Any] | None
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (float32, ``rotary_dim / 2`` of them) and the attention scaling of
    the configured RoPE, as transformers computes them."""
    d = rotary_dim
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    scaling = scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in (None, "default"):
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / float(scaling["factor"]), 1.0
    if kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling.get("original_max_position_embeddings", 8192))
        low_wavelen = old_len / low
        high_wavelen = old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    raise NotImplementedError(f"RoPE scaling type {kind!r} is not supported")


def partial_rotary_permutation(head_dim: int, rotary_dim: int) -> list[int]:
    """The order of a head's dims that puts partial rotary's pairs ``(i, i + r/2)``, ``i < r/2``,
    at rotate-half's ``(i, i + D/2)``; the ``D - r`` passing dims fill the rest, half in each
    half. ``new[j] = old[perm[j]]``; the identity when ``rotary_dim == head_dim``."""
    d, r = head_dim, rotary_dim
    if r % 2 or (d - r) % 2 or not 0 < r <= d:
        raise ValueError(
            f"partial rotary: rotary dim {r} of head dim {d} must be even, with an even remainder"
        )
    half_pass = (d - r) // 2
    return (
        list(range(0, r // 2))
        + list(range(r, r + half_pass))
        + list(range(r // 2, r))
        + list(range(r + half_pass, d))
    )


class RotaryEmbedding(nn.Module):
    """RoPE tables; :meth:`lookup` returns ``cos``/``sin`` rows for the batch's positions.

    ``sin`` is returned sign-folded (``[-sin, sin]`` halves) so that applying RoPE is
    ``x * cos + roll(x, D/2) * sin``. With ``rotary_dim < head_dim`` the tables are for the
    permuted layout of :func:`partial_rotary_permutation` (``cos = 1, sin = 0`` on the dims that
    do not rotate).
    """

    def __init__(
        self,
        head_dim: int,
        theta: float,
        scaling: dict[str, Any] | None = None,
        max_positions: int = 4096,
        rotary_dim: int | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim or head_dim
        inv_freq, self.attention_scaling = rope_inv_freq(self.rotary_dim, theta, scaling)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._cos: torch.Tensor | None = None
        self._sin: torch.Tensor | None = None
        self._grow(max(max_positions, 1))

    def _grow(self, n: int) -> None:
        pos = torch.arange(n, dtype=torch.int64, device=self.inv_freq.device).float()
        freqs = pos[:, None] * self.inv_freq[None, :]  # [n, r/2]
        d, r2 = self.head_dim, self.rotary_dim // 2
        cos = torch.ones(n, d, dtype=torch.float32, device=freqs.device)
        sin = torch.zeros(n, d, dtype=torch.float32, device=freqs.device)
        c, s = freqs.cos() * self.attention_scaling, freqs.sin() * self.attention_scaling
        half = d // 2
        cos[:, :r2], cos[:, half : half + r2] = c, c
        sin[:, :r2], sin[:, half : half + r2] = -s, s
        self._cos, self._sin = cos, sin

    def lookup(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin [T, 1, D]`` in ``dtype`` for ``positions [T]``."""
        assert self._cos is not None and self._sin is not None
        max_pos = int(positions.max()) + 1 if positions.numel() else 0
        if max_pos > self._cos.shape[0]:
            self._grow(max(max_pos, 2 * self._cos.shape[0]))
        if self._cos.device != positions.device:
            self._cos = self._cos.to(positions.device)
            self._sin = self._sin.to(positions.device)
        cos = self._cos.index_select(0, positions).to(dtype).unsqueeze(1)
        sin = self._sin.index_select(0, positions).to(dtype).unsqueeze(1)
        return cos, sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of ``x [T, H, D]`` with sign-folded ``sin`` (see RotaryEmbedding)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return torch.addcmul(x * cos, rotated, sin)


def rotary_for(config: Any, kind: str = "global") -> RotaryEmbedding:
    """The RoPE tables of a :class:`~radixkv.model.model_config.ModelConfig`'s ``kind`` of layer:
    ``"global"`` (``rope_theta`` with its scaling) or ``"local"`` (``local_rope_theta``, no
    scaling: Gemma 3's sliding layers)."""
    if kind == "local":
        theta, scaling = config.local_rope_theta or config.rope_theta, None
    else:
        theta, scaling = config.rope_theta, config.rope_scaling
    return RotaryEmbedding(
        config.head_dim, theta, scaling, max(config.max_position_embeddings, 1), config.rotary_dim
    )
