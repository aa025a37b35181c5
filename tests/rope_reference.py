"""RoPE applied the way the attention modules apply it, written out here as an independent reference for tests."""

import torch


def apply_rope(key_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`k*cos + rotate_half(k)*sin` on the first `cos.shape[-1]` dims; the rest pass through (partial rotary)."""
    rotary_dim = cos.shape[-1]
    k_rot, k_pass = key_states[..., :rotary_dim], key_states[..., rotary_dim:]
    half = rotary_dim // 2
    rotated = k_rot * cos + torch.cat((-k_rot[..., half:], k_rot[..., :half]), dim=-1) * sin
    return torch.cat((rotated, k_pass), dim=-1) if k_pass.shape[-1] else rotated
