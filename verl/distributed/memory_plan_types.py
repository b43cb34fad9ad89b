"""The memory plan's inputs (the model's shape, the run's settings, a rollout rank), its result, and its assumed
constants."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

GIB = 2**30
CUDA_RUNTIME_BYTES = 1 * GIB
"""CUDA context, cuBLAS workspaces and NCCL buffers per process (assumed, typical for an H100 process)."""
VLLM_ASLEEP_BYTES = 1 * GIB
"""What a sleeping colocated vLLM keeps (CUDA graphs, its own buffers) once its KV cache and weights are
released (assumed)."""


@dataclass(frozen=True)
class VisionShape:
    """A vision-language model's vision tower, as the plan counts its activations: `depth` blocks of `hidden`
    width over the image patches (each image token is `patches_per_token` patches before the merger)."""

    depth: int
    hidden: int
    intermediate: int
    heads: int
    patches_per_token: int

    @property
    def kv_dim(self) -> int:  # full attention over the patches: as wide as the blocks
        return self.hidden

    @classmethod
    def from_config(cls, cfg: object) -> VisionShape | None:
        """From a Qwen2-VL-style `vision_config`, or None without one."""
        v = getattr(cfg, "vision_config", None)
        if v is None:
            return None
        hidden = int(getattr(v, "embed_dim", None) or v.hidden_size)  # Qwen2-VL: embed_dim (hidden_size: the LM's)
        ratio = getattr(v, "mlp_ratio", None)
        intermediate = int(getattr(v, "intermediate_size", None) or (ratio or 4) * hidden)
        return cls(depth=int(v.depth), hidden=hidden, intermediate=intermediate, heads=int(v.num_heads),
                   patches_per_token=int(getattr(v, "spatial_merge_size", 2)) ** 2)


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
    vision: VisionShape | None = None  # a vision-language model's tower (its parameters are in total_params)

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
                   layer_params=sum(p.numel() for p in layer.parameters()),  # type: ignore[attr-defined]
                   vision=VisionShape.from_config(model.config))  # type: ignore[attr-defined]


@dataclass(frozen=True)
class RolloutRank:
    """A rank of an asynchronous run that only generates (`devices.rollout`): it loads the whole policy in the
    dtype the trainer holds it in (the master dtype: a rollout rank is not sharded), then either hands the GPU
    to vLLM (the policy moved to the CPU first; vLLM stays awake, taking its `gpu_memory_utilization` share)
    or samples with our sampler from that copy; every weight delivery arrives in buckets in the rollout's
    dtype (`verl.rollout.async_rollout`)."""

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
    vision_trained: bool = True  # a vision-language policy's tower gets a gradient (actor.freeze_vision_tower)
    sequence_parallel: int = 1  # actor.sequence_parallel_size: one sequence's tokens split over this many ranks
    sharded: bool = True  # FSDP2 wraps the actor (gathered layers, unsharded gradients); False: one plain process
    padded_mask: bool = True  # rows of a micro-batch differ in padding: sdpa gets a 4-D mask (not flash-attn,
    # packed or split forwards)
    engine: str = "hf"  # "vllm" (colocated on the actor's ranks) or "hf"
    gpu_memory_utilization: float = 0.5
    rows_per_rank: int = 1  # sequences one actor rank samples per step (a tensor-parallel group: its replica's)
    tensor_parallel: int = 1  # actor.tensor_parallel_size: every layer, the head and the sampler split this way
    # the tensor-parallel sizes this model and launch allow, and the other keys a run needs to take one (a
    # suggestion's; empty where something that tensor parallelism refuses cannot simply be switched off)
    tensor_parallel_sizes: tuple[int, ...] = ()
    tensor_parallel_keys: tuple[str, ...] = ()
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

    def with_tensor_parallel(self, size: int) -> PlanInputs:
        """The same run at `actor.tensor_parallel_size=size` (and `tensor_parallel_keys`): a group samples its
        replica's rows (with its engine split as the policy is), the log-probs come from the vocabulary shards (no
        chunking) of padded rows (the packed forward is not split)."""
        rows = -(-self.rows_per_rank * size // self.tensor_parallel)
        return self.with_(tensor_parallel=size, rows_per_rank=rows, chunked_logprobs=False, padded_mask=True)


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
