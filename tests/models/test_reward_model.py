"""RewardModelScorer: the score is read at each sequence's last real token, whatever the padding."""

from __future__ import annotations

import copy

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


def test_reward_model_from_causal_lm_scores_at_the_last_real_token_on_either_padding_side(instruct_path):
    """The model `trainer.kind: rm` trains: the causal LM's own backbone (shared) with a zero head; its scores
    (once the head is not zero) do not depend on the padding side, equal the unpadded float64 reference, and
    are differentiable."""
    from transformers import AutoModelForCausalLM

    from verl.models.reward_model import reward_model_from_causal_lm, sequence_scores

    causal = AutoModelForCausalLM.from_pretrained(instruct_path, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(instruct_path)
    rm = reward_model_from_causal_lm(causal, tok.pad_token_id).eval()
    assert rm.model is causal.model and rm.config.num_labels == 1 and rm.config.pad_token_id == tok.pad_token_id
    assert rm.config.architectures == ["Qwen2ForSequenceClassification"] and not hasattr(rm, "lm_head")
    ids = [tok.encode(t, add_special_tokens=False) for t in TEXTS]
    ids.append(ids[0][:3] + [tok.pad_token_id])  # a sequence whose last real token is the pad id
    assert sequence_scores(rm, torch.tensor([ids[1]]), torch.ones(1, len(ids[1]))).tolist() == [0.0]
    with torch.no_grad():
        rm.score.weight.normal_(0, 1, generator=torch.Generator().manual_seed(0))
    width = max(map(len, ids))
    pad = tok.pad_token_id
    right = torch.tensor([s + [pad] * (width - len(s)) for s in ids])
    left = torch.tensor([[pad] * (width - len(s)) + s for s in ids])
    right_mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in ids])
    left_mask = right_mask.flip(-1)
    scores_right = sequence_scores(rm, right, right_mask)
    scores_left = sequence_scores(rm, left, left_mask)
    assert scores_right.requires_grad
    torch.testing.assert_close(scores_left, scores_right, atol=1e-5, rtol=1e-5)
    double = copy.deepcopy(rm).double()
    with torch.no_grad():
        expected = [float(double.model(input_ids=torch.tensor([s])).last_hidden_state[0, -1] @ double.score.weight[0])
                    for s in ids]
    assert scores_right.tolist() == pytest.approx(expected, abs=1e-5)


def test_a_folder_without_a_score_head_is_refused_before_and_at_load(instruct_path, reward_path):
    from verl.models.reward_model import saved_head_problem

    with pytest.raises(ModelError, match=r"has no trained score head: its weights lack score.weight \(the folder "
                                         r"holds a Qwen2ForCausalLM\).*trainer.kind: rm"):
        RewardModelScorer(instruct_path)
    assert "has no trained score head" in saved_head_problem(instruct_path)
    assert saved_head_problem(reward_path) is None


def test_repeated_texts_are_scored_once_with_the_same_scores(rm, reward_path):
    tok = AutoTokenizer.from_pretrained(reward_path)
    scorer = RewardModelScorer(rm, tok, batch_size=2)
    texts = [TEXTS[0], TEXTS[1], TEXTS[0], TEXTS[2], TEXTS[1]]
    seen = []
    handle = rm.model.register_forward_hook(lambda _m, args, _o: seen.append(args[0].shape[0]))
    try:
        scores = scorer.score_texts(texts)
    finally:
        handle.remove()
    assert sum(seen) == 3  # three distinct texts, in batches of two
    torch.testing.assert_close(scores, torch.cat([scorer.score_texts([t]) for t in texts]), atol=1e-5, rtol=1e-5)
