"""On-policy distillation: the student samples, a teacher scores the student's own tokens, and the
per-token reverse KL KL(student || teacher) is what the student minimises (Agarwal et al., GKD,
arXiv:2306.13649; the "reverse KL as per-token reward" form of Lu et al., Thinking Machines 2025).

On the student's own samples the single-sample reverse KL of token t is
``log pi_s(y_t) - log pi_t(y_t)``. Two ways to train on it:

- as a per-token **advantage** (`reverse_kl_advantages`): ``-coef * (KL_t - mean KL)``, optionally with
  the discounted KL of the tokens after t (a token also moves the student into the states that follow);
  it goes through the policy loss (clip, rollout correction) like any advantage. Subtracting the
  batch mean is a baseline: the gradient's expectation is unchanged, its variance lower.
- as a **loss** (`reverse_kl_loss`): ``0.5 * (log pi_s(y_t) - log pi_t(y_t))^2`` with the gradient through
  the student. Its expected gradient on the student's samples is the reverse KL's exactly:
  ``E_y[(log pi_s - log pi_t) grad log pi_s] = grad KL(pi_s || pi_t)`` (the score term has mean 0).
"""

from __future__ import annotations

import torch


def reverse_kl(student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor) -> torch.Tensor:
    """Single-sample per-token reverse KL estimate on the student's sampled tokens: log pi_s - log pi_t."""
    if student_logprobs.shape != teacher_logprobs.shape:
        raise ValueError(f"student log-probs {tuple(student_logprobs.shape)} and teacher log-probs "
                         f"{tuple(teacher_logprobs.shape)} must have the same shape [N, T]")
    return student_logprobs - teacher_logprobs


def discounted_future_sum(x: torch.Tensor, mask: torch.Tensor, discount: float) -> torch.Tensor:
    """out_t = sum_{k >= t} discount^(k - t) x_k over the masked tokens of each row (masked positions: 0, and
    they neither add nor break the discounting between the tokens around them)."""
    if discount == 0.0:
        return x * mask
    out = torch.zeros_like(x)
    running = torch.zeros_like(x[..., 0])
    for t in range(x.shape[-1] - 1, -1, -1):
        m = mask[..., t]
        running = torch.where(m > 0, x[..., t] + discount * running, running)
        out[..., t] = running * m
    return out


def reverse_kl_advantages(student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, mask: torch.Tensor,
                          *, coef: float, discount: float = 0.0, mean: float | torch.Tensor | None = None,
                          ) -> torch.Tensor:
    """Per-token advantages ``-coef * sum_{k>=t} discount^(k-t) (KL_k - mean)``: the reverse KL as a negative
    reward. `mean` is the baseline (the KL's mean over the tokens of the *global* batch; None = this
    batch's). Zero on masked positions."""
    mask = mask.to(student_logprobs.dtype)
    kl = reverse_kl(student_logprobs, teacher_logprobs)
    if mean is None:
        mean = (kl * mask).sum() / mask.sum().clamp(min=1.0)
    return -coef * discounted_future_sum((kl - mean) * mask, mask, discount)


def reverse_kl_loss(student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token ``0.5 * (log pi_s - log pi_t)^2`` (the gradient flows through the student's log-probs): on the
    student's own samples its expected gradient is that of KL(pi_s || pi_t)."""
    diff = reverse_kl(student_logprobs, teacher_logprobs.detach())
    return 0.5 * diff * diff


__all__ = ["discounted_future_sum", "reverse_kl", "reverse_kl_advantages", "reverse_kl_loss"]
