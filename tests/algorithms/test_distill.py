"""On-policy distillation's formulas against float64 references written here, and their gradients against
the exact reverse KL of a small categorical policy (every outcome enumerated, no sampling)."""

import pytest
import torch

from verl.algorithms.distill import discounted_future_sum, reverse_kl, reverse_kl_advantages, reverse_kl_loss

D = torch.float64


def _reference_advantages(student, teacher, mask, coef, discount, mean):
    """Loop form: A_t = -coef * sum over the row's later masked tokens k >= t of discount^(#masked tokens
    strictly between t and k, counting k) * (KL_k - mean)."""
    out = torch.zeros_like(student)
    for i in range(student.shape[0]):
        positions = [t for t in range(student.shape[1]) if mask[i, t] > 0]
        for a, t in enumerate(positions):
            total = 0.0
            for b, k in enumerate(positions[a:]):
                total += discount ** b * (float(student[i, k] - teacher[i, k]) - mean)
            out[i, t] = -coef * total
    return out


@pytest.mark.parametrize("discount", [0.0, 0.5, 1.0])
def test_advantages_match_the_loop_reference(discount):
    g = torch.Generator().manual_seed(0)
    student, teacher = -torch.rand(3, 6, generator=g, dtype=D) * 3, -torch.rand(3, 6, generator=g, dtype=D) * 3
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 0, 1, 1, 1, 0], [0, 0, 0, 0, 0, 0]], dtype=D)  # a gap, an empty row
    kl = [float(student[i, t] - teacher[i, t]) for i in range(3) for t in range(6) if mask[i, t]]
    mean = sum(kl) / len(kl)
    got = reverse_kl_advantages(student, teacher, mask, coef=0.7, discount=discount)
    torch.testing.assert_close(got, _reference_advantages(student, teacher, mask, 0.7, discount, mean))
    assert torch.all(got[mask == 0] == 0)
    # a global mean passed in replaces the batch's own
    torch.testing.assert_close(reverse_kl_advantages(student, teacher, mask, coef=0.7, discount=discount, mean=0.25),
                               _reference_advantages(student, teacher, mask, 0.7, discount, 0.25))


def test_discounted_sum_skips_masked_positions():
    x = torch.tensor([[1.0, 5.0, 2.0, 4.0]], dtype=D)
    mask = torch.tensor([[1.0, 0.0, 1.0, 1.0]], dtype=D)
    # 1 + 0.5*2 + 0.25*4 = 3; 2 + 0.5*4 = 4; 4
    assert discounted_future_sum(x, mask, 0.5).tolist() == [[3.0, 0.0, 4.0, 4.0]]
    assert discounted_future_sum(x, mask, 0.0).tolist() == [[1.0, 0.0, 2.0, 4.0]]


def test_shapes_must_agree():
    with pytest.raises(ValueError, match="same shape"):
        reverse_kl(torch.zeros(2, 3), torch.zeros(2, 4))


def _categorical(vocab=5, seed=1):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(vocab, generator=g, dtype=D, requires_grad=True)
    teacher = torch.log_softmax(torch.randn(vocab, generator=g, dtype=D), -1)
    return logits, teacher


def _exact_reverse_kl_grad(logits, teacher):
    logp = torch.log_softmax(logits, -1)
    kl = (logp.exp() * (logp - teacher)).sum()
    return torch.autograd.grad(kl, logits)[0]


def test_loss_mode_gradient_is_the_reverse_kl_gradient():
    """E_{y ~ pi}[grad 0.5 (log pi(y) - log pi_t(y))^2], the samples' probabilities held fixed as sampling
    holds them, equals grad KL(pi || pi_t) exactly."""
    logits, teacher = _categorical()
    logp = torch.log_softmax(logits, -1)
    probs = logp.exp().detach()  # the sampling distribution: no gradient through which tokens were drawn
    per_token = reverse_kl_loss(logp.unsqueeze(0), teacher.unsqueeze(0))[0]
    expected_loss = (probs * per_token).sum()
    got = torch.autograd.grad(expected_loss, logits)[0]
    torch.testing.assert_close(got, _exact_reverse_kl_grad(logits, teacher))


def test_reward_mode_policy_gradient_descends_the_reverse_kl():
    """The policy gradient of the advantages -(KL_y - b) is -grad KL(pi || pi_t) for any baseline b."""
    logits, teacher = _categorical(seed=2)
    logp = torch.log_softmax(logits, -1)
    probs = logp.exp().detach()
    vocab = logits.shape[0]
    for baseline in (0.0, 0.3):
        adv = reverse_kl_advantages(logp.detach().unsqueeze(1), teacher.unsqueeze(1), torch.ones(vocab, 1, dtype=D),
                                    coef=1.0, mean=baseline)[:, 0]
        surrogate = (probs * adv * logp).sum()  # E_y[A(y) log pi(y)], whose gradient the PG loss follows
        got = torch.autograd.grad(surrogate, logits, retain_graph=True)[0]
        torch.testing.assert_close(got, -_exact_reverse_kl_grad(logits, teacher))


def test_teacher_gets_no_gradient_in_loss_mode():
    student = torch.tensor([[-1.0, -2.0]], dtype=D, requires_grad=True)
    teacher = torch.tensor([[-1.5, -0.5]], dtype=D, requires_grad=True)
    reverse_kl_loss(student, teacher).sum().backward()
    assert teacher.grad is None
    torch.testing.assert_close(student.grad, torch.tensor([[0.5, -1.5]], dtype=D))
