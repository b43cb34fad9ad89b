"""Datasets and collators: padding sides, chat templates, loss masks, prompt boundaries, truncation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import build_tokenizer

from verl.config import load_config
from verl.data import IGNORE_INDEX, PreferenceDataset, PromptDataset, SFTDataset, load_rows
from verl.errors import ConfigError, DataError, ModelError


def ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def row(**kw) -> dict:
    return {"file": "t.jsonl", "line": 7, **kw}


def test_prompt_left_padding_and_template(tokenizer) -> None:
    rows = [row(prompt="hello world"), row(prompt=[{"role": "user", "content": "hi"}])]
    ds = PromptDataset(rows, tokenizer, max_prompt_length=16)
    batch = ds.collate([ds[0], ds[1]])
    templ = ids(tokenizer, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    plain = ids(tokenizer, "hello world")  # plain strings are not templated under 'auto'
    pad = tokenizer.pad_token_id
    assert batch["input_ids"].tolist() == [[pad] * (len(templ) - len(plain)) + plain, templ]
    assert batch["attention_mask"].tolist() == [
        [0] * (len(templ) - len(plain)) + [1] * len(plain),
        [1] * len(templ),
    ]
    assert batch["position_ids"][0, -len(plain) :].tolist() == list(range(len(plain)))
    assert batch["rows"] == rows


def test_prompt_template_always(tokenizer) -> None:
    ds = PromptDataset([row(prompt="hello")], tokenizer, 16, apply_chat_template="always")
    assert ds[0]["input_ids"] == ids(tokenizer, "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n")
    with pytest.raises(
        DataError, match=r"t.jsonl:7: the prompt is chat messages but apply_chat_template='never'"
    ):
        PromptDataset(
            [row(prompt=[{"role": "user", "content": "hi"}])], tokenizer, 16, apply_chat_template="never"
        )


def test_prompt_truncation_modes(tokenizer) -> None:
    rows = [row(prompt="a b c d e f"), row(prompt="a b")]
    with pytest.raises(DataError, match=r"t.jsonl:7: the prompt has 6 tokens, more than max_prompt_length=4"):
        PromptDataset(rows, tokenizer, 4)
    ds = PromptDataset(rows, tokenizer, 4, truncation="drop")
    assert len(ds) == 1 and ds.dropped == 1
    ds = PromptDataset(rows, tokenizer, 4, truncation="truncate_left")
    assert ds[0]["input_ids"] == ids(tokenizer, "c d e f") and ds.truncated == 1
    with pytest.raises(ConfigError, match="truncation='cut'"):
        PromptDataset(rows, tokenizer, 4, truncation="cut")


def test_no_chat_template_is_model_error() -> None:
    tok = build_tokenizer(chat_template=None)
    with pytest.raises(
        ModelError, match=r"t.jsonl:7: the row has chat messages but the tokenizer has no chat_template"
    ):
        PromptDataset([row(prompt=[{"role": "user", "content": "hi"}])], tok, 16)


def test_sft_plain_masks_only_output_and_eos(tokenizer) -> None:
    ds = SFTDataset(
        [row(input="what is two plus three", output=" five"), row(input="hi", output=" there")],
        tokenizer,
        max_length=32,
    )
    p = ids(tokenizer, "what is two plus three")
    o = ids(tokenizer, "five")
    eos = tokenizer.eos_token_id
    assert ds[0]["input_ids"] == p + o + [eos]
    assert ds[0]["labels"] == [IGNORE_INDEX] * len(p) + o + [eos]
    b = ds.collate([ds[0], ds[1]])
    n1 = len(ds[1]["input_ids"])
    assert b["input_ids"][1, n1:].eq(tokenizer.pad_token_id).all()  # right padding
    assert b["labels"][1, n1:].eq(IGNORE_INDEX).all()
    assert b["attention_mask"].sum(-1).tolist() == [len(ds[0]["input_ids"]), n1]


def test_sft_messages_mask_every_assistant_turn(tokenizer) -> None:
    msgs = [
        {"role": "system", "content": "ok"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello there"},
        {"role": "user", "content": "why"},
        {"role": "assistant", "content": "because"},
    ]
    ds = SFTDataset([row(messages=msgs)], tokenizer, max_length=64)
    item = ds[0]
    text = tokenizer.apply_chat_template(msgs, tokenize=False)
    assert item["input_ids"] == ids(tokenizer, text)
    learned = [t for t, lab in zip(item["input_ids"], item["labels"], strict=False) if lab != IGNORE_INDEX]
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert learned == ids(tokenizer, "hello there") + [im_end] + ids(tokenizer, "because") + [im_end]
    assert ds.stats["boundary_mismatch"] == 0


def test_sft_input_output_messages_form(tokenizer) -> None:
    ds = SFTDataset([row(input=[{"role": "user", "content": "hi"}], output="hello")], tokenizer, 32)
    learned = [t for t, lab in zip(ds[0]["input_ids"], ds[0]["labels"], strict=False) if lab != IGNORE_INDEX]
    assert learned == ids(tokenizer, "hello") + [tokenizer.convert_tokens_to_ids("<|im_end|>")]


def test_sft_truncation_and_no_loss_rows(tokenizer) -> None:
    rows = [row(input="a b c d e f", output=" yes"), row(input="a", output=" no")]
    with pytest.raises(DataError, match=r"t.jsonl:7: the sequence has 8 tokens, more than max_length=5") as info:
        SFTDataset(rows, tokenizer, 5)
    # the fix names config keys and values that `data.truncation` accepts
    assert "data.max_prompt_length + data.max_response_length" in str(info.value)
    assert "set data.truncation to drop or truncate_left" in str(info.value)
    for value in ("drop", "truncate_left"):
        load_config(overrides=[f"data.truncation={value}"])
    ds = SFTDataset(rows, tokenizer, 5, truncation="drop")
    assert len(ds) == 1 and ds.stats["dropped"] == 1
    ds = SFTDataset(rows, tokenizer, 5, truncation="truncate_left")
    assert len(ds[0]["input_ids"]) == 5 and ds[0]["labels"][-2:] == ids(tokenizer, "yes") + [
        tokenizer.eos_token_id
    ]
    ds = SFTDataset(rows, tokenizer, 5, truncation="truncate_right")  # cuts the whole output of row 1
    assert ds.stats["no_loss_tokens"] == 1 and len(ds) == 1


def test_preference_boundary_and_labels(tokenizer) -> None:
    ds = PreferenceDataset([row(prompt="tell me", chosen=" yes good", rejected=" no")], tokenizer, 32)
    it = ds[0]
    p = ids(tokenizer, "tell me")
    eos = tokenizer.eos_token_id
    assert it["prompt_input_ids"] == p
    assert it["chosen_input_ids"] == p + ids(tokenizer, "yes good") + [eos]
    assert it["chosen_labels"] == [IGNORE_INDEX] * len(p) + ids(tokenizer, "yes good") + [eos]
    assert it["rejected_labels"] == [IGNORE_INDEX] * len(p) + ids(tokenizer, "no") + [eos]
    assert ds.boundary_mismatch == 0
    b = ds.collate([ds[0], ds[0]])
    assert b["chosen_input_ids"].shape == (2, len(it["chosen_input_ids"]))
    assert torch.equal(b["prompt_input_ids"][0], torch.tensor(p))


def test_preference_messages_and_mismatch(tokenizer) -> None:
    msgs = [{"role": "user", "content": "hi"}]
    ds = PreferenceDataset(
        [row(prompt=msgs, chosen="hello", rejected=[{"role": "assistant", "content": "bad"}])], tokenizer, 64
    )
    gen = ids(tokenizer, tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True))
    assert ds[0]["prompt_input_ids"] == gen
    assert ds[0]["chosen_input_ids"][: len(gen)] == gen and ds.boundary_mismatch == 0
    # "wor" + "ld" tokenises as "world" together: the prompt's ids are not a prefix of the pair's ids
    ds = PreferenceDataset([row(prompt="hello wor", chosen="ld", rejected=" no")], tokenizer, 32)
    assert ds.boundary_mismatch == 1
    it = ds[0]
    hello = ids(tokenizer, "hello")
    assert it["chosen_input_ids"] == ids(tokenizer, "hello world") + [tokenizer.eos_token_id]
    # boundary from character offsets: the straddling token counts as prompt, so only EOS is learned
    assert it["chosen_labels"] == [IGNORE_INDEX] * (len(hello) + 1) + [tokenizer.eos_token_id]


def test_load_rows_token_stats_and_truncation(tmp_path: Path, tokenizer) -> None:
    p = tmp_path / "a.jsonl"
    lines = ["a", "a b", "a b c", "a b c d", "a b c d e f g h"]
    p.write_text("".join(json.dumps({"prompt": x}) + "\n" for x in lines))
    with pytest.raises(
        DataError, match=r"1 rows have prompts longer than max_prompt_length=4 \(data.truncation=error\)"
    ):
        load_rows(p, "prompt", tokenizer=tokenizer, max_prompt_length=4)
    rows, rep = load_rows(p, "prompt", tokenizer=tokenizer, max_prompt_length=4, truncation="drop")
    assert len(rows) == 4 and rep.reasons["too_long"].examples[0]["line"] == 5
    ts = rep.token_stats
    assert (ts.min, ts.median, ts.p95, ts.max, ts.over_limit, ts.dropped) == (1, 3.0, 8, 8, 1, 1)
    rows, rep = load_rows(p, "prompt", tokenizer=tokenizer, max_prompt_length=4, truncation="truncate_left")
    assert len(rows) == 5 and rep.token_stats.truncated == 1 and rep.is_clean
