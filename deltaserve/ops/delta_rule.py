"""Gated delta rule of Kimi Delta Attention (KDA), in a recurrent and a chunked (WY / UT) form.

Shapes: q, k [B, T, H, K] (already L2-normalised), v [B, T, H, V], g [B, T, H, K] (log-decay, <= 0),
beta [B, T, H], state [B, H, K, V] float32. Both forms compute, per head,

    S_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T,    o_t = S_t^T (scale * q_t)

and return (o [B, T, H, V] float32, final state). The chunked form is exact for any chunk size; the chunk
size only changes the floating-point reduction order. Names and signatures follow fla's KDA kernels, so fla's
Triton kernels drop in where they run (ops/kda.py).
"""
from __future__ import annotations

from typing import Callable

import torch


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (eps inside the root, as fla and transformers)."""
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def fused_recurrent_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                        scale: float, initial_state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token at a time; the decode path (T = 1) and the reference for the chunked form. Updates
    `initial_state` (float32) in place, without temporaries the size of the state, and returns it as the final one."""
    state = initial_state
    decay = g.float().exp().unsqueeze(-1)                             # [B, T, H, K, 1]: scales each key row
    k, q = k.float().unsqueeze(-1), q.float().unsqueeze(-2) * scale   # [B, T, H, K, 1], [B, T, H, 1, K]
    v, beta = v.float().unsqueeze(-2), beta.float()[..., None, None]  # [B, T, H, 1, V], [B, T, H, 1, 1]
    out = []
    for t in range(k.shape[1]):
        state.mul_(decay[:, t])
        delta = (v[:, t] - k[:, t].transpose(-1, -2) @ state) * beta[:, t]
        state.addcmul_(k[:, t], delta)                                # rank-1 update
        out.append(q[:, t] @ state)                                   # [B, H, 1, V]
    return torch.cat(out, dim=-2).transpose(1, 2), state


def intra_chunk_scores(q: torch.Tensor, k: torch.Tensor, G: torch.Tensor, sub: int = 16
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """A[r, j] = sum_d x_r[d] k_j[d] exp(G_r[d] - G_j[d]) for j <= r (else 0), for x = k and x = q.

    q, k, G: [..., C, K] with G the inclusive cumulative log-decay. exp(-G_j) alone overflows float32 under
    strong decay, so (as fla's kernels do) the chunk is cut into sub-chunks of `sub` rows: a block of rows i
    meets earlier columns through a matmul via the reference point R = G at the end of sub-chunk i-1, where
    exp(G_r - R) <= 1 and exp(R - G_j) <= 1; only the diagonal blocks are formed pairwise.
    """
    *batch, C, K = k.shape
    sub = sub if C % sub == 0 else C
    n = C // sub
    blocks = lambda x: x.reshape(*batch, n, sub, K)
    ref = torch.cat((torch.zeros_like(G[..., :1, :]), G[..., sub - 1:C - 1:sub, :]), dim=-2)   # [..., n, K]
    row_decay = (blocks(G) - ref.unsqueeze(-2)).exp()                                            # [..., n, sub, K]
    rows = torch.stack((blocks(k) * row_decay, blocks(q) * row_decay))                          # [2, ..., n, sub, K]
    earlier = torch.arange(C, device=k.device) < torch.arange(n, device=k.device)[:, None] * sub  # [n, C]
    col_log = (ref.unsqueeze(-2) - G.unsqueeze(-3)).masked_fill(~earlier[..., None], float("-inf"))
    cols = col_log.exp_().mul_(k.unsqueeze(-3))                                                  # [..., n, C, K]
    scores = (rows @ cols.transpose(-1, -2)).reshape(2, *batch, C, C)                            # off-diagonal blocks
    causal = torch.ones(sub, sub, dtype=torch.bool, device=k.device).tril()
    G_blocks = blocks(G)
    pair = (G_blocks.unsqueeze(-2) - G_blocks.unsqueeze(-3)).masked_fill_(~causal[..., None], float("-inf"))
    pair = pair.exp_().mul_(blocks(k).unsqueeze(-3))                                             # [..., n, r, j, K]
    diag = pair @ torch.stack((blocks(k), blocks(q)), -1)                                        # [..., n, r, j, 2]
    on_diag = torch.diagonal(scores.view(2, *batch, n, sub, n, sub), dim1=-4, dim2=-2)           # [2, ..., sub, sub, n]
    on_diag.add_(diag.movedim(-1, 0).movedim(-3, -1))
    return scores[0], scores[1]


def chunk_prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
                  ) -> tuple[torch.Tensor, ...]:
    """Everything of the chunked form that is parallel over chunks, for [B, H, n, C, *] inputs (q already scaled):
    (w, u, q_decayed, k_to_end, end_decay, A_qk), what the sequential hand-over between chunks consumes."""
    C, K = k.shape[-2], k.shape[-1]
    G = g.cumsum(-2)                                                  # inclusive log-decay within each chunk
    A_kk, A_qk = intra_chunk_scores(q, k, G)                          # [B, H, n, C, C]
    # UT transform: (I + tril(beta_r A_kk, -1))^-1 applied to beta*exp(G)*k and beta*v together.
    lower = torch.eye(C, device=k.device) + (beta.unsqueeze(-1) * A_kk).tril(-1)
    wu = torch.linalg.solve_triangular(lower, beta.unsqueeze(-1) * torch.cat((G.exp() * k, v), -1),
                                       upper=False, unitriangular=True)
    G_last = G[..., -1:, :]                                           # [B, H, n, 1, K]
    return (wu[..., :K], wu[..., K:], q * G.exp(), (G_last - G).exp() * k, G_last.transpose(-1, -2).exp(), A_qk)


