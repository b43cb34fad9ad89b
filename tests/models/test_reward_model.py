"""RewardModelScorer: the score is read at each sequence's last real token, whatever the padding."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from verl.errors import ModelError
from verl.models.reward_model import RewardModelScorer, last_token_index

TEXTS = ["What is 12+7? The answer is 19.", "19", "What is 3 times 4?<|im_end|>"]


@pytest.fixture(scope="module")
def rm(reward_path):
    return AutoModelForSequenceClassification.from_pretrained(reward_path, dtype=torch.float32).eval()


def _reference(model, tokenizer, text: str) -> float:
    """One unpadded sequence: head applied to the final position's hidden state, in float64."""
    ids = torch.tensor([tokenizer.encode(text, add_special_tokens=False)])
    with torch.no_grad():
        hidden = model.model(input_ids=ids).last_hidden_state[0, -1].double()
        return float(hidden @ model.score.weight.double()[0])


@pytest.mark.parametrize("side", ["right", "left"])
def test_batched_scores_match_per_sequence_reference(rm, reward_path, side):
    tok = AutoTokenizer.from_pretrained(reward_path)
    tok.padding_side = side
    # pad == eos on purpose: the third text ends with the eos token, which id-based pooling would skip.
    tok.pad_token = tok.eos_token
    scorer = RewardModelScorer(rm, tok)
    scores = scorer.score_texts(TEXTS)
    assert scores.shape == (3,) and scores.dtype == torch.float32
    expected = torch.tensor([_reference(rm, tok, t) for t in TEXTS], dtype=torch.float64)
    torch.testing.assert_close(scores.double(), expected, rtol=1e-4, atol=1e-5)


def test_load_from_path_with_own_tokenizer(reward_path):
    scorer = RewardModelScorer(reward_path, batch_size=2)
    scores = scorer(TEXTS)
    assert scores.shape == (3,)
    assert torch.isfinite(scores).all()


def test_last_token_index_and_errors():
    mask = torch.tensor([[1, 1, 0, 0], [0, 0, 1, 1], [1, 1, 1, 1]])
    assert last_token_index(mask).tolist() == [1, 3, 3]
    with pytest.raises(ModelError, match="row 1 has an all-zero attention mask"):
        last_token_index(torch.tensor([[1, 0], [0, 0]]))


def test_wrong_checkpoints(rm, reward_path, instruct_path, tmp_path):
    rm2 = AutoModelForSequenceClassification.from_pretrained(reward_path, num_labels=3, ignore_mismatched_sizes=True)
    with pytest.raises(ModelError, match="num_labels=3; a reward model must output one score"):
        RewardModelScorer(rm2, None)
    with pytest.raises(ModelError, match="could not load reward model"):
        RewardModelScorer(tmp_path)
    scorer = RewardModelScorer(rm, None)
    with pytest.raises(ModelError, match="score_texts needs a tokenizer"):
        scorer.score_texts(["x"])
    with pytest.raises(ModelError, match="must have the same shape"):
        scorer.score_ids(torch.ones(1, 3, dtype=torch.long), torch.ones(1, 2, dtype=torch.long))
