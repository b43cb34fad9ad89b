"""The batch's layout table (`verl.batch.LAYOUT`) and what derives from it: every field survives
selecting rows, concatenating batches (dynamic sampling), padding shards to one width and a split
placement's transfer to a role's ranks and back. Walks the table, so a new field is covered by adding it."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from verl.batch import (
    LAYOUT,
    PAD_TOKEN,
    PROMPT,
    RESPONSE,
    REWARD_PAD_TOKEN,
    REWARD_TOKENS,
    ROW,
    ROW_LIST,
    WHOLE,
    RolloutBatch,
    concat_batches,
    fields_of,
    padding,
    read_by,
    written_by,
)
from verl.distributed.placement import SplitPlacement
from verl.distributed.transfer import _schema, _to_dtype
from verl.errors import VerlError

PAD, REWARD_PAD = 7, 9


def full_batch(n: int, p: int, r: int, reward_len: int, seed: int) -> RolloutBatch:
    """A batch with every field of the layout set to distinct values (no value equals a pad by chance)."""
    g = torch.Generator().manual_seed(seed)
    values = {}
    for name, f in LAYOUT.items():
        if f.kind == ROW_LIST:
            values[name] = [{"row": (seed, i)} if name == "rows" else f"text {seed} {i}" for i in range(n)]
        elif f.kind == WHOLE:
            values[name] = {"seed": float(seed)}
        else:
            width = {ROW: None, PROMPT: p, RESPONSE: r, REWARD_TOKENS: reward_len}[f.kind]
            shape = (n,) if width is None else (n, width)
            floating = isinstance(f.pad, float) or name in ("scores", "env_scores", "reward_model_scores")
            values[name] = (torch.rand(shape, generator=g, dtype=torch.float64) + 100.0 if floating
                            else torch.randint(100, 1000, shape, generator=g))
    return RolloutBatch(**values)


def pad_value(name: str) -> float:
    pad = LAYOUT[name].pad
    return {PAD_TOKEN: PAD, REWARD_PAD_TOKEN: REWARD_PAD}.get(pad, pad) if isinstance(pad, str) else pad


def test_the_table_covers_every_field_of_the_batch():
    assert list(LAYOUT) == [f.name for f in dataclasses.fields(RolloutBatch)]
    assert read_by("ref") == read_by("critic") == fields_of(PROMPT) + ("response_ids", "response_mask",
                                                                        "response_attention_mask")
    assert set(read_by("critic_update")) == {*read_by("critic"), "values", "returns"}
    assert read_by("reward") == fields_of(REWARD_TOKENS)
    assert (written_by("ref"), written_by("critic"), written_by("reward")) == (
        ("ref_logprobs",), ("values",), ("reward_model_scores",))


def test_every_field_survives_concatenation():
    a, b = full_batch(3, 4, 5, 6, seed=1), full_batch(2, 6, 3, 2, seed=2)
    out = concat_batches([a, b], PAD, REWARD_PAD)
    assert len(out) == 5 and out.metrics == a.metrics and out.metrics is not a.metrics
    for name, f in LAYOUT.items():
        got, parts = getattr(out, name), [getattr(a, name), getattr(b, name)]
        if f.kind == ROW_LIST:
            assert got == parts[0] + parts[1], name
        elif f.kind == ROW:
            assert torch.equal(got, torch.cat(parts)), name
        elif f.kind != WHOLE:
            width = max(t.shape[1] for t in parts)
            assert got.shape == (5, width) and got.dtype == parts[0].dtype, name
            for rows, t in zip((slice(0, 3), slice(3, 5)), parts, strict=True):
                extra = width - t.shape[1]
                real, pad = (got[rows, extra:], got[rows, :extra]) if f.side == "left" else (
                    got[rows, : t.shape[1]], got[rows, t.shape[1] :])
                assert torch.equal(real, t), name
                assert bool((pad == pad_value(name)).all()), name


def test_concatenating_multi_turn_batches_keeps_the_observation_mask_and_episode_rewards():
    """Dynamic sampling concatenates the kept groups; a multi-turn batch's attention over observations and its
    episode rewards must come through (without the mask every observation token drops out of the attention)."""
    from verl.trainer.rl_trainer import concat_batches as from_trainer

    parts = []
    for seed, width in ((0, 5), (1, 3)):
        batch = full_batch(2, 3, width, 1, seed)
        batch.response_mask = torch.ones(2, width, dtype=torch.long)
        batch.response_attention_mask = torch.ones(2, width, dtype=torch.long)
        batch.response_mask[:, 1] = 0  # an observation token: attended, not trained on
        parts.append(batch)
    out = from_trainer(parts, PAD)
    assert out.response_attention_mask is not None and out.env_scores is not None
    assert torch.equal(out.response_attention_mask[2:], torch.tensor([[1, 1, 1, 0, 0]] * 2))
    assert torch.equal(out.env_scores, torch.cat([parts[0].env_scores, parts[1].env_scores]))


def test_a_field_set_in_only_some_batches_is_an_error():
    a, b = full_batch(2, 3, 3, 2, seed=1), full_batch(2, 3, 3, 2, seed=2)
    b.env_scores = None
    with pytest.raises(VerlError, match="'env_scores' is set in 1 of 2 batches. Fix: run the same stages"):
        concat_batches([a, b], PAD, REWARD_PAD)


def test_every_field_survives_selection():
    batch = full_batch(5, 3, 4, 2, seed=3)
    index = torch.tensor([4, 1, 1])
    out = batch.select(index)
    for name, f in LAYOUT.items():
        got, src = getattr(out, name), getattr(batch, name)
        if f.kind == ROW_LIST:
            assert got == [src[i] for i in index.tolist()], name
        elif f.kind == WHOLE:
            assert got is src  # the stages' metrics, shared
        else:
            assert torch.equal(got, src[index]), name


class InProcessGroups:
    """Role groups of a split placement whose transfers happen in this process: each tensor goes through the
    wire format of `verl.distributed.transfer` (its JSON schema, then a fresh tensor of that dtype/shape)."""

    def __init__(self, widest: int = 0):
        self.moves: list[tuple[str, str, list[str]]] = []
        self.widest = widest  # the width another actor rank brings to an align

    def ranks(self, role):
        return (0,) if role == "actor" else (1,)

    def has(self, role):
        return True  # one process plays both sides

    def move_batch(self, batch, src, dst, *, stage):
        self.moves.append((src, dst, sorted(batch)))
        out = {}
        for name, dtype, shape in json.loads(json.dumps(_schema(batch))):
            out[name] = torch.empty(shape, dtype=_to_dtype(dtype))
            out[name].copy_(batch[name])
        return out

    def all_reduce(self, t, role, stage, op=None):
        t.clamp_(min=self.widest)


@pytest.mark.parametrize("role", ["ref", "critic", "critic_update", "reward"])
def test_every_field_a_role_reads_travels_to_it_and_what_it_writes_comes_back(role):
    batch = full_batch(4, 3, 5, 6, seed=4)
    placement = SplitPlacement(InProcessGroups(), receive=RolloutBatch.from_fields)
    received = {}

    def stage(remote: RolloutBatch) -> RolloutBatch:
        for name in read_by(role):
            received[name] = getattr(remote, name)
        for name in written_by(role):
            setattr(remote, name, torch.full_like(getattr(batch, name), 3.0))
        return remote

    if role == "critic_update":
        metrics = placement.run_for_metrics("critic", lambda b: stage(b) and {"ok": 1.0}, batch,
                                            send=read_by(role))
        assert metrics == {"ok": 1.0}
    else:
        placement.run(role, stage, batch, send=read_by(role), back=written_by(role))
    assert set(received) == set(read_by(role))
    for name, value in received.items():
        want = getattr(batch, name)
        assert value.dtype == want.dtype and torch.equal(value, want), name
    for name in written_by(role):
        assert bool((getattr(batch, name) == 3.0).all()), name


def test_fields_a_batch_lacks_are_not_sent():
    """Single-turn responses have no observation mask: the ref's transfer leaves it out (and works)."""
    batch = full_batch(2, 3, 4, 1, seed=5)
    batch.response_attention_mask = None
    groups = InProcessGroups()
    placement = SplitPlacement(groups, receive=RolloutBatch.from_fields)
    placement.run("ref", lambda b: setattr(b, "ref_logprobs", torch.zeros(2, 4)) or b, batch,
                  send=read_by("ref"), back=written_by("ref"))
    assert groups.moves[0] == ("actor", "ref", sorted(set(read_by("ref")) - {"response_attention_mask"}))
    assert torch.equal(batch.ref_logprobs, torch.zeros(2, 4))


def test_aligning_shards_pads_every_prompt_and_response_field():
    batch = full_batch(2, 3, 4, 2, seed=6)
    before = {name: getattr(batch, name).clone() for name in fields_of(PROMPT, RESPONSE)}
    placement = SplitPlacement(InProcessGroups(widest=6), receive=RolloutBatch.from_fields)
    placement.align(batch, padding(fields_of(PROMPT, RESPONSE), PAD))
    for name, t in before.items():
        got = getattr(batch, name)
        assert got.shape == (2, 6), name
        real, pad = (got[:, 6 - t.shape[1] :], got[:, : 6 - t.shape[1]]) if LAYOUT[name].side == "left" else (
            got[:, : t.shape[1]], got[:, t.shape[1] :])
        assert torch.equal(real, t) and bool((pad == pad_value(name)).all()), name


def test_a_token_pad_without_a_pad_token_is_an_error():
    with pytest.raises(VerlError,
                       match="'prompt_ids' pads with the pad_token_id, which is None. Fix: give the tokenizer"):
        padding(fields_of(PROMPT), pad_token_id=None)
    assert padding(["prompt_mask", "values", "scores"]) == {"prompt_mask": ("left", 0), "values": ("right", 0.0)}
