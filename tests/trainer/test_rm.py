"""RMTrainer (`trainer.kind: rm`): the loss on a hand-built batch against a float64 reference (margins and
centring included), learning easy preferences, the exported Hugging Face folder (loaded by transformers and by
`reward.model_path` with the trainer's scores), LoRA on CPU, bit-exact resume, and the bad-input errors."""

from __future__ import annotations

import copy
import json
import math
import random
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from tiny_support import tiny_config
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from verl.data.datasets import left_pad
from verl.errors import ConfigError, DataError, ModelError
from verl.models.reward_model import RewardModelScorer, sequence_scores
from verl.trainer.offline.rm_trainer import EXPORT_DIR, RMTrainer


def arithmetic_pairs(n: int, seed: int = 0) -> list[dict[str, str]]:
    """Correct vs wrong single-digit sums: an easy, learnable preference."""
    rng = random.Random(seed)
    rows = [{"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(a + b + rng.randint(1, 4))}
            for a in range(6) for b in range(6)]
    rng.shuffle(rows)
    return rows[:n]


ROWS = arithmetic_pairs(16)


DEFAULTS = {"trainer": {"total_steps": 4, "resume": "never"}, "rm": {"lr": 3e-3}, "actor": {"micro_batch_size": 16},
            "data": {"train_batch_size": 8, "max_prompt_length": 16, "max_response_length": 8}}


def make_config(tmp_path: Path | None = None, **sections):
    """The tiny reward-model run (`tiny` is the module's shared model: tests/conftest.py) with `sections` on top."""
    return tiny_config(tmp_path / "run" if tmp_path else None, "rm", DEFAULTS, sections)


def trainer(tiny, cfg, rows=ROWS, **kw) -> RMTrainer:
    model, tok = tiny
    return RMTrainer(cfg, model=copy.deepcopy(model), tokenizer=tok, train_rows=rows, **kw)


def reference_reward(model, tok, text: str) -> float:
    """Float64: the score head on the last position's hidden state, the sequence run alone, no padding."""
    ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
    double = copy.deepcopy(model).double().eval()
    with torch.no_grad():
        hidden = double.model(input_ids=ids).last_hidden_state[0, -1]
        return float(hidden @ double.score.weight[0])


def test_first_loss_is_log2_and_the_loss_matches_a_float64_reference(tiny):
    rows = [{**ROWS[0], "margin": 0.5}, ROWS[1], {**ROWS[2], "margin": -1.0}]
    tr = trainer(tiny, make_config(rm={"center_rewards_coefficient": 0.1}, data={"train_batch_size": 3}), rows=rows)
    with torch.no_grad():
        losses, stats = tr.pair_loss("train", tr.train_data, [0, 1, 2])
    # The zero score head: every reward is 0, so the loss is log(1 + e^margin) (log 2 without a margin).
    assert losses.tolist() == pytest.approx([math.log1p(math.exp(0.5)), math.log(2), math.log1p(math.exp(-1))])
    assert stats["accuracy"].tolist() == [0.0, 0.0, 0.0]
    with torch.no_grad():
        tr.model.score.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(0))
        losses, stats = tr.pair_loss("train", tr.train_data, [0, 1, 2])  # one left-padded forward of 6 rows
    model, tok = tr.model, tr.tokenizer
    expected, chosen = [], []
    for row in rows:
        rc, rr = (reference_reward(model, tok, row["prompt"] + row[side]) for side in ("chosen", "rejected"))
        z = rc - rr - row.get("margin", 0.0)
        expected.append(math.log1p(math.exp(-z)) + 0.1 * (rc + rr) ** 2)
        chosen.append(rc)
    assert losses.tolist() == pytest.approx(expected, abs=1e-5)
    assert stats["rewards/chosen"].tolist() == pytest.approx(chosen, abs=1e-5)
    torch.testing.assert_close(stats["rewards/margins"], stats["rewards/chosen"] - stats["rewards/rejected"])


