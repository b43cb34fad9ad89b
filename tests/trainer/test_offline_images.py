"""SFT and DPO on rows with images (tiny Qwen2.5-VL, float32): the losses and log-probs equal a plain forward of
the processor's own outputs, the loss depends on the image, the reference sees the images, text rows still
train on a vision-language model, and image rows on a text model or cut by truncation are refused by name."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from tiny_support import tiny_config

from verl.config.schema import DataConfig
from verl.data.datasets import SFTDataset
from verl.errors import ConfigError, DataError
from verl.models.hf_loader import load_hf_model
from verl.models.tiny_vl import build_tiny_vl_model
from verl.models.vision import batch_processor_inputs, load_processor, vision_messages
from verl.rollout.prompts import PromptCodec
from verl.trainer.forward.logprobs import target_logprobs
from verl.trainer.offline.dpo_trainer import DPOTrainer
from verl.trainer.offline.rm_trainer import RMTrainer
from verl.trainer.offline.sft_trainer import SFTTrainer, shifted_targets
from verl.trainer.offline.vision import image_tokens

PIL = pytest.importorskip("PIL.Image")
VL = "tiny:qwen2_5_vl"


def image(seed: int, size: int = 56):
    return PIL.fromarray(np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8))


def sft_config(**sections):
    base = {"model": {"path": VL}, "trainer": {"total_steps": 4}, "sft": {"batch_size": 4, "lr": 1e-2},
            "actor": {"micro_batch_size": 2}, "data": {"max_prompt_length": 64, "max_response_length": 16}}
    return tiny_config(None, "sft", base, sections)


def dpo_config(**sections):
    base = {"model": {"path": VL}, "trainer": {"total_steps": 2}, "dpo": {"beta": 0.5},
            "data": {"train_batch_size": 2, "max_prompt_length": 64, "max_response_length": 16},
            "actor": {"micro_batch_size": 4}}
    return tiny_config(None, "dpo", base, sections)


SFT_ROWS = [{"messages": [{"role": "user", "content": "<image>What is shown?"},
                          {"role": "assistant", "content": f"Shape {i}."}], "images": [image(i)]} for i in range(3)]
SFT_ROWS.append({"input": "Look: <image> and <image>?", "output": " both", "images": [image(7, 40), image(8, 64)]})


@pytest.fixture(scope="module")
def vl():
    return load_hf_model(build_tiny_vl_model(), torch_dtype="fp32", device="cpu", return_processor=True)


def reference_nll(model, processor, prompt, response_messages, images, *, chat=True) -> tuple[float, int]:
    """Summed NLL and count of the response tokens: the processor's outputs for prompt and prompt + response,
    one plain forward of the model's own (`model(**inputs)`)."""
    prompt_ids = batch_processor_inputs(processor, [images], [prompt], chat=chat)["input_ids"][0]
    if chat:
        messages = vision_messages(prompt, len(images)) + response_messages
        full = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    else:
        full = prompt.replace("<image>", "<|vision_start|><|image_pad|><|vision_end|>") + response_messages
        full += processor.tokenizer.eos_token
    inputs = processor(text=[full], images=images, return_tensors="pt", add_special_tokens=False)
    ids = inputs["input_ids"][0]
    assert torch.equal(ids[: len(prompt_ids)], prompt_ids)
    with torch.no_grad():
        logp = torch.log_softmax(model(**inputs).logits[0].double(), -1)
    targets = range(len(prompt_ids), len(ids))
    return -sum(float(logp[t - 1, ids[t]]) for t in targets), len(targets)


def row_nll(tr, rows):
    """The trainer's summed NLL of each row, through its own tokenisation, images and forward."""
    out = []
    tr.model.eval()
    with torch.no_grad():
        for row in rows:
            ds = SFTDataset(tr.normalize_rows([row], "rows"), tr.tokenizer, tr.max_length, images=tr.image_tokens)
            items = [(ids, shifted_targets(labels)) for ids, labels in ds.items]
            mb = tr.micro_batches(items, packed=False, images=ds.images, rows=ds.rows)[0]
            logprobs, _ = target_logprobs(tr.model, mb, tr.device)
            out.append(-float(logprobs.double().sum()))
    tr.model.train()
    return out


