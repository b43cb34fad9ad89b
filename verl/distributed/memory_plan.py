"""Per-GPU memory plan of a run: its start-up (the models loading, before the first step) and a training
step's rollout phase and update phase, part by part (an SFT or DPO step has the update phase only); for an
asynchronous run, also a rollout rank's (`devices.rollout`: ranks that only generate).

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
class RolloutRank:
    """A rank of an asynchronous run that only generates (`devices.rollout`): it loads the whole policy in the
    dtype the trainer holds it in (the master dtype: a rollout rank is not sharded), then either hands the GPU
    to vLLM (the policy moved to the CPU first; vLLM stays awake, taking its `gpu_memory_utilization` share)
    or samples with our sampler from that copy; every weight delivery arrives in buckets in the rollout's
    dtype (`verl.trainer.rollout.async_rollout`)."""

    ranks: int  # how many rollout ranks
    weights_bytes: int  # the whole policy as loaded (master dtype)
    weight_bytes_per_element: int  # ... its element size: our sampler's KV cache and logits are in it
    wire_bytes: int  # element size of a delivery (the rollout's compute dtype)
    rows: int  # sequences one rollout rank samples per step
    engine: str = "hf"
    gpu_memory_utilization: float = 0.5
    bucket_bytes: int = 64 * 2**20  # the size deliveries are cut into (`async_rollout.BUCKET_BYTES`)


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
    # start-up: (role, the whole model's bytes in the dtype it is held in, ranks its weights are sharded over)
    loading: tuple[tuple[str, int, int], ...] = ()
    reads_shards: bool = True  # built on the meta device, each rank reads its shards; False: loaded whole first
    whole_reason: str = ""  # why the start-up loads whole models (with reads_shards=False)
    world_size: int = 1
    rollout_rank: RolloutRank | None = None  # devices.rollout: the ranks that only generate

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
    startup: list[tuple[str, int]] = dataclasses.field(default_factory=list)  # the start-up's peak moment
    startup_moment: str = ""  # which moment of the start-up that is
    rollout_rank_startup: list[tuple[str, int]] = dataclasses.field(default_factory=list)
    rollout_rank: list[tuple[str, int]] = dataclasses.field(default_factory=list)  # a rollout rank generating
    rollout_rank_notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def startup_peak(self) -> int:
        return sum(b for _, b in self.startup)

    @property
    def rollout_rank_peak(self) -> int:
        return max(sum(b for _, b in self.rollout_rank_startup), sum(b for _, b in self.rollout_rank))

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
        peaks = [self.startup_peak, self.rollout_peak, self.update_peak]
        if self.rollout_rank:
            peaks.append(self.rollout_rank_peak)
        return max(peaks) <= self.device_bytes

    def render(self) -> str:
        """The phases as a table (GiB per GPU), the peaks against the device, and the notes; then a rollout
        rank's, for an asynchronous run."""
        startup = f"start-up phase (models loading, before the first step; peak: {self.startup_moment})"
        phases = [(startup, self.startup), ("rollout phase", self.rollout), ("update phase", self.update)]
        lines = ["memory plan per GPU on an actor rank (GiB)", *self._table([p for p in phases if p[1]])]
        if self.device_bytes is None:
            lines.append("  device memory unknown here: pass --gpu-memory GIB to check the fit")
        lines += [f"  note: {n}" for n in self.notes]
        if self.rollout_rank:
            lines.append(f"memory plan per GPU on a rollout rank (GiB; devices.rollout, "
                         f"{self.inputs.rollout_rank.ranks} rank(s) that only generate)")
            lines += self._table([("start-up phase (the policy loading)", self.rollout_rank_startup),
                                  ("generating phase", self.rollout_rank)])
            lines += [f"  note: {n}" for n in self.rollout_rank_notes]
        return "\n".join(lines)

    def _table(self, phases: list[tuple[str, list[tuple[str, int]]]]) -> list[str]:
        width = max(len(name) for _, parts in phases for name, _ in parts)
        lines = []
        for title, parts in phases:
            peak = sum(b for _, b in parts)
            lines.append(f"  {title}")
            lines += [f"    {name.ljust(width)}  {b / GIB:8.2f}" for name, b in parts]
            lines.append(f"    {'peak'.ljust(width)}  {peak / GIB:8.2f}{self._verdict(peak)}")
        return lines

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
        return _complete(x, [], update, device_bytes, notes)
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
    return _complete(x, rollout, update, device_bytes, notes)


