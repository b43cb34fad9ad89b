"""Per-GPU memory plan of a training step: an RL step's rollout phase and update phase, part by part (an SFT
or DPO step has the update phase only).

`verl.distributed.memory` counts model state (weights, gradients, optimizer moments) per rank; this adds
what a step needs on top on a rank that holds the actor: FSDP2's gathered layers and unsharded gradients,
activations (with and without activation checkpointing, kept on the device or offloaded to host memory, split
over sequence-parallel ranks), the response logits and their gradient (or, with chunked log-probs, one chunk
of them at a time), and the rollout engine (colocated vLLM's `gpu_memory_utilization` share of the device, or our sampler's gathered
weights and KV cache). It is arithmetic on the model's shape and the config, so `verl check` prints it on a
machine without a GPU, and it says which settings make a plan that does not fit fit.

Activations are counted tensor by tensor for a Llama/Qwen-style decoder layer (RMSNorm, GQA attention with
a fused kernel that keeps no [T, T] scores, SwiGLU MLP), as Hugging Face's implementation saves them for
backward. Constants that are assumptions, not derivations, are named below (`CUDA_RUNTIME_BYTES`,
`VLLM_ASLEEP_BYTES`); nothing here has been compared with a measured GPU run yet.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from verl.algorithms.head_logprobs import chunk_tokens
from verl.algorithms.logits import _CHUNK_ELEMENTS as LOGPROB_CHUNK_ELEMENTS

GIB = 2**30
CUDA_RUNTIME_BYTES = 1 * GIB
"""CUDA context, cuBLAS workspaces and NCCL buffers per process (assumed, typical for an H100 process)."""
VLLM_ASLEEP_BYTES = 1 * GIB
"""What a sleeping colocated vLLM keeps (CUDA graphs, its own buffers) once its KV cache and weights are
released (assumed)."""


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


@dataclass(frozen=True)
class ModelShape:
    """What the plan needs of a decoder-only LM: its sizes and where its parameters sit."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    total_params: int
    embed_params: int  # input embedding
    head_params: int  # output projection (0 when tied to the embedding)
    layer_params: int  # one decoder layer

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def root_params(self) -> int:
        """Parameters outside the decoder layers (FSDP2's root unit: embeddings, final norm, head)."""
        return self.total_params - self.layers * self.layer_params

    @classmethod
    def from_model(cls, model: object, layer: object) -> ModelShape:
        """From a (meta-device) Hugging Face causal LM and one of its decoder layers."""
        cfg = model.config  # type: ignore[attr-defined]
        cfg = getattr(cfg, "get_text_config", lambda: cfg)()
        heads = int(cfg.num_attention_heads)
        hidden = int(cfg.hidden_size)
        embed = model.get_input_embeddings().weight  # type: ignore[attr-defined]
        out = model.get_output_embeddings()  # type: ignore[attr-defined]
        tied = out is None or out.weight is embed or bool(getattr(cfg, "tie_word_embeddings", False))
        return cls(hidden=hidden, layers=int(cfg.num_hidden_layers), heads=heads,
                   kv_heads=int(getattr(cfg, "num_key_value_heads", None) or heads),
                   head_dim=int(getattr(cfg, "head_dim", None) or hidden // heads),
                   intermediate=int(getattr(cfg, "intermediate_size", None) or 4 * hidden),
                   vocab=int(cfg.vocab_size), total_params=sum(p.numel() for p in model.parameters()),
                   embed_params=embed.numel(), head_params=0 if tied else out.weight.numel(),
                   layer_params=sum(p.numel() for p in layer.parameters()))  # type: ignore[attr-defined]


def activation_bytes_per_token(shape: ModelShape, compute_bytes: int) -> int:
    """Bytes one decoder layer keeps for backward per token (no checkpointing).

    Each RMSNorm keeps its float32 input and its output (the weight's input); attention keeps the q/k/v
    projections' input, the rotated q and k and v (what the fused kernel saves), its output (and float32
    log-sum-exp per head) and the o-projection's input; the SwiGLU MLP keeps its input, gate, silu(gate),
    up and their product."""
    c, h, kv, i = compute_bytes, shape.hidden, shape.kv_dim, shape.intermediate
    norms = 2 * (4 * h + c * h)
    attention = c * (h + h + 2 * kv + h + h) + 4 * shape.heads
    mlp = c * (h + 4 * i)
    return norms + attention + mlp


@dataclass(frozen=True)
class PlanInputs:
    """Everything the plan depends on, in bytes and counts (built from a RunConfig by the trainer's start-up).

    `resident` is the model state per role on an actor rank as (params, grads, optimizer) bytes, from
    `verl.distributed.memory.estimate_memory` (sharding, placement and LoRA already applied)."""

    shape: ModelShape
    resident: dict[str, tuple[int, int, int]]
    compute_bytes: int  # dtype of the forward/backward (FSDP2's param_dtype, or the master dtype)
    master_bytes: int  # dtype of the actor's sharded weights, gradients and optimizer moments
    micro_batch: int  # sequences per forward/backward (actor.micro_batch_size)
    prompt_len: int
    response_len: int
    tokens_per_micro_batch: int | None = None  # actor.max_tokens_per_micro_batch (overrides micro_batch)
    activation_checkpointing: bool = False
    cpu_offload: bool = False  # fsdp.cpu_offload: the roles' sharded state in host memory, but those in `kept`
    offloaded: frozenset[str] = frozenset()  # roles offloaded by a switch of their own (actor/critic.cpu_offload)
    kept: frozenset[str] = frozenset()  # roles whose own switch keeps them on the device (actor/critic.cpu_offload)
    activation_offload: bool = False  # actor.activation_offload: saved tensors wait in host memory
    chunked_logprobs: bool = False  # actor.chunked_logprobs in effect: no [tokens, V] logits
    head_trained: bool = True  # the output head gets a gradient (not under LoRA)
    sequence_parallel: int = 1  # actor.sequence_parallel_size: one sequence's tokens split over this many ranks
    sharded: bool = True  # FSDP2 wraps the actor (gathered layers, unsharded gradients); False: one plain process
    padded_mask: bool = True  # rows of a micro-batch differ in padding: sdpa gets a 4-D mask (not flash-attn,
    # packed or split forwards)
    engine: str = "hf"  # "vllm" (colocated on the actor's ranks) or "hf"
    gpu_memory_utilization: float = 0.5
    rows_per_rank: int = 1  # sequences one actor rank samples per step
    vllm_colocated: bool = True
    samples: bool = True  # an RL run: a rollout phase before the update (SFT, DPO: none)

    def with_(self, **changes: object) -> PlanInputs:
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class MemoryPlan:
    """Per-GPU peak of each phase, part by part, against the device's memory (None: not known here)."""

    inputs: PlanInputs
    rollout: list[tuple[str, int]]
    update: list[tuple[str, int]]
    device_bytes: int | None
    notes: list[str]

    @property
    def rollout_peak(self) -> int:
        return sum(b for _, b in self.rollout)

    @property
    def update_peak(self) -> int:
        return sum(b for _, b in self.update)

    @property
    def fits(self) -> bool | None:
        if self.device_bytes is None:
            return None
        return max(self.rollout_peak, self.update_peak) <= self.device_bytes

    def render(self) -> str:
        """The phases as a table (GiB per GPU), the peaks against the device, and the notes."""
        width = max(len(name) for name, _ in self.rollout + self.update)
        lines = ["memory plan per GPU on an actor rank (GiB)"]
        phases = (("rollout phase", self.rollout, self.rollout_peak), ("update phase", self.update, self.update_peak))
        for title, parts, peak in phases if self.rollout else phases[1:]:
            lines.append(f"  {title}")
            lines += [f"    {name.ljust(width)}  {b / GIB:8.2f}" for name, b in parts]
            lines.append(f"    {'peak'.ljust(width)}  {peak / GIB:8.2f}{self._verdict(peak)}")
        if self.device_bytes is None:
            lines.append("  device memory unknown here: pass --gpu-memory GIB to check the fit")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    def _verdict(self, peak: int) -> str:
        if self.device_bytes is None:
            return ""
        return f"  of {self.device_bytes / GIB:.1f} ({'fits' if peak <= self.device_bytes else 'DOES NOT FIT'})"


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


def plan_memory(x: PlanInputs, device_bytes: int | None) -> MemoryPlan:
    """The rollout and update phases' parts on an actor rank (see the module docstring for what counts)."""
    s, c, m = x.shape, x.compute_bytes, x.master_bytes
    notes: list[str] = []
    offload = x.cpu_offload

    def state(role: str, which: tuple[int, ...]) -> int:
        parts = x.resident.get(role)
        off = role in x.offloaded or (offload and role not in x.kept)
        return 0 if parts is None or off else sum(parts[k] for k in which)

    roles = {"actor": "actor", "ref": "reference", "teacher": "teacher", "critic": "critic", "reward": "reward model"}
    resident_update = [(f"{roles[r]} weights + grads + optimizer (sharded)" if r in ("actor", "critic") else
                        f"{roles[r]} weights (sharded)", state(r, (0, 1, 2))) for r in roles if r in x.resident]
    resident_rollout = [(f"{roles[r]} weights + optimizer (sharded; grads freed)" if r in ("actor", "critic") else
                         f"{roles[r]} weights (sharded)", state(r, (0, 2))) for r in roles if r in x.resident]
    if offload:
        notes.append("fsdp.cpu_offload: sharded weights, gradients and optimizer moments live in host memory")
    elif x.offloaded & set(x.resident):
        notes.append(f"{', '.join(sorted(x.offloaded & set(x.resident)))}.cpu_offload: that state lives in host "
                     "memory")

    update = [*resident_update]
    if x.sharded:
        # FSDP2 keeps its root unit (embeddings, final norm, head) gathered from forward to backward, and its
        # gradient unsharded until the backward ends; each layer is gathered (with one prefetched) in turn
        update += [("gathered: root (embeddings, head) + 2 layers", (s.root_params + 2 * s.layer_params) * c),
                   ("unsharded gradients: root + 1 layer", (s.root_params + s.layer_params) * c)]
    update += forward_backward_parts(x, notes)
    update.append(("CUDA context, NCCL buffers (assumed)", CUDA_RUNTIME_BYTES))
    if not x.samples:
        return MemoryPlan(inputs=x, rollout=[], update=update, device_bytes=device_bytes, notes=notes)
    rollout = list(resident_rollout)
    if x.engine == "vllm" and x.vllm_colocated:
        update.insert(-1, ("vLLM asleep (KV cache and weights released)", VLLM_ASLEEP_BYTES))
        rollout.append(("weight push: one full tensor at a time (largest)",
                        max(s.embed_params, s.head_params, 1) * m))
        if device_bytes is not None:
            budget = int(x.gpu_memory_utilization * device_bytes)
            rollout.append((f"vLLM: gpu_memory_utilization {x.gpu_memory_utilization:g} x device", budget))
            room = budget - s.total_params * c
            need = x.rows_per_rank * (x.prompt_len + x.response_len) * s.layers * 2 * s.kv_dim * c
            notes.append(f"vLLM's share holds its weights ({s.total_params * c / GIB:.1f} GiB) and about "
                         f"{max(room, 0) / GIB:.1f} GiB of KV cache and activations; all {x.rows_per_rank} rows "
                         f"of this rank at full length need {need / GIB:.1f} GiB of KV cache"
                         + ("" if room >= need else " (vLLM runs them in waves: slower, not out of memory)"))
        else:
            notes.append(f"vLLM takes rollout.vllm.gpu_memory_utilization={x.gpu_memory_utilization:g} of the "
                         "device, unknown here")
    elif x.engine == "vllm":
        notes.append("vLLM runs on ranks of its own: its share of those devices is not on the actor's")
    else:
        rows = x.rows_per_rank
        rollout.append(("sampler: gathered policy weights", s.total_params * c))
        rollout.append((f"sampler: KV cache ({rows} rows x {x.prompt_len + x.response_len} tokens)",
                        rows * (x.prompt_len + x.response_len) * s.layers * 2 * s.kv_dim * c))
        rollout.append(("sampler: next-token logits (float32)", rows * s.vocab * 4))
    rollout.append(("CUDA context, NCCL buffers (assumed)", CUDA_RUNTIME_BYTES))
    return MemoryPlan(inputs=x, rollout=rollout, update=update, device_bytes=device_bytes, notes=notes)


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
    logits shrink by it (its split forward packs the rows and builds no mask).
    """
    s, c, m, sp = x.shape, x.compute_bytes, x.master_bytes, max(x.sequence_parallel, 1)
    tokens, response_tokens = _mb_tokens(x)
    rows = max(1, tokens // max(x.prompt_len + x.response_len, 1))
    seq = tokens // rows
    tokens, response_tokens = -(-tokens // sp), -(-response_tokens // sp)
    where = f"{tokens} tokens" + (f" per rank of {sp}" if sp > 1 else "")
    per_token = activation_bytes_per_token(s, c)
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
    tied_held = s.vocab * s.hidden * m if not x.sharded and s.head_params == 0 and x.head_trained else 0
    layer = tokens * ((per_token if x.activation_checkpointing or x.activation_offload else 0) + 2 * c * s.intermediate)
    chunk_rows = min(chunk_tokens(s.vocab), response_tokens)
    if x.chunked_logprobs:
        logprobs = (chunk_rows * s.vocab * (3 * 4 + (c if c != 4 else 0))
                    + (s.vocab * s.hidden * 4 if x.head_trained else 0))
        logprobs_name = f"chunked log-probs ({chunk_rows} of {response_tokens} response tokens x {s.vocab} at a time)"
    else:
        upcast = 1 if c == 4 else 3
        logprobs = (2 * response_tokens * s.vocab * c
                    + upcast * min(LOGPROB_CHUNK_ELEMENTS, response_tokens * s.vocab) * 4)
        logprobs_name = f"logits + their gradient ({response_tokens} response tokens x {s.vocab})"
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
    layer = c * s.hidden if x.activation_checkpointing else activation_bytes_per_token(s, c)
    return tokens * (s.layers * layer + (4 + 2 * c) * s.hidden)


def _micro_batch_fit(x: PlanInputs, device_bytes: int) -> int | None:
    """The largest micro-batch (sequences) whose update phase fits, or None if not even one does."""
    best = None
    for b in range(1, max(x.micro_batch, 1) + 1):
        if plan_memory(x.with_(micro_batch=b, tokens_per_micro_batch=None), device_bytes).update_peak <= device_bytes:
            best = b
    return best


def suggestions(x: PlanInputs, device_bytes: int) -> list[str]:
    """Settings that make a plan fit, each with its peaks: one change at a time first, then combinations.
    Empty when the plan fits as it is."""
    plan = plan_memory(x, device_bytes)
    if plan.fits:
        return []
    out: list[str] = []

    def describe(keys: str, y: PlanInputs) -> str:
        p = plan_memory(y, device_bytes)
        verdict = "fits" if p.fits else "still does not fit"
        host = f"; {offloaded_activation_bytes(y) / GIB:.1f} GiB of host memory" if y.activation_offload else ""
        return (f"{keys}: rollout {p.rollout_peak / GIB:.1f} GiB, update {p.update_peak / GIB:.1f} GiB "
                f"({verdict}{host})")

    fixes: list[tuple[str, dict[str, object]]] = []  # (keys, changes) in the order worth trying
    if plan.update_peak > device_bytes:
        if not x.chunked_logprobs:
            fixes.append(("actor.chunked_logprobs=true", {"chunked_logprobs": True}))
        if not x.activation_checkpointing:
            fixes.append(("fsdp.activation_checkpointing=true", {"activation_checkpointing": True}))
        for ckpt in sorted({x.activation_checkpointing, True}):
            b = _micro_batch_fit(x.with_(activation_checkpointing=ckpt), device_bytes)
            if b is not None and (b < x.micro_batch or x.tokens_per_micro_batch is not None):
                keys = (f"{'fsdp.activation_checkpointing=true, ' if ckpt and not x.activation_checkpointing else ''}"
                        f"actor.micro_batch_size={b}"
                        + (", actor.max_tokens_per_micro_batch=null" if x.tokens_per_micro_batch else ""))
                fixes.append((keys, {"activation_checkpointing": ckpt, "micro_batch": b,
                                     "tokens_per_micro_batch": None}))
    if plan.rollout_peak > device_bytes and x.engine == "vllm" and x.vllm_colocated:
        rest = plan.rollout_peak - int(x.gpu_memory_utilization * device_bytes)
        util = math.floor(20 * (device_bytes - rest) / device_bytes) / 20  # a multiple of 0.05 that fits
        weights = x.shape.total_params * x.compute_bytes
        if util * device_bytes > weights:
            fixes.append((f"rollout.vllm.gpu_memory_utilization={util:g}", {"gpu_memory_utilization": util}))
        else:
            out.append(f"rollout.vllm.gpu_memory_utilization: the trainer's resident state leaves "
                       f"{(device_bytes - rest) / GIB:.1f} GiB, less than vLLM's weights ({weights / GIB:.1f} GiB)")
    if plan.update_peak > device_bytes and not x.activation_offload:
        fixes.append(("actor.activation_offload=true", {"activation_offload": True}))
    if not x.cpu_offload:
        fixes.append(("fsdp.cpu_offload=true", {"cpu_offload": True}))
    out += [describe(keys, x.with_(**changes)) for keys, changes in fixes]
    if plan.update_peak <= device_bytes or plan.rollout_peak <= device_bytes:
        return list(dict.fromkeys(out))
    # both phases over: the first fix of each phase, together
    update_fix = next((f for f in fixes if plan_memory(x.with_(**f[1]), device_bytes).update_peak <= device_bytes),
                      None)
    rollout_fix = next((f for f in fixes if plan_memory(x.with_(**f[1]), device_bytes).rollout_peak <= device_bytes),
                       None)
    if update_fix and rollout_fix and update_fix is not rollout_fix:
        both = x.with_(**{**update_fix[1], **rollout_fix[1]})
        out.append(describe(f"together: {update_fix[0]}, {rollout_fix[0]}", both))
    return list(dict.fromkeys(out))


__all__ = ["CHUNKED_AUTO_LOGITS", "CUDA_RUNTIME_BYTES", "MemoryPlan", "ModelShape", "PlanInputs", "VLLM_ASLEEP_BYTES",
           "activation_bytes_per_token", "chunks_logits", "forward_backward_parts", "micro_batch_tokens",
           "offloaded_activation_bytes",
           "plan_memory", "suggestions"]