def test_sft_loss_equals_a_plain_forward_of_the_processor_outputs(vl):
    model, _, processor = vl
    tr = SFTTrainer(sft_config(), train_rows=SFT_ROWS, val_rows=SFT_ROWS)
    assert tr.parts.processor is not None and tr.example_images[3][1] == [1, 4]  # 40x40 -> 1 token, 64x64 -> 4
    ids, labels = tr.val_data.items[0]
    pad = tr.image_tokens.image_token_id
    assert all(lab == -100 for t, lab in zip(ids, labels, strict=True) if t == pad)  # image tokens: no loss
    total, count = 0.0, 0
    for row in SFT_ROWS:
        if "messages" in row:
            nll, n = reference_nll(model, processor, row["messages"][:1], row["messages"][1:], row["images"])
        else:
            nll, n = reference_nll(model, processor, row["input"], row["output"], row["images"], chat=False)
        total, count = total + nll, count + n
    assert tr.validate()["val/loss"] == pytest.approx(total / count, abs=1e-5)


def test_sft_on_image_rows_lowers_their_loss_and_the_loss_depends_on_the_image():
    tr = SFTTrainer(sft_config(), train_rows=SFT_ROWS, val_rows=SFT_ROWS)
    swapped = [dict(SFT_ROWS[0], images=[image(99)])]
    a, b = row_nll(tr, [SFT_ROWS[0], *swapped])
    assert abs(a - b) > 1e-4  # same text, another image: another loss
    before = tr.validate()["val/loss"]
    losses = [m["loss"] for m in tr.train_steps(4)]
    assert all(np.isfinite(losses)) and tr.validate()["val/loss"] < before - 0.5


def test_text_rows_train_on_a_vision_language_model_alone_and_mixed_with_image_rows():
    text = [{"input": f"What is {i}+1?", "output": f" {i + 1}"} for i in range(3)]
    tr = SFTTrainer(sft_config(), train_rows=[*text, SFT_ROWS[0]])
    assert tr.example_images[:3] == [None, None, None]
    for m in tr.train_steps(2):  # batches of text rows only and mixed ones (micro-batches of 2)
        assert np.isfinite(m["loss"]) and m["grad_norm"] > 0
    only_text = SFTTrainer(sft_config(), train_rows=text)
    assert np.isfinite(only_text.train_steps(1)[0]["loss"])


def test_image_rows_on_a_text_model_are_refused_with_the_row_named():
    rows = [{"input": "hi", "output": " there"}, SFT_ROWS[0]]
    with pytest.raises(DataError, match=r"train_rows:1: .*1 image\(s\).*text-only.*vision-language"):
        SFTTrainer(sft_config(model={"path": "tiny"}), train_rows=rows)
    pairs = [{"prompt": "<image>Which?", "chosen": " a", "rejected": " b", "images": [image(1)]}]
    with pytest.raises(DataError, match=r"train_rows:0: .*text-only.*vision-language"):
        DPOTrainer(dpo_config(model={"path": "tiny"}, data={"train_batch_size": 1}), train_rows=pairs)


def test_truncation_never_cuts_an_image_and_packing_is_refused():
    long = {"input": "<image>" + " word" * 8, "output": " ok", "images": [image(3, 64)]}
    short = {"data": {"max_prompt_length": 4, "max_response_length": 4}}
    with pytest.raises(DataError, match="more than max_length=8"):
        SFTTrainer(sft_config(**short), train_rows=[long])
    with pytest.raises(DataError, match=r"train_rows:0: .*never cut.*data.truncation=drop"):
        SFTTrainer(sft_config(data={**short["data"], "truncation": "truncate_left"}), train_rows=[long])
    with pytest.raises(DataError, match="no SFT row is usable"):  # dropped, as a long text row is
        SFTTrainer(sft_config(data={**short["data"], "truncation": "drop"}), train_rows=[long])
    # a response cut on the right keeps every image token: allowed (the datasets take truncate_right)
    tok = image_tokens(load_processor(build_tiny_vl_model()))
    ds = SFTDataset([{"input": "<image>Hi", "output": " a b c d e f g h i", "images": [image(3, 28)]}],
                    tok.tokenizer, 8, truncation="truncate_right", images=tok)
    marker = tok.tokenizer.convert_tokens_to_ids(["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"])
    assert ds.stats["truncated"] == 1 and len(ds.items[0][0]) == 8 and ds.items[0][0][:3] == marker
    with pytest.raises(ConfigError, match="sft.packing=false"):
        SFTTrainer(sft_config(sft={"batch_size": 4, "packing": True}), train_rows=SFT_ROWS)


