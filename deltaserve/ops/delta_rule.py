"""Gated delta rule of Kimi Delta Attention (KDA), in a recurrent and a chunked (WY / UT) form.

Shapes: q, k [B, T, H, K] (already L2-normalised), v [B, T, H, V], g [B, T, H, K] (log-decay, <= 0),
beta [B, T, H], state [B, H, K, V] float32. Both forms compute, per head,

    S_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T,    o_t = S_t^T (scale * q_t)

and return (o [B, T, H, V] float32, final state). The chunked form is exact for any chunk size; the chunk
size only changes the floating-point reduction order.
"""
from __future__ import annotations

import torch


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (eps inside the root, as fla and transformers)."""
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def delta_rule_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                         state: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One token at a time; the decode path (T = 1) and the reference for the chunked form."""
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    state = state.clone()
    out = []
    for t in range(k.shape[1]):
        k_t = k[:, t].unsqueeze(-2)                                  # [B, H, 1, K]
        state.mul_(g[:, t].exp().unsqueeze(-1))                      # decay each key row
        pred = k_t @ state                                           # [B, H, 1, V]
        delta = (v[:, t].unsqueeze(-2) - pred) * beta[:, t, :, None, None]
        state.add_(k_t.transpose(-1, -2) @ delta)                    # rank-1 update
        out.append((q[:, t].unsqueeze(-2) * scale) @ state)
    return torch.cat(out, dim=-2).transpose(1, 2), state


def delta_rule_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       state: torch.Tensor, scale: float, chunk_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunks of `chunk_size` tokens: within a chunk everything is matrix algebra (the WY representation,
    one triangular solve); only the chunk-to-chunk state hand-over is a Python loop."""
    B, T, H, K = k.shape
    V = v.shape[-1]
    C = chunk_size
    pad = (-T) % C
    # [B, T, H, *] -> [B, H, n, C, *]; zero padding is exact: k = beta = g = 0 leaves the state untouched.
    def split(x: torch.Tensor) -> torch.Tensor:
        x = x.float().transpose(1, 2)
        if pad:
            x = torch.nn.functional.pad(x, (0, 0, 0, pad) if x.dim() == 4 else (0, pad))
        return x.reshape(B, H, -1, C, *x.shape[3:])
    q, k, v, g, beta = split(q) * scale, split(k), split(v), split(g), split(beta)
    G = g.cumsum(-2)                                                  # inclusive log-decay within the chunk
    causal = torch.ones(C, C, dtype=torch.bool, device=k.device).tril()
    eye = torch.eye(C, dtype=torch.float32, device=k.device)
    state = state.float().clone()
    out = torch.empty(B, H, G.shape[2], C, V, dtype=torch.float32, device=k.device)
    for c in range(G.shape[2]):
        q_c, k_c, v_c, G_c, b_c = q[:, :, c], k[:, :, c], v[:, :, c], G[:, :, c], beta[:, :, c]
        # decay[r, j, d] = exp(G_r[d] - G_j[d]) for j <= r, formed pairwise: exp(-G_j) alone can overflow.
        decay = (G_c.unsqueeze(-2) - G_c.unsqueeze(-3)).masked_fill(~causal[..., None], float("-inf")).exp_()
        kd = decay.mul_(k_c.unsqueeze(-3))                            # [B, H, r, j, K]: decayed keys k_j
        scores = kd @ torch.stack((k_c, q_c), -1)                     # [B, H, r, j, 2]: <k_r|k_j>, <q_r|k_j>
        A_kk, A_qk = scores[..., 0], scores[..., 1]                   # lower-triangular, diagonal included
        # UT transform: (I + tril(beta_r A_kk, -1))^-1 applied to beta*exp(G)*k and beta*v together.
        lower = eye + (b_c.unsqueeze(-1) * A_kk).tril(-1)
        rhs = b_c.unsqueeze(-1) * torch.cat((G_c.exp() * k_c, v_c), -1)
        wu = torch.linalg.solve_triangular(lower, rhs, upper=False, unitriangular=True)
        w, u = wu[..., :K], wu[..., K:]
        v_new = u - w @ state                                         # pseudo-values against the entering state
        out[:, :, c] = (q_c * G_c.exp()) @ state + A_qk @ v_new
        G_last = G_c[..., -1:, :]                                     # [B, H, 1, K]
        state = state * G_last.transpose(-1, -2).exp() + ((G_last - G_c).exp() * k_c).transpose(-1, -2) @ v_new
    out = out.reshape(B, H, -1, V)[:, :, :T].transpose(1, 2)
    return out, state