def test_learns_easy_preferences_and_exports_a_folder_transformers_and_reward_model_path_load(tiny, tmp_path):
    cfg = make_config(tmp_path, trainer={"total_steps": 24, "val_every": 12}, rm={"center_rewards_coefficient": 0.01})
    tr = trainer(tiny, cfg, val_rows=ROWS)
    history = tr.fit()
    val = [h for h in history if "val/accuracy" in h]
    assert val[0]["val/accuracy"] == 0.0 and val[0]["val/loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert val[-1]["val/accuracy"] > 0.9 and val[-1]["val/rewards/margins"] > 0
    assert history[-1]["loss"] < history[1]["loss"]

    out = tr.export_dir
    assert out == tmp_path / "run" / EXPORT_DIR
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForSequenceClassification"] and len(config["id2label"]) == 1
    assert config["pad_token_id"] == tr.tokenizer.pad_token_id
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert "score.weight" in names and not any(n.startswith("lm_head") for n in names)
    assert (out / "tokenizer.json").is_file() and (out / "tokenizer_config.json").is_file()

    texts = ["3+4=7", "3+4=9", "5+5=10", "2+1=3"]
    ids, mask = left_pad([tr.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts], tr.pad_id)
    tr.model.eval()
    with torch.no_grad():
        trained = sequence_scores(tr.model, ids, mask)
    hf = AutoModelForSequenceClassification.from_pretrained(out).eval()
    hf_tok = AutoTokenizer.from_pretrained(out)
    enc = hf_tok(texts, add_special_tokens=False, padding=True, return_tensors="pt")
    with torch.no_grad():
        plain = hf(**enc).logits[:, 0]  # transformers' own pooling (no text here ends with the pad token)
    torch.testing.assert_close(plain, trained, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(RewardModelScorer(str(out))(texts), trained, atol=1e-5, rtol=1e-5)


def test_lora_trains_adapters_and_the_head_and_exports_merged_weights(tiny, tmp_path):
    pytest.importorskip("peft")
    cfg = make_config(tmp_path, model={"lora": {"rank": 4}}, trainer={"total_steps": 6})
    tr = trainer(tiny, cfg)
    trainable = {n for n, p in tr.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n or ".score." in n for n in trainable)
    assert any(".score." in n for n in trainable)  # the head trains in full (peft's modules_to_save)
    backbone = {n: p.detach().clone() for n, p in tr.model.named_parameters() if "base_layer" in n}
    tr.fit()
    assert all(torch.equal(p, backbone[n]) for n, p in tr.model.named_parameters() if n in backbone)
    files = {p.name for p in tr.export_dir.iterdir()}
    assert "adapter_config.json" not in files and "model.safetensors" in files
    texts = ["3+4=7", "3+4=9"]
    ids, mask = left_pad([tr.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts], tr.pad_id)
    tr.model.eval()
    with torch.no_grad():
        trained = sequence_scores(tr.model, ids, mask)
    assert float(trained.abs().max()) > 0  # the head moved off zero
    torch.testing.assert_close(RewardModelScorer(str(tr.export_dir))(texts), trained, atol=1e-5, rtol=1e-5)


def _jsonl(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(("timing/", "perf/"))} for r in rows]


def test_resume_is_bit_exact(tiny, tmp_path):
    """4 steps straight == 2 steps, crash, resume, 2 steps (rows from a file, validation held out)."""
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in arithmetic_pairs(20)))

    def cfg(name):
        return make_config(tmp_path / name, data={"train_files": [str(data)], "val_size": 4},
                           checkpoint={"save_interval": 2}, trainer={"resume": "auto", "val_every": 2},
                           rm={"export": False})

    straight = trainer(tiny, cfg("a"), rows=None)
    straight.fit()

    class Crash(Exception):
        pass

    first = trainer(tiny, cfg("b"), rows=None)
    step = first.step
    first.step = lambda: (_ for _ in ()).throw(Crash()) if first.step_count == 2 else step()
    with pytest.raises(Crash):
        first.fit()
    resumed = trainer(tiny, cfg("b"), rows=None)
    resumed.fit()
    assert _jsonl(tmp_path / "a" / "run") == _jsonl(tmp_path / "b" / "run")
    for p, q in zip(straight.model.parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(p, q)


def test_bad_rows_are_data_errors_with_their_location(tiny, tmp_path):
    same = [ROWS[0], {"prompt": "1+1=", "chosen": "2", "rejected": "2"}]
    with pytest.raises(DataError, match=r"train_rows\[1\]: 'chosen' and 'rejected' are the same answer"):
        trainer(tiny, make_config(), rows=same)
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in [*ROWS[:3], same[1], {**ROWS[4], "margin": "big"}]))
    with pytest.raises(DataError) as err:
        trainer(tiny, make_config(data={"train_files": [str(data)]}), rows=None)
    text = str(err.value)
    assert "pairs.jsonl:4" in text and "same_answer" in text and "prefers neither" in text
    assert "pairs.jsonl:5" in text and "bad_margin" in text
    long = [{"prompt": "1+1=" * 20, "chosen": "2", "rejected": "3"}]
    with pytest.raises(DataError, match=r"train_rows:0: the sequence has \d+ tokens, more than max_length=24"):
        trainer(tiny, make_config(), rows=long)
    cut = trainer(tiny, make_config(data={"truncation": "truncate_left"}), rows=long)
    assert len(cut.train_data[0]["chosen_input_ids"]) == 24 and cut.train_data.truncated == 2
    with pytest.raises(ConfigError, match="data.apply_chat_template=always with trainer.kind=rm"):
        trainer(tiny, make_config(data={"apply_chat_template": "always"}))
    three = copy.deepcopy(tiny[0].config)
    three.num_labels = 3
    with pytest.raises(ModelError, match="num_labels=3; a reward model outputs one score"):
        RMTrainer(make_config(), model=AutoModelForSequenceClassification.from_config(three), tokenizer=tiny[1],
                  train_rows=ROWS)


