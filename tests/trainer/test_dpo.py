"""DPOTrainer: the loss on a hand-built batch against a float64 reference (sigmoid, IPO, hinge), precomputed
vs frozen reference, learning on easy pairs, bit-exact resume, and the user-facing errors."""

from __future__ import annotations

import copy
import json
import math
import random
from pathlib import Path

import pytest
import torch
from tiny_support import tiny_config

from verl.errors import ConfigError, DataError, ModelError
from verl.trainer.offline.dpo_trainer import DPOTrainer


def arithmetic_pairs(n: int, seed: int = 0) -> list[dict[str, str]]:
    """Correct vs wrong single-digit sums: an easy, learnable preference."""
    rng = random.Random(seed)
    rows = []
    for a in range(5):
        for b in range(5):
            wrong = (a + b + rng.randint(1, 4)) % 10
            rows.append({"prompt": f"What is {a}+{b}?", "chosen": f" {a + b}", "rejected": f" {wrong}"})
    rng.shuffle(rows)
    return rows[:n]


ROWS = arithmetic_pairs(16)


@pytest.fixture(scope="module")
def tiny64(tiny):
    """The same model in float64, for comparisons of weights after an optimizer step."""
    model, tok = tiny
    return copy.deepcopy(model).double(), tok


DEFAULTS = {"trainer": {"total_steps": 4}, "dpo": {"lr": 2e-3, "beta": 0.1}, "actor": {"micro_batch_size": 8},
            "data": {"train_batch_size": 8, "max_prompt_length": 32, "max_response_length": 16}}


def make_config(tmp_path: Path | None = None, **sections):
    """The tiny DPO run (`tiny` is the module's shared model: tests/conftest.py) with `sections` on top."""
    return tiny_config(tmp_path / "run" if tmp_path else None, "dpo", DEFAULTS, sections)


def trainer(tiny, cfg, rows=ROWS, **kw) -> DPOTrainer:
    model, tok = tiny
    return DPOTrainer(cfg, model=copy.deepcopy(model), tokenizer=tok, train_rows=rows, **kw)


def perturbed(model: torch.nn.Module, seed: int = 1) -> torch.nn.Module:
    """A different reference, so that the log-ratios of the hand-built batch are not all zero."""
    ref = copy.deepcopy(model)
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return ref


def ref_seq_logp(model, tok, prompt: str, response: str) -> tuple[float, int]:
    """Float64 sum of response-token log-probs (response + appended EOS), the sequence run alone."""
    p_ids = tok(prompt)["input_ids"]
    full = tok(prompt + response)["input_ids"] + [tok.eos_token_id]
    assert full[: len(p_ids)] == p_ids
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=torch.tensor([full])).logits[0].double(), -1)
    return sum(float(logp[t - 1, full[t]]) for t in range(len(p_ids), len(full))), len(full) - len(p_ids)


def reference_dpo(policy, ref, tok, rows, beta, loss_type, ls) -> list[float]:
    out = []
    for r in rows:
        (pc, nc), (pr, nr) = (ref_seq_logp(policy, tok, r["prompt"], r[s]) for s in ("chosen", "rejected"))
        (rc, _), (rr, _) = (ref_seq_logp(ref, tok, r["prompt"], r[s]) for s in ("chosen", "rejected"))
        if loss_type == "ipo":
            d = (pc / nc - rc / nc) - (pr / nr - rr / nr)
            out.append((d - 1 / (2 * beta)) ** 2)
            continue
        d = (pc - rc) - (pr - rr)
        if loss_type == "sigmoid":
            logsig = lambda x: -math.log1p(math.exp(-x))  # noqa: E731
            out.append(-(1 - ls) * logsig(beta * d) - ls * logsig(-beta * d))
        else:
            out.append(max(0.0, 1 - beta * d))
    return out


@pytest.mark.parametrize(("loss_type", "ls"), [("sigmoid", 0.0), ("sigmoid", 0.2), ("ipo", 0.0), ("hinge", 0.0)])
def test_pair_loss_matches_float64_reference(tiny, loss_type, ls):
    model, tok = tiny
    ref = perturbed(model)
    rows = [ROWS[0], ROWS[1], {"prompt": "What is 12+30?", "chosen": " 42", "rejected": " It is 7 or so."}]
    cfg = make_config(dpo={"loss_type": loss_type, "label_smoothing": ls, "beta": 0.5},
                      data={"train_batch_size": 3})
    tr = trainer(tiny, cfg, rows=rows, ref_model=copy.deepcopy(ref))
    tr.model.eval()
    batch = tr.pair_batch([tr.train_data[i] for i in range(3)])
    # left-padded; logits only for responses
    assert 1 < batch.collated["keep_last"] < batch.collated["input_ids"].shape[1]
    with torch.no_grad():
        losses, stats = tr.pair_loss("train", tr.train_data, [0, 1, 2])  # one concatenated, padded forward
    expected = reference_dpo(model.eval(), ref.eval(), tok, rows, 0.5, loss_type, ls)
    model.train()
    assert losses.tolist() == pytest.approx(expected, abs=1e-5)
    assert set(stats) >= {"rewards/chosen", "rewards/rejected", "rewards/margins", "accuracy", "logps/chosen"}
    torch.testing.assert_close(stats["rewards/margins"], stats["rewards/chosen"] - stats["rewards/rejected"])


