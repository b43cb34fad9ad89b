"""The tiny vision-language model, its loading with a processor, and the helpers the sampler and trainer use:
processor inputs, the vision tower, and multimodal rotary positions equal to what `generate` uses."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from verl.errors import ConfigError, DataError, ModelError
from verl.models.hf_loader import load_hf_model, load_hf_model_with_report
from verl.models.tiny import build_from_spec, build_tiny_model, is_tiny_spec
from verl.models.tiny_vl import IMAGE_PAD, VISION_TOKENS, build_tiny_vl_model
from verl.models.vision import (
    batch_processor_inputs,
    cat_image_rows,
    count_vision_parameters,
    is_vision_language,
    load_processor,
    mrope_decode_position_ids,
    mrope_position_ids,
    num_image_tokens,
    processor_inputs,
    render_vision_prompt,
    set_vision_trainable,
    split_images_by_row,
    vision_messages,
    vision_parameter_names,
    vision_token_ids,
    vision_tower,
)

PIL = pytest.importorskip("PIL.Image")


def image(size: int, seed: int):
    rng = np.random.default_rng(seed)
    return PIL.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def vl_path() -> str:
    return build_tiny_vl_model()


@pytest.fixture(scope="module")
def vl(vl_path):
    """(model, tokenizer, processor) in float32 on the CPU, eval mode."""
    return load_hf_model(vl_path, torch_dtype="fp32", device="cpu", for_training=False, return_processor=True)


# ------------------------------------------------------------------------------------------------- the build


def test_tiny_vl_builds_offline_once_and_is_cached(vl_path, tmp_path: Path):
    folder = Path(vl_path)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "preprocessor_config.json",
                 "processor_config.json", "chat_template.jinja", "verl_tiny.json"):
        assert (folder / name).is_file(), name
    start = time.perf_counter()
    assert build_tiny_vl_model() == vl_path
    assert build_from_spec("tiny:qwen2_5_vl") == vl_path
    assert time.perf_counter() - start < 0.5  # the cache, not a rebuild
    assert is_tiny_spec("tiny:qwen2_5_vl")
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "qwen2_5_vl"
    assert config["vision_config"]["patch_size"] == 14 and config["vision_config"]["spatial_merge_size"] == 2
    assert config["text_config"]["hidden_size"] == 64


def test_tiny_qwen2_vl_is_the_older_architecture():
    path = build_from_spec("tiny:qwen2_vl")
    assert json.loads((Path(path) / "config.json").read_text())["model_type"] == "qwen2_vl"
    assert type(load_processor(path)).__name__.startswith("Qwen2VLProcessor")


def test_spec_refuses_a_vision_reward_model_or_variant():
    with pytest.raises(ConfigError, match="no reward head"):
        build_from_spec("tiny:qwen2_5_vl", reward=True)
    with pytest.raises(ConfigError, match="takes no variant"):
        build_from_spec("tiny:qwen2_5_vl:64:2:tools")


def test_the_processor_loads_offline_and_expands_image_pads(vl_path):
    processor = load_processor(vl_path)
    try:
        import torchvision  # noqa: F401
    except ImportError:  # transformers builds the video processor with every Qwen-VL processor: torchvision
        from transformers import AutoProcessor

        with pytest.raises(ImportError, match="orchvision"):
            AutoProcessor.from_pretrained(vl_path)
        assert type(processor).__name__ == "Qwen2_5_VLProcessorImageOnly"
    tokenizer = processor.tokenizer
    for token in VISION_TOKENS:  # single ids that survive the reload
        assert len(tokenizer.encode(token, add_special_tokens=False)) == 1
    assert [num_image_tokens(processor, s, s) for s in (28, 56, 64)] == [1, 4, 4]
    inputs = processor_inputs(processor, [image(64, 0)], "What is 12+7?")
    ids = inputs["input_ids"][0].tolist()
    assert ids.count(processor.image_token_id) == 4
    assert inputs["pixel_values"].shape == (16, 3 * 2 * 14 * 14)
    assert inputs["image_grid_thw"].tolist() == [[1, 4, 4]]
    text = tokenizer.decode(ids)
    assert text.endswith("<|im_start|>assistant\n")
    assert "<|vision_start|>" + IMAGE_PAD * 4 + "<|vision_end|>What is 12+7?" in text


# --------------------------------------------------------------------------------------------- prompt shapes


def test_image_placeholders_become_image_parts():
    msgs = vision_messages([{"role": "user", "content": "Look <image> then <image>."}], 2)
    assert msgs[0]["content"] == [{"type": "text", "text": "Look "}, {"type": "image"},
                                  {"type": "text", "text": " then "}, {"type": "image"}, {"type": "text", "text": "."}]
    first = vision_messages("Count them.", 2)
    assert first[0]["content"][:2] == [{"type": "image"}, {"type": "image"}]
    with pytest.raises(DataError, match=r"row 3: 1 image placeholder.*but 2 image"):
        vision_messages("one <image> only", 2, where="row 3")


def test_plain_text_prompt_without_chat(vl):
    _, _, processor = vl
    text = render_vision_prompt(processor, "A <image> B", 1, chat=False)
    assert text == "A <|vision_start|><|image_pad|><|vision_end|> B"
    with pytest.raises(DataError, match="2 <image> placeholder"):
        render_vision_prompt(processor, "<image><image>", 1, chat=False)


def test_split_and_cat_image_rows_round_trip(vl):
    _, _, processor = vl
    batch = batch_processor_inputs(processor, [[image(28, 1)], [], [image(64, 2), image(56, 3)]], ["a", "b", "c"])
    rows = split_images_by_row(batch["pixel_values"], batch["image_grid_thw"], [1, 0, 2])
    assert [r[1].shape[0] for r in rows] == [1, 0, 2] and [r[0].shape[0] for r in rows] == [4, 0, 32]
    pixel_values, grid = cat_image_rows(rows)
    assert torch.equal(pixel_values, batch["pixel_values"]) and torch.equal(grid, batch["image_grid_thw"])


# ------------------------------------------------------------------------------------------------ the loader


def test_load_hf_model_returns_model_tokenizer_and_processor(vl, vl_path):
    model, tokenizer, processor = vl
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    assert processor.tokenizer is tokenizer  # one tokenizer object: pad/eos fixes reach the processor too
    report = model.verl_load_report
    assert report.ok and report.processor is processor
    assert "model.visual" in report.vision and "merge_size 2" in report.vision
    assert dict(report.summary_rows())["vision"] == report.vision
    two = load_hf_model(vl_path, torch_dtype="fp32", device="cpu")  # old callers: still a pair
    assert len(two) == 2


def test_text_models_have_no_processor(tiny_path):
    model, _, processor = load_hf_model(tiny_path, torch_dtype="fp32", device="cpu", return_processor=True)
    assert processor is None and model.verl_load_report.vision == ""
    assert not is_vision_language(model) and not is_vision_language(tiny_path)


def test_meta_build_counts_the_vision_tower(vl, vl_path):
    model, _, report = load_hf_model_with_report(vl_path, torch_dtype="fp32", weights=False)
    assert report.ok and next(model.parameters()).device.type == "meta"
    assert count_vision_parameters(model) == count_vision_parameters(vl[0]) > 0
    assert is_vision_language(model) and is_vision_language(model.config) and is_vision_language(vl_path)


# ------------------------------------------------------------------------------------------ the vision tower


def test_freeze_helper_freezes_exactly_the_vision_parameters(vl_path):
    model, _ = load_hf_model(vl_path, torch_dtype="fp32", device="cpu")
    names = vision_parameter_names(model)
    assert vision_tower(model)[0] == "model.visual" and names and all(n.startswith("model.visual.") for n in names)
    held = set_vision_trainable(model, False)
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen == set(names)
    assert held == count_vision_parameters(model) == sum(p.numel() for n, p in model.named_parameters()
                                                          if n in frozen)
    set_vision_trainable(model, True)
    assert all(p.requires_grad for p in model.parameters())


def test_vision_tower_is_found_through_lora(vl_path):
    peft = pytest.importorskip("peft")
    model, _ = load_hf_model(vl_path, torch_dtype="fp32", device="cpu")
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    name, _ = vision_tower(wrapped)
    assert name == "base_model.model.model.visual"
    set_vision_trainable(wrapped, False)
    assert all(not p.requires_grad for n, p in wrapped.named_parameters() if n.startswith(name + "."))


def test_a_text_model_has_no_vision_tower(tiny):
    with pytest.raises(ModelError, match="no vision tower"):
        vision_tower(tiny[0])
    with pytest.raises(ModelError, match="no get_rope_index"):
        mrope_position_ids(tiny[0], torch.zeros(1, 3, dtype=torch.long))


# ------------------------------------------------------------------------------ forward, positions, generate


def _two_rows(processor, seed: int = 0):
    return batch_processor_inputs(
        processor, [[image(56, seed)], [image(64, seed + 1), image(28, seed + 2)]],
        ["What is 12+7?", [{"role": "user", "content": "Compare <image> with <image>."}]])


def test_forward_with_one_and_two_images_depends_on_the_images(vl):
    model, _, processor = vl
    a, b = _two_rows(processor, 0), _two_rows(processor, 10)
    assert torch.equal(a["input_ids"], b["input_ids"])  # same sizes: only the pixels differ
    with torch.no_grad():
        la, lb = model(**a).logits, model(**b).logits
    mask = a["attention_mask"].bool()
    ids = a["input_ids"]
    first_image = (ids == processor.image_token_id).int().argmax(-1)
    for row in range(2):
        text_after = mask[row] & (torch.arange(ids.shape[1]) > first_image[row])
        before = mask[row] & (torch.arange(ids.shape[1]) < first_image[row])
        assert (la[row][text_after] - lb[row][text_after]).abs().max() > 1e-4  # the image reaches the text
        assert torch.allclose(la[row][before], lb[row][before], atol=1e-6)  # causal: nothing before it moves


def test_mrope_positions_are_the_models_own(vl):
    model, _, processor = vl
    batch = _two_rows(processor)
    positions, deltas = mrope_position_ids(model, batch["input_ids"], batch["attention_mask"], batch["image_grid_thw"])
    assert positions.shape == (3,) + tuple(batch["input_ids"].shape) and deltas.shape == (2, 1)
    # row 1: two images of 2x2 and 1x1 merged patches: each takes max(h, w) positions instead of h*w
    real = batch["attention_mask"][1].sum()
    assert deltas[1].item() == positions[:, 1].max().item() + 1 - real.item() == (2 - 4) + (1 - 1)
    with torch.no_grad():
        implicit = model(**batch).logits  # transformers computes them from mm_token_type_ids
        explicit = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                         pixel_values=batch["pixel_values"], image_grid_thw=batch["image_grid_thw"],
                         position_ids=positions).logits
    mask = batch["attention_mask"].bool()
    assert torch.equal(implicit[mask], explicit[mask])


@pytest.mark.slow
def test_prefill_and_cached_decode_with_mrope_match_generate(vl):
    """What our sampler will do: a prefill with pixels and [3, B, T] positions, then one token at a time on the
    KV cache with positions shifted by rope_deltas; greedy tokens and logits equal HF generate's, and a full
    forward of prompt + response with `mrope_position_ids` gives the same logits (the log-prob recompute)."""
    from transformers import DynamicCache

    model, _, processor = vl
    batch = _two_rows(processor)
    banned = sorted(vision_token_ids(model).values())  # a sampler must never emit an image pad
    steps = 6
    out = model.generate(**batch, max_new_tokens=steps, do_sample=False, suppress_tokens=banned,
                         output_logits=True, return_dict_in_generate=True, eos_token_id=None)
    want_tokens = out.sequences[:, batch["input_ids"].shape[1]:]
    want_logits = torch.stack(out.logits, 1)

    ids, mask = batch["input_ids"], batch["attention_mask"]
    positions, deltas = mrope_position_ids(model, ids, mask, batch["image_grid_thw"])
    cache = DynamicCache(config=model.config)
    got_logits, tokens = [], []
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, pixel_values=batch["pixel_values"],
                       image_grid_thw=batch["image_grid_thw"], position_ids=positions, cache=cache,
                       use_cache=True).logits[:, -1]
        for _ in range(steps):
            got_logits.append(logits)  # raw, as generate's output_logits
            token = logits.index_fill(-1, torch.tensor(banned), float("-inf")).argmax(-1, keepdim=True)
            tokens.append(token)
            text_positions = mask.sum(-1, keepdim=True)  # real tokens before the new one
            mask = torch.cat([mask, torch.ones_like(token)], 1)
            step_positions = mrope_decode_position_ids(deltas, text_positions)
            logits = model(input_ids=token, attention_mask=mask, position_ids=step_positions, cache=cache,
                           use_cache=True).logits[:, -1]
    assert torch.equal(torch.cat(tokens, 1), want_tokens)
    assert torch.allclose(torch.stack(got_logits, 1), want_logits, atol=1e-5)

    full = torch.cat([ids, want_tokens], 1)
    full_positions, _ = mrope_position_ids(model, full, mask, batch["image_grid_thw"])
    with torch.no_grad():
        recomputed = model(input_ids=full, attention_mask=mask, pixel_values=batch["pixel_values"],
                           image_grid_thw=batch["image_grid_thw"], position_ids=full_positions).logits
    prompt_len = ids.shape[1]
    assert torch.allclose(recomputed[:, prompt_len - 1:-1], want_logits, atol=1e-5)


# ------------------------------------------------------------------------------------------------- pillow


def test_missing_pillow_is_an_install_hint(monkeypatch):
    from verl.utils.pillow import require_pillow

    monkeypatch.setitem(sys.modules, "PIL", None)
    with pytest.raises(ModelError, match=r"the vision demo needs Pillow.*Fix: pip install pillow \(or, in a verl "
                                         r"checkout: pip install -e '\.\[vision\]'\)"):
        require_pillow("the vision demo")


BLOCK_PIL = """
import importlib.abc, sys
class NoPIL(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "PIL" or name.startswith("PIL."):
            raise ModuleNotFoundError("No module named 'PIL'", name="PIL")
sys.meta_path.insert(0, NoPIL())
"""


@pytest.mark.slow
def test_without_pillow_verl_imports_and_a_vl_load_says_how_to_install_it(vl_path):
    code = BLOCK_PIL + f"""
import verl, verl.models.vision, verl.models.hf_loader
from verl.errors import ModelError
from verl.models.vision import is_vision_language
assert is_vision_language({vl_path!r})
try:
    verl.models.hf_loader.load_hf_model({vl_path!r}, torch_dtype="fp32")
except ModelError as e:
    assert "needs Pillow" in str(e) and "pip install pillow" in str(e), e
else:
    raise SystemExit("no error")
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_text_tiny_models_are_unchanged():
    # the VL builder reuses tiny.py's pipeline: the text models' cache keys (and files) must not move
    assert Path(build_tiny_model()).name.startswith("causal_lm-qwen2-instruct-h64-l2-s0-")