def _complete(x: PlanInputs, rollout: list[tuple[str, int]], update: list[tuple[str, int]],
              device_bytes: int | None, notes: list[str]) -> MemoryPlan:
    """The step's phases with the start-up's peak moment and, for an asynchronous run, a rollout rank's plan."""
    moment, startup = max(startup_moments(x, device_bytes), key=lambda m: sum(b for _, b in m[1]))
    notes = [*startup_notes(x), *notes]
    if x.rollout_rank is None:
        return MemoryPlan(inputs=x, rollout=rollout, update=update, device_bytes=device_bytes, notes=notes,
                          startup=startup, startup_moment=moment)
    rank_startup, rank_generating, rank_notes = rollout_rank_parts(x, device_bytes)
    return MemoryPlan(inputs=x, rollout=rollout, update=update, device_bytes=device_bytes, notes=notes,
                      startup=startup, startup_moment=moment, rollout_rank_startup=rank_startup,
                      rollout_rank=rank_generating, rollout_rank_notes=rank_notes)


ROLE_NAMES = {"actor": "policy", "ref": "reference", "teacher": "teacher", "critic": "critic"}


def _offloaded(x: PlanInputs, role: str) -> bool:
    return role in x.offloaded or (x.cpu_offload and role not in x.kept)


def startup_moments(x: PlanInputs, device_bytes: int | None) -> list[tuple[str, list[tuple[str, int]]]]:
    """What an actor rank holds at each moment of the start-up that may be its peak, in the order the trainer
    builds its models (`verl.trainer.compose.components.compose_rl`): the reference and the teacher sharded first,
    then the actor, then a colocated vLLM starts (awake, its share of the device, then asleep), then the
    critic is sharded. No gradients and no optimizer moments yet: FSDP2 allocates gradients in the first
    backward and torch's AdamW its moments at the first `step()` (a resumed checkpoint loads them when the
    loop starts, which the rollout phase's plan covers).

    `x.reads_shards` (each role built on the meta device, FSDP2-sharded, then each rank reads only its rows
    of the safetensors files: `verl.models.sharded_load`): a role holds its shard in the dtype it is
    held in (the master dtype for trained roles, the compute dtype for frozen ones; none on the GPU where its
    `cpu_offload` puts the shards in host memory); the rows in flight pass through host memory, one tensor
    at a time, and are written into the shard. Otherwise each rank loads the policy whole on its device and
    makes whole copies of it (the reference, the critic; the teacher loads whole from its own path), each
    sharded in turn: the policy stays whole until every copy is made.
    A role sharded over one rank (one process, NO_SHARD) holds its whole model either way."""
    ctx = ("CUDA context, NCCL buffers (assumed)", CUDA_RUNTIME_BYTES)
    load = {role: (whole, ranks) for role, whole, ranks in x.loading}
    held: dict[str, tuple[str, int]] = {}
    moments: list[tuple[str, list[tuple[str, int]]]] = []

    def shard(role: str) -> None:
        whole, ranks = load[role]
        name = ROLE_NAMES[role]
        if _offloaded(x, role):
            held[role] = (f"{name} weights: shards in host memory (cpu_offload)", 0)
        elif ranks > 1:
            held[role] = (f"{name} weights: this rank's shard (1/{ranks})", -(-whole // ranks))
        else:
            held[role] = (f"{name} weights: whole (not sharded over several ranks)", whole)

    def snap(moment: str) -> None:
        moments.append((moment, [*held.values(), ctx]))

    frozen = [role for role in ("ref", "teacher") if role in load]
    if x.reads_shards:
        for role in frozen:
            shard(role)
    elif "actor" in load:
        def whole(role: str, how: str) -> tuple[str, int]:
            later = "before sharding" if load[role][1] > 1 else "not sharded over several ranks"
            return (f"{ROLE_NAMES[role]} weights: {how} whole ({later})", load[role][0])

        held["actor"] = whole("actor", "loaded")
        for role in (*frozen, "critic"):
            if role in load:
                how = "loaded" if role == "teacher" else "copied from the policy"
                held[role] = whole(role, how)
                snap(f"{ROLE_NAMES[role]} {how} whole")
                if role != "critic":  # the critic is sharded after the actor (and after vLLM starts)
                    shard(role)
        if len(load) == 1:
            snap("policy loaded whole")
    if "actor" in load:
        shard("actor")
    if x.samples and x.engine == "vllm" and x.vllm_colocated and device_bytes is not None:
        budget = int(x.gpu_memory_utilization * device_bytes)
        held["vllm"] = (f"vLLM starting: gpu_memory_utilization {x.gpu_memory_utilization:g} x device", budget)
        snap("while vLLM starts")
        held["vllm"] = ("vLLM asleep (KV cache and weights released)", VLLM_ASLEEP_BYTES)
    if "critic" in load:
        shard("critic")
    snap("models loaded")
    return moments


def startup_notes(x: PlanInputs) -> list[str]:
    """How the start-up loads (each rank its shards, or whole copies first, and why)."""
    if not x.loading:
        return []
    whole = [ROLE_NAMES[r] for r, _, ranks in x.loading if ranks <= 1 and not _offloaded(x, r)]
    held_whole = f"; {', '.join(whole)} held whole on every rank (not sharded over several ranks)" if whole else ""
    if x.reads_shards:
        largest = max(x.shape.embed_params, x.shape.head_params, x.shape.intermediate * x.shape.hidden)
        ranks = max((n for _, _, n in x.loading), default=1)
        return [f"start-up: each role is built on the meta device and each rank reads only its shards from the "
                f"safetensors files (one tensor's rows at a time through host memory: at most "
                f"{largest * x.master_bytes / max(ranks, 1) / GIB:.2f} GiB here); gradients and optimizer "
                f"moments are allocated at the first step{held_whole}"]
    return [f"start-up: because of {x.whole_reason or 'a whole load'}, each actor rank loads the policy whole on "
            f"its GPU and copies it whole (reference, critic) before sharding{held_whole}"]


def sharded_startup_peak(x: PlanInputs, ranks: int | None, device_bytes: int | None) -> int:
    """The start-up peak if each rank read only its own shards: each role's 1/`ranks` (None: over the ranks
    it is sharded over in `x`)."""
    y = x.with_(reads_shards=True, loading=tuple((r, whole, ranks or n) for r, whole, n in x.loading))
    return max(sum(b for _, b in parts) for _, parts in startup_moments(y, device_bytes))


def rollout_rank_parts(x: PlanInputs, device_bytes: int | None
                       ) -> tuple[list[tuple[str, int]], list[tuple[str, int]], list[str]]:
    """(start-up, generating, notes) of a rollout rank (`RolloutRank`): it loads the whole policy first; vLLM
    then gets the device (the policy moved to the CPU) and stays awake, or our sampler generates from that
    copy with its KV cache; every weight delivery lands in a bucket on the device (at most
    `bucket_bytes`, or one tensor larger than that) before it is written into the weights."""
    r, s = x.rollout_rank, x.shape
    assert r is not None
    ctx = ("CUDA context, NCCL buffers (assumed)", CUDA_RUNTIME_BYTES)
    startup = [("policy weights: loaded whole (master dtype; a rollout rank is not sharded)", r.weights_bytes), ctx]
    largest = max(s.embed_params, s.head_params, s.intermediate * s.hidden)
    bucket = ("weight delivery: one bucket (64 MiB, or the largest tensor)", max(r.bucket_bytes, largest * r.wire_bytes))
    seq = x.prompt_len + x.response_len
    notes: list[str] = []
    if r.engine == "vllm":
        if device_bytes is None:
            generating = [bucket, ctx]
            notes.append(f"vLLM takes rollout.vllm.gpu_memory_utilization={r.gpu_memory_utilization:g} of the "
                         "device, unknown here")
        else:
            budget = int(r.gpu_memory_utilization * device_bytes)
            generating = [(f"vLLM (awake): gpu_memory_utilization {r.gpu_memory_utilization:g} x device", budget),
                          bucket, ctx]
            room = budget - s.total_params * r.wire_bytes
            need = r.rows * seq * s.layers * 2 * s.kv_dim * r.wire_bytes
            notes.append(f"the policy moves to the CPU before vLLM starts; vLLM's share holds its weights "
                         f"({s.total_params * r.wire_bytes / GIB:.1f} GiB) and about {max(room, 0) / GIB:.1f} GiB "
                         f"of KV cache; all {r.rows} rows of this rank at full length need {need / GIB:.1f} GiB"
                         + ("" if room >= need else " (vLLM runs them in waves: slower, not out of memory)"))
    else:
        w = r.weight_bytes_per_element
        generating = [("policy weights: whole (master dtype)", r.weights_bytes),
                      (f"sampler: KV cache ({r.rows} rows x {seq} tokens)", r.rows * seq * s.layers * 2 * s.kv_dim * w),
                      ("sampler: next-token logits (float32)", r.rows * s.vocab * 4), bucket, ctx]
    return startup, generating, notes


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


def _startup_advice(x: PlanInputs, plan: MemoryPlan, device_bytes: int,
                    fixes: list[tuple[str, dict[str, object]]]) -> list[str]:
    """What makes a start-up that does not fit fit: a smaller vLLM share where vLLM's start is its peak (added to
    `fixes`); where whole models are loaded first, what reading each rank's shards would hold instead."""
    out = []
    if plan.startup_moment == "while vLLM starts" and plan.rollout_peak <= device_bytes:
        budget = int(x.gpu_memory_utilization * device_bytes)
        util = math.floor(20 * (device_bytes - (plan.startup_peak - budget)) / device_bytes) / 20
        if util * device_bytes > x.shape.total_params * x.compute_bytes:
            fixes.append((f"rollout.vllm.gpu_memory_utilization={util:g}", {"gpu_memory_utilization": util}))
    if not x.reads_shards:
        ranks, where = None, "over the ranks each role has here"
        if x.world_size <= 1:  # one process: the smallest launch whose ranks, each reading its shards, fit
            ranks = next((n for n in (2, 4, 8, 16, 32, 64)
                          if sharded_startup_peak(x, n, device_bytes) <= device_bytes), 64)
            where = f"on {ranks} GPUs (--nproc {ranks})"
        peak = sharded_startup_peak(x, ranks, device_bytes)
        out.append(f"start-up: whole models before sharding hold {plan.startup_peak / GIB:.1f} GiB, because of "
                   f"{x.whole_reason or 'a whole load'}; each rank reading only its shards {where} would hold "
                   f"{peak / GIB:.1f} GiB ({'fits' if peak <= device_bytes else 'still does not fit'})")
    return out


def _rollout_rank_advice(x: PlanInputs, plan: MemoryPlan, device_bytes: int) -> list[str]:
    """Why a rollout rank does not fit, and the vLLM share that would fit where that is the cause."""
    r = x.rollout_rank
    assert r is not None
    out = []
    loading = sum(b for _, b in plan.rollout_rank_startup)
    if loading > device_bytes:
        out.append(f"rollout rank: loading the whole policy ({r.weights_bytes / GIB:.1f} GiB in the master dtype) "
                   f"does not fit the GPU, and no setting shards a rollout rank's copy")
    generating = sum(b for _, b in plan.rollout_rank)
    if generating > device_bytes and r.engine == "vllm":
        rest = generating - int(r.gpu_memory_utilization * device_bytes)
        util = math.floor(20 * (device_bytes - rest) / device_bytes) / 20
        y = x.with_(rollout_rank=dataclasses.replace(r, gpu_memory_utilization=util))
        out.append(f"rollout rank: rollout.vllm.gpu_memory_utilization={util:g}: generating "
                   f"{sum(b for _, b in plan_memory(y, device_bytes).rollout_rank) / GIB:.1f} GiB")
    elif generating > device_bytes:
        out.append(f"rollout rank: our sampler's whole policy and KV cache need {generating / GIB:.1f} GiB; fewer "
                   "rows per rollout rank (more devices.rollout ranks) shrink the KV cache")
    return out


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
        return (f"{keys}: rollout {p.rollout_peak / GIB:.1f} GiB, update {p.update_peak / GIB:.1f} GiB, start-up "
                f"{p.startup_peak / GIB:.1f} GiB ({verdict}{host})")

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
    if plan.startup_peak > device_bytes:
        out += _startup_advice(x, plan, device_bytes, fixes)
    if plan.rollout_rank and plan.rollout_rank_peak > device_bytes:
        out += _rollout_rank_advice(x, plan, device_bytes)
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


__all__ = ["CHUNKED_AUTO_LOGITS", "CUDA_RUNTIME_BYTES", "MemoryPlan", "ModelShape", "PlanInputs", "RolloutRank",
           "VLLM_ASLEEP_BYTES", "activation_bytes_per_token", "chunks_logits", "forward_backward_parts",
           "micro_batch_tokens", "offloaded_activation_bytes", "plan_memory", "rollout_rank_parts",
           "sharded_startup_peak", "startup_moments", "startup_notes", "suggestions"]
