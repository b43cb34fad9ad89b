"""ValueModel: values [B, T] = value_head(backbone hidden states), checked against a float64 reference."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from verl.errors import CheckpointError, ModelError
from verl.models.critic import VALUE_HEAD_FILE, ValueModel
from verl.utils.positions import position_ids_from_mask


@pytest.fixture(scope="module")
def actor(instruct_path):
    return AutoModelForCausalLM.from_pretrained(instruct_path, dtype=torch.float32).eval()


def _random_head(critic: ValueModel, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        critic.value_head.weight.copy_(torch.randn(critic.value_head.weight.shape, generator=g))
        critic.value_head.bias.fill_(0.25)


def _batch():
    ids = torch.tensor([[5, 17, 40, 41, 3], [7, 8, 9, 10, 11]])
    mask = torch.ones_like(ids)
    return ids, mask


def test_values_match_float64_reference(actor):
    critic = ValueModel.from_actor(actor).eval()
    ids, mask = _batch()
    with torch.no_grad():
        assert torch.equal(critic(ids, mask), torch.zeros(2, 5))  # zero-initialised head
        _random_head(critic)
        values = critic(ids, mask)
        hidden = actor.model(input_ids=ids, attention_mask=mask).last_hidden_state.double()
    w = critic.value_head.weight.double()[0]
    expected = (hidden * w).sum(-1) + 0.25
    assert values.shape == (2, 5) and values.dtype == torch.float32
    torch.testing.assert_close(values.double(), expected, rtol=1e-5, atol=1e-5)


def test_values_are_a_fresh_tensor_not_a_view(actor):
    """FSDP2 hooks the output's autograd node; a view output loses that hook on an in-place op."""
    critic = ValueModel.from_actor(actor)
    _random_head(critic)
    ids, mask = _batch()
    values = critic(ids, mask)
    assert values._base is None and values.requires_grad
    values.mul_(2.0)  # allowed on a fresh tensor; the gradient follows the modified values
    values.sum().backward()
    assert critic.value_head.bias.grad.item() == pytest.approx(2.0 * values.numel())


def test_from_actor_copies_the_backbone(actor):
    critic = ValueModel.from_actor(actor)
    with torch.no_grad():
        next(critic.backbone.parameters()).add_(1.0)
    assert not torch.equal(next(critic.backbone.parameters()), next(actor.model.parameters()))
    assert critic.backbone is not actor.model


def test_left_padding_does_not_change_values(actor):
    critic = ValueModel.from_actor(actor).eval()
    _random_head(critic)
    ids = torch.tensor([[5, 17, 40, 41]])
    padded = torch.tensor([[0, 0, 5, 17, 40, 41]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1]])
    assert position_ids_from_mask(mask).tolist() == [[0, 0, 0, 1, 2, 3]]
    with torch.no_grad():
        plain = critic(ids, torch.ones_like(ids))
        left = critic(padded, mask)
    torch.testing.assert_close(left[:, 2:], plain, rtol=1e-5, atol=1e-5)


def test_save_and_load_round_trip(actor, tmp_path):
    critic = ValueModel.from_actor(actor).eval()
    _random_head(critic, seed=1)
    critic.save_pretrained(tmp_path / "critic")
    assert (tmp_path / "critic" / VALUE_HEAD_FILE).is_file()
    again = ValueModel.from_pretrained(tmp_path / "critic", dtype="fp32").eval()
    ids, mask = _batch()
    with torch.no_grad():
        assert torch.equal(critic(ids, mask), again(ids, mask))


def test_from_pretrained_causal_lm_matches_from_actor(actor, instruct_path):
    critic = ValueModel.from_pretrained(instruct_path, dtype=torch.float32).eval()
    ref = ValueModel.from_actor(actor).eval()
    _random_head(critic)
    _random_head(ref)
    ids, mask = _batch()
    with torch.no_grad():
        torch.testing.assert_close(critic(ids, mask), ref(ids, mask))


def test_bf16_backbone_still_gives_float32_values(instruct_path):
    critic = ValueModel.from_pretrained(instruct_path, dtype="bf16")
    ids, mask = _batch()
    with torch.no_grad():
        values = critic(ids, mask)
    assert values.dtype == torch.float32 and critic.value_head.weight.dtype == torch.float32


def test_wrong_value_head_file(actor, tmp_path):
    from safetensors.torch import save_file

    save_file({"weight": torch.zeros(1, 32), "bias": torch.zeros(1)}, str(tmp_path / "head.safetensors"))
    critic = ValueModel.from_actor(actor)
    with pytest.raises(CheckpointError, match=r"hidden size differs\). Fix: load it with the backbone"):
        critic.load_value_head(tmp_path / "head.safetensors")
    (tmp_path / "bad.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="cannot read the value head"):
        critic.load_value_head(tmp_path / "bad.safetensors")


def test_bad_inputs(tmp_path):
    with pytest.raises(ModelError, match="could not load a critic backbone.*Fix: point critic.path"):
        ValueModel.from_pretrained(tmp_path)
    with pytest.raises(ModelError, match="cannot find the transformer backbone"):
        ValueModel.from_actor(torch.nn.Linear(2, 2))