def test_chat_rows_are_read_as_reward_model_path_scores_them(tiny):
    """Messages go through the chat template with the answer as the assistant turn, the same text RL's reward
    model function builds for a chat prompt and its response, so training and scoring see the same tokens."""
    from verl.trainer.rl.rewards import RewardModelFunction

    model, tok = tiny
    prompt = [{"role": "system", "content": "Add."}, {"role": "user", "content": "What is 2+3?"}]
    rows = [{"prompt": prompt, "chosen": "5", "rejected": [{"role": "assistant", "content": "6"}]}]
    tr = trainer(tiny, make_config(data={"train_batch_size": 1, "max_prompt_length": 64}), rows=rows)
    item = tr.train_data[0]
    captured = []

    class Scorer:
        tokenizer = tok

        def score_texts(self, texts):
            captured.extend(texts)
            return torch.zeros(len(texts))

    RewardModelFunction(Scorer(), 1.0)([prompt, prompt], ["5", "6"], [None, None], [{}, {}])
    assert "<|im_start|>assistant\n5<|im_end|>" in captured[0]
    assert [tok(t, add_special_tokens=False)["input_ids"] for t in captured] == [
        item["chosen_input_ids"], item["rejected_input_ids"]]


def test_pair_rows_score_and_train_as_the_whole_sequences(tiny, monkeypatch):
    """A pair's shared tokens once, then both answers in one row (`verl.trainer.forward.pair_rows`): the same
    rewards and gradients as scoring the chosen and rejected sequences whole; one forward either way."""
    from verl.trainer.forward import pair_rows

    shared = trainer(tiny, make_config(data={"train_batch_size": 4}))
    whole = trainer(tiny, make_config(data={"train_batch_size": 4}, actor={"share_prompt_forward": False}))
    for tr in (shared, whole):
        with torch.no_grad():
            tr.model.score.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(0))
    items = [shared.train_data[i] for i in range(4)]
    chosen, rejected = [it["chosen_input_ids"] for it in items], [it["rejected_input_ids"] for it in items]
    assert pair_rows.pair_scores(shared.model, chosen, rejected, shared.pad_id, shared.device) is not None

    def run(tr):
        calls = []
        hook = tr.model.register_forward_hook(lambda *a: calls.append(1))
        tr.model.zero_grad(set_to_none=True)
        rewards = tr.pair_scores(tr.train_data, range(4))
        (rewards * torch.tensor([[1.0, -2.0]])).sum().backward()
        hook.remove()
        assert len(calls) == 1
        return rewards.detach(), {n: p.grad for n, p in tr.model.named_parameters() if p.grad is not None}

    (got, got_grads), (want, want_grads) = run(shared), run(whole)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert set(got_grads) == set(want_grads)
    for name, g in want_grads.items():
        assert float((got_grads[name] - g).abs().max()) <= 1e-5 * max(float(g.abs().max()), 1e-12), name
    # a pair that differs from its first token, or an attention that does not take the mask: scored whole
    assert pair_rows.pair_scores(shared.model, [[5, 6]] + chosen, [[7, 6]] + rejected, shared.pad_id,
                                 shared.device) is None
    monkeypatch.setattr(shared.model.config, "_attn_implementation", "eager")
    assert pair_rows.pair_scores(shared.model, chosen, rejected, shared.pad_id, shared.device) is None


def test_pair_rows_score_degenerate_pairs_as_whole_sequences(tiny):
    """Pairs a careless dataset holds: chosen == rejected, one answer a prefix of the other, one-token answers,
    different lengths in one batch; each pair row scores exactly what the whole sequences score."""
    from verl.trainer.forward.pair_rows import pair_scores

    tr = trainer(tiny, make_config())
    with torch.no_grad():
        tr.model.score.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(0))
    chosen = [[11, 12, 13, 14], [11, 12, 13], [11, 12, 13, 14, 15, 16], [21, 22]]
    rejected = [[11, 12, 13, 14], [11, 12, 13, 14, 15], [11, 12], [21, 23]]
    with torch.no_grad():
        got = pair_scores(tr.model, chosen, rejected, tr.pad_id, tr.device)
        ids, mask = left_pad(chosen + rejected, tr.pad_id)
        want = torch.stack(sequence_scores(tr.model, ids, mask).chunk(2), dim=1)
    assert got is not None
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert float(got[0, 0]) == pytest.approx(float(got[0, 1]), abs=1e-6)  # the same sequence scores the same
