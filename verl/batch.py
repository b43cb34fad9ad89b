"""The one batch object that flows through an RL step, and its layout as data.

Each stage fills in more fields (`generate` the responses, `compute_reward` the scores, ...) and never
reaches back; the update stages read mini-batches of it through `select`.

`LAYOUT` says for every field its shape kind, its pad value and which roles read or write it. Selecting
rows, concatenating batches (dynamic sampling), padding shards to one width (split placements), trimming a
micro-batch and the field lists a split placement sends to a role and back all derive from it, so a new
field is one table row: nothing can silently drop it (as a hand-written concatenation once dropped the
observation mask of multi-turn episodes).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from verl.errors import ModelError, VerlError
from verl.utils.positions import position_ids_from_mask

# Shape kinds. N rows; P prompt columns (left-padded), R response columns (right-padded), L reward-model
# tokens (right-padded).
ROW = "[N]"  # one value per row
PROMPT = "[N,P]"
RESPONSE = "[N,R]"
REWARD_TOKENS = "[N,L]"
ROW_LIST = "list[N]"  # a python list with one entry per row ([] before the stage that fills it)
WHOLE = "batch"  # belongs to the batch, not to a row (metrics)
# Pad values that are the tokenizer's, not a number.
PAD_TOKEN = "pad_token_id"  # the policy tokenizer's pad id
REWARD_PAD_TOKEN = "reward_pad_token_id"  # the reward model tokenizer's pad id

# Roles that read fields on ranks of their own (what a split placement sends them): the reference, the
# distillation teacher and the critic's value pass run on the sequences, the critic's update also on the values and
# returns, a reward model on its own tokens.
SEQUENCE_READERS = frozenset({"ref", "teacher", "critic", "critic_update"})


@dataclass(frozen=True)
class FieldLayout:
    kind: str
    pad: int | float | str | None = None  # None: the kind has no padded dimension
    readers: frozenset[str] = frozenset()  # roles off the actor's ranks that read it
    writer: str = "actor"  # the role whose stage fills it (a split placement sends it back from there)

    @property
    def side(self) -> str | None:
        return {PROMPT: "left", RESPONSE: "right", REWARD_TOKENS: "right"}.get(self.kind)


LAYOUT: dict[str, FieldLayout] = {
    "rows": FieldLayout(ROW_LIST),
    "group_ids": FieldLayout(ROW),
    "prompt_ids": FieldLayout(PROMPT, PAD_TOKEN, SEQUENCE_READERS),
    "prompt_mask": FieldLayout(PROMPT, 0, SEQUENCE_READERS),
    "images": FieldLayout(ROW_LIST),  # each row's RowImages (None: no image), with a vision-language policy
    "response_ids": FieldLayout(RESPONSE, PAD_TOKEN, SEQUENCE_READERS),
    "response_mask": FieldLayout(RESPONSE, 0, SEQUENCE_READERS),
    "response_attention_mask": FieldLayout(RESPONSE, 0, SEQUENCE_READERS),
    "finished": FieldLayout(ROW),
    "rollout_logprobs": FieldLayout(RESPONSE, 0.0),
    "rollout_version": FieldLayout(RESPONSE, 0.0),
    "responses": FieldLayout(ROW_LIST),
    "episodes": FieldLayout(ROW_LIST),
    "reward_parts": FieldLayout(ROW_LIST),
    "trace_ids": FieldLayout(ROW),
    "scores": FieldLayout(ROW),
    "accuracy": FieldLayout(ROW),
    "env_scores": FieldLayout(ROW),
    "token_rewards": FieldLayout(RESPONSE, 0.0),
    "old_logprobs": FieldLayout(RESPONSE, 0.0),
    "ref_logprobs": FieldLayout(RESPONSE, 0.0, writer="ref"),
    "teacher_logprobs": FieldLayout(RESPONSE, 0.0, writer="teacher"),
    "values": FieldLayout(RESPONSE, 0.0, frozenset({"critic_update"}), writer="critic"),
    "advantages": FieldLayout(RESPONSE, 0.0),
    "returns": FieldLayout(RESPONSE, 0.0, frozenset({"critic_update"})),
    "reward_input_ids": FieldLayout(REWARD_TOKENS, REWARD_PAD_TOKEN, frozenset({"reward"})),
    "reward_attention_mask": FieldLayout(REWARD_TOKENS, 0, frozenset({"reward"})),
    "reward_model_scores": FieldLayout(ROW, writer="reward"),
    "metrics": FieldLayout(WHOLE),
}


def fields_of(*kinds: str) -> tuple[str, ...]:
    """The fields of the given shape kinds, in table order."""
    return tuple(name for name, f in LAYOUT.items() if f.kind in kinds)


def read_by(role: str) -> tuple[str, ...]:
    """What a stage of `role` reads: the fields a split placement sends to its ranks."""
    return tuple(name for name, f in LAYOUT.items() if role in f.readers)


def written_by(role: str) -> tuple[str, ...]:
    """What a stage of `role` writes: the fields a split placement sends back to the actor's ranks."""
    return tuple(name for name, f in LAYOUT.items() if f.writer == role)