def chunk_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              scale: float, initial_state: torch.Tensor, chunk_size: int = 64,
              prepare: Callable[..., tuple[torch.Tensor, ...]] = chunk_prepare) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunks of `chunk_size` tokens: within a chunk everything is matrix algebra (the WY representation, one
    triangular solve), done for all chunks at once by `prepare` (chunk_prepare, or the CPU kernel of the same math);
    only the chunk-to-chunk state hand-over is a Python loop."""
    B, T, H, K = k.shape
    C = chunk_size
    pad = (-T) % C
    # [B, T, H, *] -> [B, H, n, C, *]; zero padding is exact: k = beta = g = 0 leaves the state untouched.
    def split(x: torch.Tensor) -> torch.Tensor:
        x = x.float().transpose(1, 2)
        if pad:
            x = torch.nn.functional.pad(x, (0, 0, 0, pad) if x.dim() == 4 else (0, pad))
        return x.reshape(B, H, -1, C, *x.shape[3:])
    return chunked_kda(split(q) * scale, split(k), split(v), split(g), split(beta), T, initial_state, prepare)


def chunked_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, T: int,
                initial_state: torch.Tensor, prepare: Callable[..., tuple[torch.Tensor, ...]] = chunk_prepare
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """chunk_kda on inputs already in chunks, [B, H, n, C, *] float32, q scaled, zero past the first T tokens."""
    B, H, _, C, V = v.shape
    w, u, q_decayed, k_to_end, end_decay, A_qk = prepare(q, k, v, g, beta)
    n = w.shape[2]
    state = initial_state.float().clone()
    out = torch.empty(B, H, n, C, V, dtype=torch.float32, device=k.device)
    for c in range(n):
        v_new = u[:, :, c] - w[:, :, c] @ state                       # pseudo-values against the entering state
        out[:, :, c] = q_decayed[:, :, c] @ state + A_qk[:, :, c] @ v_new
        state = state * end_decay[:, :, c] + k_to_end[:, :, c].transpose(-1, -2) @ v_new
    return out.reshape(B, H, -1, V)[:, :, :T].transpose(1, 2), state