PAIRS = [{"prompt": [{"role": "user", "content": "<image>Which shape?"}], "chosen": f"A circle {i}.",
          "rejected": "No idea.", "images": [image(20 + i)]} for i in range(2)]


def test_dpo_logprobs_and_the_reference_take_the_images(vl):
    model, _, processor = vl
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    seen = []
    ref.register_forward_pre_hook(lambda _m, _a, kw: seen.append("pixel_values" in kw), with_kwargs=True)
    tr = DPOTrainer(dpo_config(actor={"micro_batch_size": 4, "share_prompt_forward": True}), train_rows=PAIRS,
                    ref_model=ref)
    items = [tr.train_data[i] for i in range(2)]
    batch = tr.pair_batch(items)
    assert not batch.share and batch.collated["images"][0] is batch.collated["images"][2]  # shared prompt images
    tr.model.eval()
    with torch.no_grad():
        policy = tr.sequence_logps(tr.model, batch).double()
    reference = tr.reference_logps("train", [0, 1], batch).double()
    assert seen and all(seen)  # every reference forward got the pixels
    for k, row in enumerate(PAIRS):
        for side, col in (("chosen", 0), ("rejected", 1)):
            answer = [{"role": "assistant", "content": row[side]}]
            want_policy, _ = reference_nll(model, processor, row["prompt"], answer, row["images"])
            want_ref, _ = reference_nll(ref, processor, row["prompt"], answer, row["images"])
            assert -float(policy[col * 2 + k]) == pytest.approx(want_policy, abs=1e-4)
            assert -float(reference[k, col]) == pytest.approx(want_ref, abs=1e-4)
    tr.model.train()
    metrics = tr.train_steps(1)[0]
    assert np.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0


def test_reward_model_training_refuses_image_rows():
    pairs = [{"prompt": "Which?", "chosen": " a", "rejected": " b"},
             {"prompt": "<image>Which?", "chosen": " a", "rejected": " b", "images": [image(1)]}]
    cfg = tiny_config(None, "rm", {"model": {"path": "tiny"}, "data": {"train_batch_size": 2}}, {})
    with pytest.raises(DataError, match=r"train_rows:1: the row has images, but a reward model"):
        RMTrainer(cfg, train_rows=pairs)


@pytest.mark.parametrize("prompt", ["<image>Colour?", [{"role": "user", "content": "Colour: <image>?"}]])
def test_sft_prompt_tokens_are_the_rl_samplers(vl, prompt):
    """A warm start trains on the prompt tokens RL then samples from (`PromptCodec.encode_batch`)."""
    _, tokenizer, processor = vl
    row = {"prompt": prompt, "images": [image(4, 64)]}
    prompts = PromptCodec(tokenizer, DataConfig(max_prompt_length=64), processor).encode_batch([row])
    ds = SFTDataset([{"input": prompt, "output": " red", "images": row["images"]}], tokenizer, 96,
                    images=image_tokens(processor))
    ids, labels = ds.items[0]
    boundary = next(i for i, lab in enumerate(labels) if lab != -100)
    assert ids[:boundary] == prompts.ids[0][prompts.mask[0].bool()].tolist()


def test_an_empty_image_is_a_bad_row_not_a_crash(vl):
    empty = PIL.new("RGB", (0, 0))
    with pytest.raises(DataError, match=r"images\[0\] \(PIL\) is an empty image \(0x0\)"):
        SFTDataset([{"input": "<image>?", "output": " a", "images": [empty]}], vl[1], 64, images=image_tokens(vl[2]))
