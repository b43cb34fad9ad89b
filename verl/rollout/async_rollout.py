"""Asynchronous RL: rollout ranks of their own (`devices.rollout`) generate ahead while the trainer ranks
train, at most `rollout.max_staleness` (k) updates ahead.

Every rank runs the same step, as in any split placement; what overlaps is what the two groups do between
two synchronisation points. In step i:

1. the rollout ranks send batch i (generated earlier, or now when none is queued) to the actor ranks;
2. the rollout ranks generate the batches up to i + k with the weights they hold (version i), while the
   trainer ranks score, recompute the old log-probs and update on batch i;
3. the new weights (version i + 1) go from the first actor rank to the rollout ranks (`deliver`).

So batch i was sampled by weights at most k updates old: k = 0 is synchronous training on the split ranks
(the same samples and updates as one process: `tests/distributed/test_async_rollout.py`), k = 1 is
one-step off-policy. With `rollout.partial_rollout` a rollout rank takes version i + 1 as soon as the actor
posts it, between two tokens of the responses it is writing, instead of after the batch: the rest of those
responses is sampled by the new weights (their KV cache so far stays as the old weights wrote it). Each
token carries the version that sampled it, and its log-probability under the weights that sampled it is the
behaviour log-prob of the rollout correction (on by default when k > 0), which weighs the token by the
trainer's over the sampler's probability. The prompt stream stays in
step because every rank draws the same batches in the same order (the rollout ranks k batches earlier), so a
checkpoint's position is the trained batches' and a resume regenerates what was in flight: nothing is
trained twice or lost. Multi-turn, tool and agent episodes run on the rollout ranks as `generate` runs them
there (an agent's OpenAI endpoint too); what they add to the batch travels with it (`SAMPLED`, the episode
metrics, an agent episode's text), so the actor ranks score and train them as one process does.

With `rollout.engine=vllm` a rollout rank samples with vLLM, which holds its own weights: each delivery
(the first step's and every update's) ends with them loaded into it (`weight_sync.DeliveryReceiver`: a full
policy's buckets as they arrive, a LoRA policy's adapters merged on the rollout rank), the engine stays
awake, and the rank's Hugging Face copy stays on the CPU. vLLM samples a batch in one call, so there is no
partial rollout (`takes_partial_rollouts`): each batch is sampled by one version, with vLLM's log-probs as
the behaviour log-probs.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from verl.batch import LAYOUT, RolloutBatch, padding
from verl.config.schema import RunConfig
from verl.distributed.groups import RoleGroups
from verl.distributed.guard import role_key
from verl.distributed.mapping import DeviceMapping
from verl.distributed.transfer import pad_to_group_width
from verl.env.base import Environment
from verl.env.multiturn import MultiTurnEnvironment, is_multiturn
from verl.errors import DistributedError
from verl.rollout.weight_sync import DeliveryReceiver

BUCKET_BYTES = 64 * 2**20  # weights are broadcast in buckets of at most this size (one tensor may exceed it)
POLL_S = 0.005  # a generating rollout rank asks the store for new weights at most this often (a round trip each)
MEET_POLL_S = (0.001, 0.05)  # a rank waiting for the others to reach a delivery asks this often (backing off)
# What the rollout ranks send: the prompts as sampled, the responses, the sampler's log-probs, the versions.
# A multi-turn episode adds its attention (observations included) and the environment's score.
SAMPLED = ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "response_attention_mask", "finished",
           "rollout_logprobs", "rollout_version", "env_scores")
# Sent with them: each row's prompt as drawn (its signature: an episode's prompt may be another rendering of the
# row, a tool environment's lists the tools, an agent's is its first call's) and, for agent episodes, the
# responses' text as the rollout ranks wrote it (a failed agent's traceback follows its episode).
DRAWN, TEXT = "drawn_prompts", "response_text"


def delivery_ranks(groups: RoleGroups) -> tuple[int, ...]:
    """The first actor rank (which holds the gathered weights) and the rollout ranks."""
    return tuple(sorted({groups.ranks("actor")[0], *groups.ranks("rollout")}))


def trainable(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """What an update changes, so what is delivered: every trained parameter (a LoRA policy: its adapters)."""
    return [(name, p) for name, p in model.named_parameters() if p.requires_grad]


def buckets(params: list[tuple[str, torch.nn.Parameter]], limit: int = BUCKET_BYTES,
            wire: torch.dtype | None = None) -> Iterator[list[int]]:
    """Indices of `params` grouped into buckets of one wire dtype (`wire_dtype`) and at most `limit` bytes (the
    same grouping on every rank: it depends only on the shapes and dtypes, which the rollout ranks' copy
    shares)."""
    current: list[int] = []
    size, dtype = 0, None
    for i, (_, p) in enumerate(params):
        on_wire = wire_dtype(p, wire)
        nbytes = p.numel() * on_wire.itemsize
        if current and (on_wire != dtype or size + nbytes > limit):
            yield current
            current, size = [], 0
        current.append(i)
        size += nbytes
        dtype = on_wire
    if current:
        yield current


def wire_dtype(p: torch.Tensor, wire: torch.dtype | None) -> torch.dtype:
    """What a parameter travels as: floating point in the dtype the rollout samples in (`wire`: bfloat16 when
    the policy computes in it, so a float32 master copy is never sent), anything else as it is."""
    return wire if wire is not None and p.is_floating_point() else p.dtype


@dataclass
class AsyncRollout:
    """The rollout side and the trainer side of an asynchronous step (see the module docstring).

    `draw` and `generate` are the trainer's stages (`RLTrainer.get_batch` / `generate`), run on the rollout
    ranks; `model` is this rank's policy (a rollout rank's full copy, or the actor's shard)."""

    groups: RoleGroups
    max_staleness: int
    draw: Callable[[], RolloutBatch]
    generate: Callable[[RolloutBatch], RolloutBatch]
    decode: Callable[[torch.Tensor, torch.Tensor], list[str]]  # the responses' text, on the actor ranks
    # the prompt stream (its position is saved by the trainer ranks, who draw as they train)
    env: Environment | MultiTurnEnvironment
    device: torch.device
    engine: Any = None  # this rank's sampler: a delivery's target (vLLM) or, via `between_tokens`, a partial rollout's
    wire: torch.dtype | None = None  # the dtype weights travel in: the rollout's compute dtype (None: as held)
    partial: bool = False  # rollout.partial_rollout
    send_text: bool = False  # the responses' text travels (agent episodes), instead of being decoded on arrival
    pad_token_id: int | None = None  # pads the rollout ranks' batches to one width before they are gathered
    queue: deque[Generated] = field(default_factory=deque)
    model: torch.nn.Module | None = None  # this rank's policy (next_batch's; a partial rollout's delivery target)
    version: int | None = None  # the weights this rollout rank holds (updates applied); None before the first
    drawn: int = 0  # batches this rank generated so far
    _last: float | None = None  # when the previous step's next_batch began (for the idle fractions)
    _busy: float = 0.0  # since then: a rollout rank's time generating, a trainer rank's time waiting for a batch
    _next_poll: float = 0.0  # when a generating rollout rank may next ask whether new weights are posted

    @property
    def generates(self) -> bool:
        return self.groups.has("rollout")

    # ------------------------------------------------------------------ batches
    def next_batch(self, step: int, model: torch.nn.Module | None) -> tuple[RolloutBatch | None, dict[str, float]]:
        """Batch `step` and the step's async metrics: on the actor ranks the prompts they draw (every trainer
        rank draws, as in a synchronous step) with the rollout ranks' responses; None elsewhere."""
        now, self.model = time.perf_counter(), model
        metrics = self._idle_metrics(now)
        if self.version is None:  # the first step (or the first after a resume): the rollout ranks get the
            metrics |= self.deliver(model, step)  # trainer's weights and prompt position, then regenerate
            self._sync_prompt_stream()  # what was in flight
        batch, more = self.exchange(step)
        return batch, metrics | more

    def exchange(self, step: int) -> tuple[RolloutBatch | None, dict[str, float]]:
        """The next batch of the prompt stream from the rollout ranks to the actor ranks (a step's, or an extra
        round of dynamic sampling's); then the rollout ranks generate until k batches are queued again."""
        batch = None if self.generates else self.draw()
        sent, metrics = None, {}
        if self.generates:
            if not self.queue:  # k = 0, or nothing queued yet: generate it now
                self._generate_one()
            sent = self.queue.popleft()
            metrics |= sent.metrics  # what generating measured (a multi-turn episode's), averaged with the actor's
        start = time.perf_counter()
        received = self.groups.move_batch(self._one_width(sent.fields) if sent is not None else None, "rollout",
                                          "actor", stage="rollout:batch")
        if self.generates:
            while len(self.queue) < self.max_staleness:  # run ahead while the trainer trains this batch
                self._generate_one()
            metrics["async/queue_depth"] = float(len(self.queue))
        else:
            self._busy += time.perf_counter() - start
        if received is None:
            return None, metrics
        text = received.pop(TEXT, None)
        batch = merge(batch, received, step)
        batch.responses = (texts_of(text) if text is not None else
                           self.decode(batch.response_ids,
                                       received.get("response_attention_mask", batch.response_mask)))
        return batch, metrics | staleness_metrics(received, step)

    def _one_width(self, fields: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Several rollout ranks: each rank's prompts, responses and texts padded to the group's widest, so
        their shards concatenate (each generated its own share of the batch, to its own longest response)."""
        if len(self.groups.ranks("rollout")) == 1:
            return fields
        sides = padding([k for k in fields if k in LAYOUT], self.pad_token_id)
        if TEXT in fields:
            sides[TEXT] = ("right", 0)
        widest = lambda t: self.groups.all_reduce(t, "rollout", "rollout:width", op=dist.ReduceOp.MAX)  # noqa: E731
        return fields | pad_to_group_width({k: fields[k] for k in sides}, sides, all_reduce_max=widest,
                                           device=self.device)

    def _sync_prompt_stream(self) -> None:
        """The rollout ranks' environment at the first actor rank's position: the batches trained so far (a
        resumed rollout rank would otherwise continue from the batches it had drawn ahead)."""
        ranks = delivery_ranks(self.groups)
        if self.groups.rank not in ranks:
            return
        source = self.groups.ranks("actor")[0]
        state = [self.env.state_dict() if self.groups.rank == source else None]
        self.groups.guard.run("rollout:prompt_position", ranks, lambda: dist.broadcast_object_list(
            state, src=source, group=self.groups.group_of(ranks)), group_name=role_key(ranks))
        if self.generates:
            self.env.load_state_dict(state[0])

    def _generate_one(self) -> None:
        start, version = time.perf_counter(), self.version
        switches: list[tuple[int, int]] = []  # (first token sampled by it, version) per mid-batch delivery
        hook = self.partial and self.engine is not None and hasattr(self.engine, "between_tokens")
        if hook:
            self.engine.between_tokens = lambda step: self._take_delivery(step, switches)
        try:
            drawn = self.draw()
            signature = _prompt_signature(drawn.prompt_ids, drawn.prompt_mask)  # before generate replaces them
            out = self.generate(drawn)
        finally:
            if hook:
                self.engine.between_tokens = None
        out.rollout_version = torch.full(out.response_ids.shape, float(version))
        for first, new in switches:
            out.rollout_version[:, first:] = float(new)
        fields = _fields(out) | {DRAWN: signature}
        if self.send_text:
            fields[TEXT] = text_tensor(out.responses)
        self.queue.append(Generated(fields, dict(out.metrics)))
        self.drawn += 1
        self._busy += time.perf_counter() - start

    def _take_delivery(self, step: int, switches: list[tuple[int, int]]) -> bool:
        """Between two tokens: receive the next version if the actor posted it (a partial rollout)."""
        start = time.perf_counter()
        if self.version is None or start < self._next_poll:
            return False
        self._next_poll = start + POLL_S
        if not self.groups.guard.signalled(_posted(self.version + 1)):
            return False
        self.deliver(self.model, self.version + 1)
        self._busy -= time.perf_counter() - start  # a wait for the actor's broadcast, not generation
        switches.append((step + 1, self.version))
        return True

    def _idle_metrics(self, now: float) -> dict[str, float]:
        """The idle share of the last step: a rollout rank's time not generating, a trainer rank's time
        waiting for its batch."""
        out = {}
        if self._last is not None and (self.generates or self.groups.has("actor")):
            share = self._busy / max(now - self._last, 1e-9)
            out["async/rollout_idle_frac" if self.generates else "async/trainer_idle_frac"] = (
                max(0.0, 1.0 - share) if self.generates else min(1.0, share))
        self._last, self._busy = now, 0.0
        return out

    # ------------------------------------------------------------------ weights
    def deliver(self, model: torch.nn.Module | None, version: int) -> dict[str, float]:
        """Version `version` of the trained parameters, from the first actor rank to the rollout ranks, in
        bucketed broadcasts (the actor ranks gather each FSDP2 shard first). Every actor and rollout rank
        calls this; the others return at once."""
        if not (self.generates or self.groups.has("actor")) or (self.generates and self.version == version):
            return {}  # a rollout rank that took this version between two tokens already has it
        start = time.perf_counter()
        ranks = delivery_ranks(self.groups)
        source, member = self.groups.ranks("actor")[0], self.groups.rank in ranks
        if self.groups.rank == source:
            self.groups.guard.signal(_posted(version))  # generating rollout ranks join between two tokens
        self._meet(version, ranks)
        params = trainable(model)
        group = self.groups.group_of(ranks)
        receiver = DeliveryReceiver(self.engine, model) if self.generates else None
        for index in buckets(params, wire=self.wire):
            dtype = wire_dtype(params[index[0]][1], self.wire)  # cast at the source, received as sent
            full = ([_full(params[i][1]).to(dtype) for i in index] if self.groups.has("actor")
                    else None)  # an actor collective (each FSDP2 shard gathered)
            if not member:
                continue
            flat = (torch.cat([t.reshape(-1) for t in full]).to(self.device) if full is not None else
                    torch.empty(sum(params[i][1].numel() for i in index), dtype=dtype, device=self.device))
            self.groups.guard.run("rollout:weights", ranks,
                                  lambda flat=flat: dist.broadcast(flat, src=source, group=group),
                                  group_name=role_key(ranks))
            if receiver is not None:  # into the copy our sampler runs, or into vLLM's own weights
                receiver.bucket([params[i] for i in index], flat)
        if receiver is not None:
            receiver.done()
        self.version = version  # every side tracks it: the first-step delivery happens once
        if self.groups.rank != source:  # a rollout rank's time here is mostly its wait for the update
            return {}
        sent = sum(p.numel() * wire_dtype(p, self.wire).itemsize for _, p in params) / 2**20
        return {"async/weight_delivery_s": time.perf_counter() - start, "async/weight_delivery_mb": sent}


    def _meet(self, version: int, ranks: tuple[int, ...]) -> None:
        """Wait, outside any collective, until every rank of the delivery (`ranks`) has reached it: the other
        side may still be generating (a rollout longer than the update) or updating, for any time. Waiting in
        the broadcast instead held the first actor rank there while the other actor ranks had queued the next
        bucket's all-gather: a wait past devices.timeout_s ended the run. Every actor rank waits here, so
        none enters the buckets' collectives before all are ready."""
        here = f"{_posted(version)}/here"
        self.groups.guard.signal(f"{here}/{self.groups.rank}")
        missing, poll = list(ranks), MEET_POLL_S[0]
        while missing := [r for r in missing if not self.groups.guard.signalled(f"{here}/{r}")]:
            time.sleep(poll)
            poll = min(poll * 2, MEET_POLL_S[1])
        # every delivery rank is past the previous version's meeting (and its post): their keys go
        self.groups.guard.clear(f"{_posted(version - 1)}/here/{self.groups.rank}")
        if self.groups.rank == self.groups.ranks("actor")[0]:
            self.groups.guard.clear(_posted(version - 1))


@dataclass
class Generated:
    """A batch the rollout ranks generated and have not sent yet: the fields that travel, and what generating
    measured (a multi-turn or agent episode's metrics)."""

    fields: dict[str, torch.Tensor]
    metrics: dict[str, float]


def text_tensor(texts: list[str]) -> torch.Tensor:
    """Texts as one row each of UTF-8 bytes, zero-padded (transfers move tensors only)."""
    data = [t.encode("utf-8") for t in texts]
    out = torch.zeros(len(data), max((len(b) for b in data), default=0), dtype=torch.uint8)
    for i, b in enumerate(data):
        out[i, : len(b)] = torch.tensor(list(b), dtype=torch.uint8)
    return out


def texts_of(tensor: torch.Tensor) -> list[str]:
    return [bytes(row.tolist()).rstrip(b"\0").decode("utf-8", errors="replace") for row in tensor.cpu()]


def _posted(version: int) -> str:
    return f"async/weights/{version}"


def _full(p: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
    return full.detach()


def _fields(batch: RolloutBatch) -> dict[str, torch.Tensor]:
    return {name: getattr(batch, name) for name in SAMPLED if getattr(batch, name) is not None}


def _prompt_signature(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per row: the number of prompt tokens and the sum of their ids (padding and its side ignored)."""
    mask = mask.long()
    return torch.stack([mask.sum(-1), (ids.long() * mask).sum(-1)], dim=-1)


def merge(batch: RolloutBatch, received: dict[str, torch.Tensor], step: int) -> RolloutBatch:
    """The trainer's drawn batch with the sampled fields; its prompts must be the ones that the rollout ranks drew
    (`received[DRAWN]`, else the sampled prompts themselves)."""
    drawn = _prompt_signature(batch.prompt_ids, batch.prompt_mask)
    sampled = received.pop(DRAWN, None)
    if sampled is None:
        sampled = _prompt_signature(received["prompt_ids"], received["prompt_mask"])
    if drawn.shape != sampled.shape or not torch.equal(drawn, sampled.to(drawn.device)):
        raise DistributedError(
            f"step {step + 1}: the rollout ranks sampled other prompts than the trainer ranks drew for this batch "
            "(the prompt streams went out of step). Fix: every rank must build the environment with the same "
            "seed and data; resume only from checkpoints of this run.")
    for name, value in received.items():
        setattr(batch, name, value)
    return batch


def staleness_metrics(received: dict[str, torch.Tensor], step: int) -> dict[str, float]:
    """How many updates old this batch's tokens are: the oldest, a histogram over the response tokens
    (`async/staleness_tokens_<s>`: the share sampled s updates before this one) and the share of responses
    that a partial rollout finished under newer weights than it began."""
    mask = received["response_mask"].bool()
    versions = received["rollout_version"].double().masked_fill(~mask, float("inf"))
    oldest, newest = versions.amin(), received["rollout_version"].double().masked_fill(~mask, -1).amax()
    out = {"async/staleness": float(step - oldest), "async/version": float(newest)}
    stale = (step - versions[mask]).round().long()
    for s, count in enumerate(torch.bincount(stale.clamp(min=0), minlength=1).tolist()):
        out[f"async/staleness_tokens_{s}"] = count / max(stale.numel(), 1)
    rows = versions.masked_fill(~mask, float("-inf")).amax(-1) > versions.amin(-1)
    out["async/partial_frac"] = float(rows.double().mean())
    return out


__all__ = ["AsyncRollout", "describe", "BUCKET_BYTES", "buckets", "delivery_ranks", "merge", "staleness_metrics",
           "takes_partial_rollouts", "trainable"]


def describe(config: RunConfig, mapping: DeviceMapping) -> str:
    """`verl check`'s line for the asynchronous plan."""
    k = config.rollout.max_staleness
    if not config.is_async:
        return (f"rollout.max_staleness={k} has no effect: the actor ranks generate between their updates "
                "(synchronous). Give generation ranks of their own with devices.rollout to run ahead.")
    mode = {0: "synchronous on the split ranks", 1: "one-step off-policy"}.get(k, f"up to {k} updates stale")
    line = (f"asynchronous rollout: rank(s) {list(mapping.ranks('rollout'))} generate, rank(s) "
            f"{list(mapping.ranks('actor'))} train; rollout.max_staleness={k} ({mode}), a queue of at most {k} "
            "batch(es) ahead; the new weights go to the rollout ranks after every update")
    if config.rollout.engine == "vllm":
        line += (" and are loaded into the rollout ranks' vLLM engines (kept awake; their Hugging Face copy of the "
                 "policy stays on the CPU)")
        if config.rollout.partial_rollout:
            line += ("; rollout.partial_rollout is off with rollout.engine=vllm (vLLM samples a batch in one call, "
                     "so the new weights are taken between batches and each batch is sampled by one version)")
    elif config.rollout.partial_rollout and k > 0:
        line += ("; partial rollouts: single-turn responses take new weights between two tokens (multi-turn and "
                 "agent episodes are sampled by one version each)")
    if config.env.agent is not None:
        line += ("; env.agent: the agents' OpenAI endpoint runs on the rollout rank(s) and their stitched episodes "
                 "(tokens, log-probs, masks, rewards, text, episode metrics) go to the actor rank(s)")
    return line


def takes_partial_rollouts(config: RunConfig, env: Environment | MultiTurnEnvironment) -> bool:
    """Whether rollout ranks take a delivery between two tokens (`rollout.partial_rollout`): only our own
    sampler can (its `between_tokens` hook), and only where a token's decode step is its response column."""
    # A multi-turn or agent episode decodes turn by turn, so a token's decode step is not its response column:
    # its responses are sampled by one version. vLLM samples a whole batch in one call.
    return (config.rollout.partial_rollout and config.rollout.engine == "hf" and not is_multiturn(env)
            and config.env.agent is None)
