"""Direct preference optimisation losses on summed sequence log-probabilities."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .core import _check_positive, _check_same_shape

DPO_LOSS_TYPES: tuple[str, ...] = ("sigmoid", "ipo", "hinge")


def dpo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    beta: float,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-example DPO loss -> (losses, chosen_rewards, rejected_rewards), all shaped like the inputs.

    With d = (pc - rc) - (pr - rr): sigmoid = -(1 - ls) logsigmoid(beta d) - ls logsigmoid(-beta d)
    (ls > 0 is conservative DPO, for noisy preference labels); ipo = (d - 1 / (2 beta))^2; hinge =
    relu(1 - beta d). The implicit rewards beta (pc - rc) and beta (pr - rr) are detached: they are
    metrics, not part of the objective.
    """
    _check_same_shape(
        "policy_chosen_logps",
        policy_chosen_logps,
        policy_rejected_logps=policy_rejected_logps,
        ref_chosen_logps=ref_chosen_logps,
        ref_rejected_logps=ref_rejected_logps,
    )
    _check_positive("beta", beta)
    if loss_type not in DPO_LOSS_TYPES:
        raise ValueError(f"loss_type={loss_type!r} is not a DPO loss; use one of {', '.join(DPO_LOSS_TYPES)}")
    if not 0.0 <= label_smoothing <= 0.5:
        raise ValueError(f"label_smoothing={label_smoothing!r} must be in [0, 0.5]")
    if label_smoothing != 0.0 and loss_type != "sigmoid":
        raise ValueError(
            f"label_smoothing={label_smoothing!r} only applies to loss_type='sigmoid', not {loss_type!r}; "
            f"set label_smoothing to 0"
        )
    chosen_ratio = policy_chosen_logps - ref_chosen_logps.detach()
    rejected_ratio = policy_rejected_logps - ref_rejected_logps.detach()
    d = chosen_ratio - rejected_ratio
    if loss_type == "sigmoid":
        losses = -(1.0 - label_smoothing) * F.logsigmoid(beta * d) - label_smoothing * F.logsigmoid(-beta * d)
    elif loss_type == "ipo":
        losses = (d - 1.0 / (2.0 * beta)) ** 2
    else:
        losses = F.relu(1.0 - beta * d)
    return losses, (beta * chosen_ratio).detach(), (beta * rejected_ratio).detach()
