"""What one update micro-batch holds on the device beyond the model state: its activations, mask, logits and
backward."""

from __future__ import annotations

from verl.algorithms.head_logprobs import chunk_tokens
from verl.algorithms.logits import _CHUNK_ELEMENTS as LOGPROB_CHUNK_ELEMENTS
from verl.distributed.memory_plan_types import GIB, ModelShape, PlanInputs

CHUNKED_AUTO_LOGITS = 1 << 28
"""`actor.chunked_logprobs: auto` turns on where a micro-batch's response logits reach this many elements
(1 GiB in float32; 1,767 tokens at Qwen2.5's vocabulary): below it the logits cost less than the extra head
projection is worth."""


def chunks_logits(setting: bool | str, response_tokens: int, vocab: int) -> bool:
    """Whether `actor.chunked_logprobs` computes the log-probs without the logits, for a micro-batch of
    `response_tokens` (the plan and the trainer decide by this one rule)."""
    if setting == "auto":
        return response_tokens * vocab >= CHUNKED_AUTO_LOGITS
    return bool(setting)


def activation_bytes_per_token(shape: ModelShape, compute_bytes: int, tensor_parallel: int = 1) -> int:
    """Bytes one decoder layer keeps for backward per token (no checkpointing) on one rank.

    Each RMSNorm keeps its float32 input and its output (the weight's input); attention keeps the q/k/v
    projections' input, the rotated q and k and v (what the fused kernel saves), its output (and float32
    log-sum-exp per head) and the o-projection's input; the SwiGLU MLP keeps its input, gate, silu(gate),
    up and their product. Tensor parallelism splits what lies between a column-wise and a row-wise projection
    (heads, the intermediate size); the norms' and the projections' inputs stay whole on every rank."""
    c, h, kv, i, t = compute_bytes, shape.hidden, shape.kv_dim, shape.intermediate, max(tensor_parallel, 1)
    norms = 2 * (4 * h + c * h)
    attention = c * h + (c * (h + 2 * kv + h + h) + 4 * shape.heads) // t
    mlp = c * h + c * 4 * i // t
    return norms + attention + mlp


def micro_batch_tokens(micro_batch: int, tokens_per_micro_batch: int | None, prompt_len: int,
                       response_len: int) -> tuple[int, int]:
    """(tokens, response tokens) of one update micro-batch at full length: `micro_batch` sequences, or a
    token budget (`actor.max_tokens_per_micro_batch`) filled with sequences of that shape."""
    seq = prompt_len + response_len
    if tokens_per_micro_batch is not None:
        return tokens_per_micro_batch, tokens_per_micro_batch * response_len // seq
    return micro_batch * seq, micro_batch * response_len


def _mb_tokens(x: PlanInputs) -> tuple[int, int]:
    """(tokens, response tokens) of one micro-batch."""
    return micro_batch_tokens(x.micro_batch, x.tokens_per_micro_batch, x.prompt_len, x.response_len)