def padding(names: Iterable[str], pad_token_id: int | None = None, reward_pad_token_id: int | None = None,
            ) -> dict[str, tuple[str, int | float]]:
    """{field: (side, pad value)} of the padded fields among `names`, token pads resolved."""
    tokens = {PAD_TOKEN: pad_token_id, REWARD_PAD_TOKEN: reward_pad_token_id}
    out = {}
    for name in names:
        f = LAYOUT[name]
        if f.side is not None:
            value = tokens.get(f.pad, f.pad) if isinstance(f.pad, str) else f.pad
            if value is None:
                raise ModelError(f"batch field {name!r} pads with the {f.pad}, which is None. Fix: give the "
                                "tokenizer a pad token (tokenizer.pad_token = tokenizer.eos_token)")
            out[name] = (f.side, value)
    return out


@dataclass
class RolloutBatch:
    rows: list[dict[str, Any]]  # one per sequence: the prompt row, repeated n times
    group_ids: torch.Tensor  # [N] index of the prompt each sequence answers
    prompt_ids: torch.Tensor  # [N, P] left-padded
    prompt_mask: torch.Tensor  # [N, P]
    # one per sequence: its prompt's images (verl.models.vision_inputs.RowImages, None for none); [] for text
    images: list[Any] = field(default_factory=list)
    response_ids: torch.Tensor | None = None  # [N, R] right-padded
    response_mask: torch.Tensor | None = None  # [N, R] 1 on model-written tokens (the loss, KL, entropy)
    # [N, R] 1 on every real response token; multi-turn episodes also have observation tokens, which the
    # model reads (attention) but is not trained on (response_mask 0). None: the same as response_mask.
    response_attention_mask: torch.Tensor | None = None
    finished: torch.Tensor | None = None  # [N] stopped at eos (not truncated)
    rollout_logprobs: torch.Tensor | None = None  # [N, R] the sampler's log-prob of each response token
    rollout_version: torch.Tensor | None = None  # [N, R] the weights version (updates applied) that sampled each token
    responses: list[str] = field(default_factory=list)
    episodes: list[Any] = field(default_factory=list)  # multi-turn/agent: each row's EpisodeRecord (for traces)
    reward_parts: list[dict[str, float]] = field(default_factory=list)  # each reward function's score, where it applies
    trace_ids: torch.Tensor | None = None  # [N] long, on the CPU: k for the k-th row whose tokens are traced, else -1
    scores: torch.Tensor | None = None  # [N] sequence-level reward
    # [N] what dynamic sampling filters on: the reward's `acc` extra, else the score before shaping (overlong
    # penalty). None: the scores.
    accuracy: torch.Tensor | None = None
    env_scores: torch.Tensor | None = None  # [N] multi-turn episodes: the reward the environment's step gave
    token_rewards: torch.Tensor | None = None  # [N, R]
    old_logprobs: torch.Tensor | None = None  # [N, R] actor before the update
    ref_logprobs: torch.Tensor | None = None  # [N, R]
    teacher_logprobs: torch.Tensor | None = None  # [N, R] the distillation teacher's, of the sampled tokens
    values: torch.Tensor | None = None  # [N, R]
    advantages: torch.Tensor | None = None  # [N, R]
    returns: torch.Tensor | None = None  # [N, R]
    reward_input_ids: torch.Tensor | None = None  # [N, L] prompt + response in the reward model's tokens
    reward_attention_mask: torch.Tensor | None = None  # [N, L]
    reward_model_scores: torch.Tensor | None = None  # [N] a reward model on ranks of its own
    metrics: dict[str, float] = field(default_factory=dict)  # what the stages measured (reward, KL, drift)

    LAYOUT: ClassVar[dict[str, FieldLayout]] = LAYOUT

    @classmethod
    def of_prompts(cls, rows: list[dict[str, Any]], ids: torch.Tensor, mask: torch.Tensor,
                   images: list[Any] | None = None, *, n: int, first_group: int = 0) -> RolloutBatch:
        """A step's batch before generation: each prompt row (and its ids and images) repeated n times in a row,
        the n samples of a prompt sharing a group id (numbered from `first_group`)."""
        return cls(rows=[row for row in rows for _ in range(n)],
                   images=[] if images is None else [image for image in images for _ in range(n)],
                   group_ids=torch.arange(len(rows)).repeat_interleave(n) + first_group,
                   prompt_ids=ids.repeat_interleave(n, dim=0), prompt_mask=mask.repeat_interleave(n, dim=0))

    def __len__(self) -> int:
        return self.prompt_ids.shape[0]

    @property
    def input_ids(self) -> torch.Tensor:
        return torch.cat([self.prompt_ids, self.response_ids], dim=1)

    @property
    def attention_mask(self) -> torch.Tensor:
        return torch.cat([self.prompt_mask, self.response_attention], dim=1)

    @property
    def response_attention(self) -> torch.Tensor:
        """What the model attends to after the prompt: every real token, observations of a multi-turn
        episode included (`response_mask` marks only the model-written ones, those in the loss)."""
        return self.response_attention_mask if self.response_attention_mask is not None else self.response_mask

    @property
    def position_ids(self) -> torch.Tensor:
        return position_ids_from_mask(self.attention_mask)

    @classmethod
    def from_fields(cls, fields: dict[str, torch.Tensor]) -> RolloutBatch:
        """The batch a ref/critic/reward rank builds from the tensors it was sent (it needs no prompt rows)."""
        n = next(iter(fields.values())).shape[0]
        blank = torch.zeros((n, 0), dtype=torch.long)
        base = {"prompt_ids": blank, "prompt_mask": blank, "group_ids": torch.arange(n)}
        return cls(rows=[{} for _ in range(n)], **(base | dict(fields)))

    def select(self, index: torch.Tensor) -> RolloutBatch:
        """A sub-batch (rows `index`) sharing no tensor or row list with this one (`metrics` is shared)."""
        picked: dict[str, Any] = {}
        idx = index.tolist()
        for name, f in LAYOUT.items():
            value = getattr(self, name)
            if f.kind == ROW_LIST:
                value = [value[i] for i in idx] if value and len(value) == len(self) else value
            elif f.kind != WHOLE and value is not None:
                value = value.index_select(0, index.to(value.device))
            picked[name] = value
        return RolloutBatch(**picked)


