"""One sampling step: logits in, token ids and their logprobs out.

Kept separate from the engine so the distribution can be tested on its own against the softmax, and so
every engine filters logits in the same order (temperature, then top-k, then top-p), which is also
the order Hugging Face ``generate`` applies them in.
"""

from __future__ import annotations

import torch


def filtered_logprobs(
    logits: torch.Tensor, temperature: float, top_k: int | None = None, top_p: float = 1.0
) -> torch.Tensor:
    """Log-probabilities of the distribution we sample from; filtered-out tokens get -inf.

    ``logits`` is [A, V]. The result is float32 (or float64 if the input is float64) so that the
    logprobs handed to the PPO ratio are not rounded to bf16.
    """
    return _filtered_logits(logits, temperature, top_k, top_p).log_softmax(-1)


def _filtered_logits(logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float) -> torch.Tensor:
    """The tempered logits in float32 (float64 stays), -inf where top-k or top-p filters a token out."""
    if logits.dtype not in (torch.float32, torch.float64):
        logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    vocab = logits.shape[-1]
    if top_k is not None and 0 < top_k < vocab:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # Drop a token when the tokens ranked above it already hold top_p of the mass: what is left is
        # the smallest set whose mass reaches top_p (the top token always stays).
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        drop_sorted = mass_before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_from_logprobs(logprobs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Draw one token id per row from ``exp(logprobs)`` by inverting the CDF (see :func:`sample_from_probs`)."""
    return sample_from_probs(logprobs.exp(), generator)


def sample_from_probs(probs: torch.Tensor, generator: torch.Generator | None = None,
                      uniform: torch.Tensor | None = None) -> torch.Tensor:
    """Draw one token id per row of ``probs`` [A, V] (rows summing to 1) by inverting the CDF.

    One uniform number per row instead of one exponential per vocabulary entry (the Gumbel trick) or
    ``torch.multinomial``: on CPU this is several times cheaper and it is exact. ``right=True`` in
    the search never lands on a zero-probability token, since its CDF step is flat. ``uniform`` [A] gives
    the rows' numbers in [0, 1) instead of drawing them from ``generator``.
    """
    cdf = probs.cumsum(-1)
    total = cdf[:, -1:]
    if uniform is None:
        uniform = torch.rand(total.shape, generator=generator, device=cdf.device, dtype=cdf.dtype)
    else:
        uniform = uniform.to(cdf.dtype).unsqueeze(-1)
    u = uniform * total
    # u < total always, so the search result is a real index whose token has positive probability.
    u = torch.minimum(u, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, u, right=True).squeeze(-1)


def sample_step(
    logits: torch.Tensor,
    temperature: float,
    top_k: int | None = None,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
    uniform: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick the next token of every row of ``logits`` [A, V]; returns (token ids [A], logprobs [A]).

    Greedy (temperature 0) returns the argmax and its untempered logprob; otherwise the logprob is
    that of the sampled token under the filtered distribution it was drawn from, drawn with the rows'
    ``uniform`` numbers [A] where given (see :func:`sample_from_probs`).
    """
    if temperature == 0:
        if logits.dtype not in (torch.float32, torch.float64):
            logits = logits.float()
        # Argmax of the raw logits, exactly as HF greedy search does, so near-ties break the same way.
        tokens = logits.argmax(-1)
        return tokens, logits.log_softmax(-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    # softmax rather than exp(logp): on CPU, exp of the very negative log-probs of a peaked distribution
    # (a trained policy) takes a slow path, ~10x a softmax of the same row.
    probs = _filtered_logits(logits, temperature, top_k, top_p).softmax(-1)
    tokens = sample_from_probs(probs, generator, uniform)
    # The log of the sampled token's probability instead of a log_softmax over the vocabulary: a sampled token
    # has p > 0 and softmax keeps p's relative precision, so the two agree to float rounding.
    return tokens, probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1).log()


__all__ = ["filtered_logprobs", "sample_from_logprobs", "sample_from_probs", "sample_step"]