def forward_backward_parts(x: PlanInputs, notes: list[str] | None = None) -> list[tuple[str, int]]:
    """What one micro-batch's forward and backward hold beyond the model state, as parts whose sum is its peak.

    What stays from the forward to the backward: the activations saved for backward (every layer's, or with
    checkpointing each layer's input; with activation offload only what is in flight), and with padded rows
    the 4-D attention mask sdpa is given ([B, 1, T, T], boolean and additive in the compute dtype, kept by
    every layer). On top of it, the
    backward's largest working set, which is one of three at different times:
    * the log-probs' backward, while the final norm's and head's inputs still exist: without chunking, the
      response logits kept for backward and their gradient (each logits-sized, in the compute dtype) and the
      float32 row chunks of the log-softmax (one in float32, three upcast from bf16); chunked, one chunk of
      tokens x vocabulary at a time (its projection, the float32 log-softmax and softmax, the gradient written
      over one of them) and the float32 accumulator of the head's gradient;
    * one layer's backward: its activations (recomputed under checkpointing) and the gradients of its MLP's
      two widest tensors; one process holds a tied head's gradient meanwhile (autograd adds it to the
      embeddings' gradient at the very end);
    * unsharded with tied embeddings, the end: that held gradient, the embeddings' own and their sum.
    Sequence parallelism splits a micro-batch's tokens over `sequence_parallel` ranks, so the activations and
    logits shrink by it (its split forward packs the rows and builds no mask); tensor parallelism splits the
    layers' inner activations and the logits over the vocabulary (`activation_bytes_per_token`).
    """
    s, c, m, sp, t = x.shape, x.compute_bytes, x.master_bytes, max(x.sequence_parallel, 1), max(x.tensor_parallel, 1)
    tokens, response_tokens = _mb_tokens(x)
    rows = max(1, tokens // max(x.prompt_len + x.response_len, 1))
    seq = tokens // rows
    tokens, response_tokens = -(-tokens // sp), -(-response_tokens // sp)
    where = f"{tokens} tokens" + (f" per rank of {sp}" if sp > 1 else "")
    per_token = activation_bytes_per_token(s, c, t)
    vocab = s.vocab // t  # the logits' and the head's share of this rank (vocabulary-parallel)
    final = (4 + 2 * c) * s.hidden  # final norm (float32 input, output) and the head's input
    parts: list[tuple[str, int]] = []
    if x.padded_mask:
        parts.append((f"attention mask (sdpa, {rows} padded rows x {seq}^2)", rows * seq * seq * (c + 1)))
    if x.activation_offload:
        kept, kept_name = 0, f"activations ({where}): offloaded to host memory"
        if notes is not None:
            notes.append(f"actor.activation_offload: {offloaded_activation_bytes(x) / GIB:.1f} GiB of saved "
                         "activations per micro-batch wait in pinned host memory")
    elif x.activation_checkpointing:
        kept, kept_name = tokens * s.layers * c * s.hidden, f"activations ({where}, checkpointed: layer inputs)"
    else:
        kept, kept_name = tokens * s.layers * per_token, f"activations ({where}, all {s.layers} layers)"
    parts.append((kept_name, kept))
    if s.vision is not None and x.vision_trained:  # the tower's saved activations, every prompt token an image's
        patches = max(tokens - response_tokens, 0) * s.vision.patches_per_token
        parts.append((f"vision tower activations (at most {patches} patches, {s.vision.depth} blocks)",
                      patches * s.vision.depth * activation_bytes_per_token(s.vision, c)))
    tied_held = vocab * s.hidden * m if not x.sharded and s.head_params == 0 and x.head_trained else 0
    layer = tokens * ((per_token if x.activation_checkpointing or x.activation_offload else 0)
                      + 2 * c * s.intermediate // t)
    chunk_rows = min(chunk_tokens(s.vocab), response_tokens)
    if x.chunked_logprobs:
        logprobs = (chunk_rows * s.vocab * (3 * 4 + (c if c != 4 else 0))
                    + (s.vocab * s.hidden * 4 if x.head_trained else 0))
        logprobs_name = f"chunked log-probs ({chunk_rows} of {response_tokens} response tokens x {s.vocab} at a time)"
    else:
        upcast = 1 if c == 4 else 3
        logprobs = (2 * response_tokens * vocab * c
                    + upcast * min(LOGPROB_CHUNK_ELEMENTS, response_tokens * vocab) * 4)
        logprobs_name = f"logits + their gradient ({response_tokens} response tokens x {vocab})"
    phases = [(f"backward: {logprobs_name}", tokens * final + logprobs),
              (f"backward: one layer ({where})" + (" + the tied head's gradient" if tied_held else ""),
               layer + tied_held),
              ("backward: the tied embeddings' gradients (held, own, sum)", 3 * tied_held - kept)]
    parts.append(max(phases, key=lambda part: part[1]))
    return parts


def offloaded_activation_bytes(x: PlanInputs) -> int:
    """Host memory that activation offload fills per micro-batch (per GPU): every layer's saved tensors, or
    with checkpointing its input only."""
    s, c = x.shape, x.compute_bytes
    tokens = -(-_mb_tokens(x)[0] // max(x.sequence_parallel, 1))
    layer = c * s.hidden if x.activation_checkpointing else activation_bytes_per_token(s, c, x.tensor_parallel)
    return tokens * (s.layers * layer + (4 + 2 * c) * s.hidden)