def varied_groups(batch: RolloutBatch) -> torch.Tensor:
    """[N] bool: the sequences whose group's accuracies (`accuracy`, else scores) are not all equal (exactly).

    DAPO (arXiv 2503.14476) keeps the groups that are neither all right nor all wrong: a shaping term such as
    the overlong penalty makes the scores of an all-right group differ without giving it a learning signal
    about correctness."""
    scores = (batch.accuracy if batch.accuracy is not None else batch.scores).detach().cpu().double()
    _, inverse = torch.unique(batch.group_ids.cpu(), return_inverse=True)
    size = int(inverse.max()) + 1 if len(inverse) else 0
    high = torch.full((size,), -float("inf"), dtype=torch.float64).scatter_reduce(0, inverse, scores, "amax")
    low = torch.full((size,), float("inf"), dtype=torch.float64).scatter_reduce(0, inverse, scores, "amin")
    return (high != low)[inverse]


def concat_batches(batches: Sequence[RolloutBatch], pad_token_id: int | None,
                   reward_pad_token_id: int | None = None) -> RolloutBatch:
    """The rows of several batches in one, every field of the layout kept: prompt-aligned fields left-padded
    and response-aligned ones right-padded to the widest (with their pad values), the metrics the first's.
    A field must be in every batch or in none (else the rows would not line up)."""
    batches = [b for b in batches if len(b)] or list(batches[:1])
    widths: dict[str, int] = {}
    for name, f in LAYOUT.items():
        for b in batches:
            if f.side is not None and getattr(b, name) is not None:
                widths[f.kind] = max(widths.get(f.kind, 0), getattr(b, name).shape[1])
    out: dict[str, Any] = {"metrics": dict(batches[0].metrics)}
    for name, f in LAYOUT.items():
        if f.kind == WHOLE:
            continue
        values = [getattr(b, name) for b in batches]
        if f.kind == ROW_LIST:
            filled = [len(v) == len(b) and len(v) > 0 for v, b in zip(values, batches, strict=True)]
            if any(filled) and not all(filled):
                raise VerlError(f"concat_batches: the field {name!r} has one entry per row in some batches and "
                                "not in others. Fix: run the same stages on every batch before concatenating")
            out[name] = [x for v in values for x in v] if all(filled) else []
            continue
        present = [v is not None for v in values]
        if not any(present):
            continue
        if not all(present):
            raise VerlError(f"concat_batches: the field {name!r} is set in {sum(present)} of {len(values)} "
                            "batches. Fix: run the same stages on every batch before concatenating")
        if f.side is not None and any(v.shape[1] < widths[f.kind] for v in values):
            side, pad = padding([name], pad_token_id, reward_pad_token_id)[name]
            values = [torch.nn.functional.pad(v, (widths[f.kind] - v.shape[1], 0) if side == "left"
                                              else (0, widths[f.kind] - v.shape[1]), value=pad) for v in values]
        out[name] = torch.cat(values)
    return RolloutBatch(**out)


__all__ = ["LAYOUT", "FieldLayout", "RolloutBatch", "concat_batches", "fields_of", "padding", "read_by",
           "written_by", "PAD_TOKEN", "REWARD_PAD_TOKEN", "ROW", "PROMPT", "RESPONSE", "REWARD_TOKENS",
           "ROW_LIST", "WHOLE", "varied_groups"]