def test_precomputed_reference_equals_frozen_copy_and_frees_it(tiny):
    frozen = trainer(tiny, make_config(dpo={"precompute_ref": False}))
    pre = trainer(tiny, make_config(dpo={"precompute_ref": True}))
    assert pre.ref_model is None and frozen.ref_model is not None
    assert all(not p.requires_grad for p in frozen.ref_model.parameters())
    assert pre.ref_logps["train"].shape == (len(ROWS), 2)
    a, b = frozen.step(), pre.step()
    for key in ("loss", "rewards/margins", "logps/chosen", "grad_norm"):
        assert b[key] == pytest.approx(a[key], abs=1e-5), key
    assert a["loss"] == pytest.approx(math.log(2), abs=1e-6)  # policy == reference at the first step


def test_dpo_learns_easy_preferences(tiny):
    """Correct vs wrong sums: preference accuracy on the training pairs goes from 0 to above 0.9."""
    tr = trainer(tiny, make_config(), val_rows=ROWS)
    before = tr.validate()
    metrics = tr.train_steps(16)
    after = tr.validate()
    assert before["val/accuracy"] == 0.0 and before["val/loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert after["val/accuracy"] > 0.9
    assert after["val/loss"] < 0.6 and after["val/rewards/margins"] > 0
    assert metrics[-1]["loss"] < metrics[0]["loss"]


@pytest.mark.parametrize("loss_type", ["ipo", "hinge"])
def test_other_losses_train(tiny, loss_type):
    tr = trainer(tiny, make_config(dpo={"loss_type": loss_type}), val_rows=ROWS)
    before = tr.validate()["val/loss"]
    tr.train_steps(4)
    assert tr.validate()["val/loss"] < before


def test_micro_batches_accumulate_to_the_full_batch(tiny64):
    # float64: Adam's first step is lr * g / (|g| + eps), 2e-3 for any clear gradient; float32 rounding (which
    # differs between row counts and CPU matmul kernels) of a gradient near eps would move a weight by up to that.
    one = trainer(tiny64, make_config(model={"dtype": "float64"}, actor={"micro_batch_size": 16}))
    many = trainer(tiny64, make_config(model={"dtype": "float64"}, actor={"micro_batch_size": 2}))
    assert many.pairs_per_micro == 1
    a, b = one.step(), many.step()
    assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-9)
    for p, q in zip(one.model.parameters(), many.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=1e-9, rtol=0)  # ~1e-14 apart; a wrong update is off by ~2e-3


def test_errors_and_boundary_warning(tiny):
    with pytest.raises(ConfigError, match=r"dpo.label_smoothing=0.1 only applies to dpo.loss_type=sigmoid"):
        trainer(tiny, make_config(dpo={"loss_type": "hinge", "label_smoothing": 0.1}))
    with pytest.raises(DataError, match=r"train_rows\[0\].*rejected"):
        trainer(tiny, make_config(), rows=[{"prompt": "Hi", "chosen": "a"}])
    rows = [{"prompt": "Say ", "chosen": "hello", "rejected": "bye"}] * 8
    with pytest.warns(UserWarning, match=r"8 of 8 train rows: the tokenised prompt is not a prefix"):
        tr = trainer(tiny, make_config(), rows=rows)
    assert tr.boundary_mismatch["train"] == 8


def _jsonl(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(("timing/", "perf/"))} for r in rows]


def test_resume_is_bit_exact(tiny, tmp_path):
    """4 steps straight == 2 steps, crash, resume, 2 steps (precomputed reference, files, validation)."""
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in arithmetic_pairs(20)))

    def cfg(name):
        return make_config(tmp_path / name, data={"train_files": [str(data)], "val_size": 4},
                           dpo={"precompute_ref": True}, checkpoint={"save_interval": 2},
                           trainer={"resume": "auto", "val_every": 2})

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
    got, want = _jsonl(tmp_path / "b" / "run"), _jsonl(tmp_path / "a" / "run")
    assert got == want and [r["step"] for r in want] == [0, 1, 2, 3, 4] and "val/accuracy" in want[-1]
    for (k, p), q in zip(straight.model.state_dict().items(), resumed.model.state_dict().values(), strict=True):
        assert torch.equal(p, q), k


def test_build_trainer_dispatches_to_dpo(tmp_path):
    from verl.trainer.entry import build_trainer

    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    tr = build_trainer(make_config(tmp_path, data={"train_files": [str(data)]}))
    assert isinstance(tr, DPOTrainer) and len(tr.train_data) == len(ROWS)


def test_ref_path_with_another_tokenizer_is_refused_as_in_rl(tiny, tmp_path):
    # DPO and RL build their reference with one function (verl.trainer.build.models.build_reference)
    from verl.models.tiny import build_tiny_model

    other = build_tiny_model(tmp_path / "other", vocab_size=512)
    with pytest.raises(ModelError, match=r"ref.path=.*different tokenizer from model.path='tiny'.*same model family"):
        trainer(tiny, make_config(ref={"path": str(other)}))
