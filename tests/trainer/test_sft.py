"""SFTTrainer: loss on output tokens only (float64 reference), packing == unpacked, gradient accumulation,
bit-exact resume, train_steps without checkpoints, and the user-facing errors."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from tiny_support import tiny_config

from verl.errors import ConfigError, DataError, ModelError
from verl.trainer.offline.sft_trainer import SFTTrainer, pack_examples

ROWS = [{"input": f"What is {a}+{b}?", "output": f" The answer is {a + b}."} for a in range(4) for b in range(3)]


@pytest.fixture(scope="module")
def tiny(tiny):
    """The module's tiny (model, tokenizer) (tests/conftest.py); tests take deep copies. Attention is sharpened
    so that a wrong mask or wrong positions change the loss visibly (random init gives nearly uniform attention)."""
    model, tok = tiny
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(0)
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.normal_(0, 0.3)
            layer.self_attn.k_proj.weight.normal_(0, 0.3)
    return model, tok


@pytest.fixture(scope="module")
def tiny64(tiny):
    """The same model in float64, for comparisons of weights after an optimizer step (see below)."""
    model, tok = tiny
    return copy.deepcopy(model).double(), tok


DEFAULTS = {"trainer": {"total_steps": 4}, "sft": {"batch_size": 6, "lr": 1e-3}, "actor": {"micro_batch_size": 4},
            "data": {"max_prompt_length": 32, "max_response_length": 32}}


def make_config(tmp_path: Path | None = None, **sections) -> object:
    """The tiny SFT run with `sections` on top."""
    return tiny_config(tmp_path / "run" if tmp_path else None, "sft", DEFAULTS, sections)


def trainer(tiny, cfg, rows=ROWS, **kw) -> SFTTrainer:
    model, tok = tiny
    return SFTTrainer(cfg, model=copy.deepcopy(model), tokenizer=tok, train_rows=rows, **kw)


def reference_loss(model, tok, rows) -> float:
    """Float64 token-mean NLL over output tokens (+ the appended EOS), each example run alone."""
    total, count = 0.0, 0
    with torch.no_grad():
        for row in rows:
            prompt = tok(row["input"])["input_ids"]
            full = tok(row["input"] + row["output"])["input_ids"] + [tok.eos_token_id]
            assert full[: len(prompt)] == prompt
            logits = model(input_ids=torch.tensor([full])).logits[0].double()
            logp = torch.log_softmax(logits, -1)
            for t in range(len(prompt), len(full)):
                total -= float(logp[t - 1, full[t]])
                count += 1
    return total / count


def test_loss_and_eval_loss_match_float64_reference(tiny):
    val = [*ROWS[:4], {"input": "Please compute 10+25 for me?", "output": " It is 35, of course."}]
    tr = trainer(tiny, make_config(), val_rows=val)
    mb = tr.micro_batches(tr.examples[:2], packed=False)[0]
    assert mb["keep_last"] < mb["input_ids"].shape[1]  # prompt positions skip the vocabulary projection
    ref = reference_loss(tr.model.eval(), tr.tokenizer, val)
    assert tr.validate()["val/loss"] == pytest.approx(ref, abs=1e-5)
    # A training step's reported loss is the same quantity on its own batch.
    tr.model.train()
    idx_state = copy.deepcopy(tr.sampler.state_dict())
    rows = [ROWS[i] for i in tr.sampler.take(6)]
    tr.sampler.load_state_dict(idx_state)
    expected = reference_loss(copy.deepcopy(tr.model).eval(), tr.tokenizer, rows)
    assert tr.step()["loss"] == pytest.approx(expected, abs=1e-5)


def test_packing_gives_the_unpacked_loss_and_update(tiny64):
    # float64: the packed and unpacked sums run in different orders, and AdamW divides each gradient by its
    # own size, so float32 rounding of a near-zero gradient would become a weight difference of up to lr.
    plain = trainer(tiny64, make_config(model={"dtype": "float64"}, sft={"packing": False}))
    packed = trainer(tiny64, make_config(model={"dtype": "float64"}, sft={"packing": True}))
    items = plain.examples[:6]
    mbs = packed.micro_batches(items, packed=True)
    n = len(items[0][0])
    assert all(len(ids) == n for ids, _ in items) and 4 * n <= packed.max_length < 5 * n
    assert len(mbs) == 1 and mbs[0]["input_ids"].shape == (2, 4 * n)  # 4 + 2 examples in 2 rows
    assert mbs[0]["position_ids"][0].tolist() == list(range(n)) * 4 and mbs[0]["attention_mask"] is None
    m_plain, m_packed = plain.step(), packed.step()
    assert m_packed["loss"] == pytest.approx(m_plain["loss"], abs=1e-9)
    assert m_packed["tokens/loss"] == m_plain["tokens/loss"]
    for a, b in zip(plain.model.parameters(), packed.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-9, rtol=0)  # ~1e-15 apart; a wrong update is off by ~lr (1e-3)


def test_packing_would_differ_if_examples_saw_each_other(tiny):
    """The packed/unpacked equality is meaningful: the same row with one causal mask gives another loss."""
    from verl.trainer.offline.sft_trainer import target_logprobs

    tr = trainer(tiny, make_config(sft={"packing": True}))
    mb = tr.micro_batches(tr.examples[:6], packed=True)[0]
    with torch.no_grad():
        isolated, _ = target_logprobs(tr.model, mb, tr.device)
        leaky = dict(mb, position_ids=torch.arange(mb["input_ids"].shape[1])[None])
        mixed, _ = target_logprobs(tr.model, leaky, tr.device)
    assert float((isolated - mixed).abs().max()) > 1e-2


def test_packing_refuses_a_model_that_attends_across_examples(tiny):
    class Leaky(torch.nn.Module):
        """A model that ignores position ids, so packed examples attend to each other."""

        def __init__(self, inner):
            super().__init__()
            self.inner, self.config = inner, inner.config

        def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=False):
            return self.inner(input_ids=input_ids, use_cache=False)

    model, tok = tiny
    with pytest.raises(ModelError, match=r"sft.packing=true.*attend to each other.*sft.packing=false"):
        SFTTrainer(make_config(sft={"packing": True}), model=Leaky(copy.deepcopy(model)), tokenizer=tok,
                   train_rows=ROWS)


def test_pack_examples_first_fit():
    bins = pack_examples([5, 3, 4, 2, 6], capacity=8)
    assert sorted(i for b in bins for i in b) == [0, 1, 2, 3, 4]
    assert all(sum([5, 3, 4, 2, 6][i] for i in b) <= 8 for b in bins)
    assert len(bins) == 3


def test_gradient_accumulation_equals_one_batch(tiny64):
    # float64: AdamW's first step is lr * g / (|g| + eps), so float32 rounding of another summation order in a
    # gradient near eps would become a weight difference of up to lr, larger or smaller with the CPU's kernel.
    one = trainer(tiny64, make_config(model={"dtype": "float64"}, actor={"micro_batch_size": 6}))
    many = trainer(tiny64, make_config(model={"dtype": "float64"}, actor={"micro_batch_size": 1}))
    a, b = one.step(), many.step()
    assert b["loss"] == pytest.approx(a["loss"], abs=1e-9)
    assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-9)  # a scaling bug shows here (Adam hides it)
    for p, q in zip(one.model.parameters(), many.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=1e-9, rtol=0)  # ~1e-14 apart; a wrong gradient moves them by ~lr


def test_train_steps_learns_and_writes_nothing(tiny, tmp_path):
    tr = trainer(tiny, make_config(tmp_path, sft={"lr": 3e-3}))
    metrics = tr.train_steps(8)
    assert len(metrics) == 8 and tr.step_count == 8
    assert metrics[-1]["loss"] < 0.7 * metrics[0]["loss"]
    assert not (tmp_path / "run").exists()


def test_batch_larger_than_dataset_streams_over_epochs(tiny):
    rows = ROWS[:3]
    tr = trainer(tiny, make_config(sft={"batch_size": 8}), rows=rows)
    seen = [i for _ in range(3) for i in tr.next_indices()]  # 24 draws = exactly 8 epochs of 3 rows
    assert sorted(seen) == sorted([0, 1, 2] * 8)


def test_steps_from_sft_steps_or_epochs(tiny):
    assert trainer(tiny, make_config(sft={"steps": 7})).config.trainer.total_steps == 7
    # 2 epochs of 12 rows in batches of 5 -> ceil(24 / 5) = 5 steps
    assert trainer(tiny, make_config(sft={"epochs": 2, "batch_size": 5})).config.trainer.total_steps == 5
    with pytest.raises(ConfigError, match=r"sft.steps=3 and sft.epochs=1 are both set; set only one"):
        trainer(tiny, make_config(sft={"steps": 3, "epochs": 1}))


def test_messages_rows_learn_only_assistant_turns(tiny):
    rows = [{"messages": [{"role": "user", "content": "What is 2+2?"},
                          {"role": "assistant", "content": "4"}]}]
    tr = trainer(tiny, make_config(sft={"batch_size": 1}), rows=rows)
    ids, targets = tr.examples[0]
    learned = [t for t in targets if t != -100]
    text = tr.tokenizer.decode(learned)
    assert text.startswith("4") and "What" not in text and len(learned) < len(ids) / 2


def test_train_examples_learn_only_their_labelled_tokens(tiny):
    """Caller-tokenised examples (a tool episode): the loss covers the labelled tokens only, not the
    observation in the middle (float64 reference, each position scored on its own)."""
    model, tok = tiny
    enc = [tok(t, add_special_tokens=False)["input_ids"] for t in ("What is 3*4?", " <calc>3*4</calc>",
                                                                   " <result>12</result>", " 12")]
    ids = [t for part in enc for t in part] + [tok.eos_token_id]
    labels = [-100] * len(enc[0]) + enc[1] + [-100] * len(enc[2]) + enc[3] + [tok.eos_token_id]
    tr = SFTTrainer(make_config(sft={"batch_size": 1}), model=copy.deepcopy(model), tokenizer=tok,
                    train_examples=[(ids, labels)])
    with torch.no_grad():
        logp = torch.log_softmax(tr.model.eval()(input_ids=torch.tensor([ids])).logits[0].double(), -1)
    scored = [t for t in range(1, len(ids)) if labels[t] != -100]
    expected = -sum(float(logp[t - 1, ids[t]]) for t in scored) / len(scored)
    assert len(scored) == len(enc[1]) + len(enc[3]) + 1
    tr.model.train()
    assert tr.step()["loss"] == pytest.approx(expected, abs=1e-5)
    for bad, match in [((ids, labels[:-1]), r"train_examples\[0\]: \d+ ids but \d+ labels"),
                       ((ids, [-100] * len(ids)), r"train_examples\[0\]: no token after the first has a label"),
                       ((ids, [5] * len(ids)), r"train_examples\[0\]: a label must be its id or -100"),
                       (([10**6], [10**6]), r"token ids must be in \[0, ")]:
        with pytest.raises(DataError, match=match):
            SFTTrainer(make_config(), model=model, tokenizer=tok, train_examples=[bad])
    with pytest.raises(ConfigError, match="both train_rows and train_examples"):
        SFTTrainer(make_config(), model=model, tokenizer=tok, train_rows=ROWS, train_examples=[(ids, labels)])


def test_bad_rows_and_boundary_mismatch_are_reported(tiny):
    with pytest.raises(DataError, match=r"train_rows\[1\].*output"):
        trainer(tiny, make_config(), rows=[ROWS[0], {"input": "no output here"}])
    with pytest.raises(DataError, match=r"train_rows\[0\] is a str; each row must be a dict"):
        trainer(tiny, make_config(), rows=["What is 1+1?"])
    with pytest.warns(UserWarning, match=r"2 of 2 train rows: the tokenised prompt is not a prefix"):
        tr = trainer(tiny, make_config(sft={"batch_size": 2}),
                     rows=[{"input": "Say ", "output": "hello"}, {"input": "Tell me ", "output": "more"}])
    assert tr.boundary_mismatch == {"train": 2}


def _jsonl(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(("timing/", "perf/"))} for r in rows]


def test_resume_is_bit_exact(tiny, tmp_path):
    """4 steps straight == 2 steps, crash, resume, 2 steps: same metrics.jsonl and the same weights."""
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))

    def cfg(name):
        return make_config(tmp_path / name, data={"train_files": [str(data)], "val_size": 3},
                           checkpoint={"save_interval": 2}, trainer={"resume": "auto", "val_every": 2})

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
    assert resumed.step_count == 4
    assert _jsonl(tmp_path / "b" / "run") == _jsonl(tmp_path / "a" / "run")
    assert [r["step"] for r in _jsonl(tmp_path / "a" / "run")] == [0, 1, 2, 3, 4]
    for (k, p), q in zip(straight.model.state_dict().items(), resumed.model.state_dict().values(), strict=True):
        assert torch.equal(p, q), k


def test_build_trainer_dispatches_to_sft(tmp_path):
    from verl.trainer.entry import build_trainer

    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    tr = build_trainer(make_config(tmp_path, data={"train_files": [str(data)]}))
    assert isinstance(tr, SFTTrainer) and len(tr.train_data) == len(ROWS)
