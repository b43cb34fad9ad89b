"""The image-token checks catch each bad combination of a vision-language model, tokenizer and processor, with a
message that says what is wrong, where and the fix; `load_hf_model` raises them as one ModelError."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest

from verl.errors import ModelError, VerlError
from verl.models.hf_loader import load_hf_model, load_hf_model_with_report
from verl.models.tiny import build_tiny_model
from verl.models.tiny_vl import build_tiny_vl_model
from verl.models.vision import load_processor
from verl.models.vision_checks import check_vision_model, vision_problems

pytest.importorskip("PIL")


@pytest.fixture(scope="module")
def vl_path() -> str:
    return build_tiny_vl_model()


@pytest.fixture(scope="module")
def vl(vl_path):
    return load_hf_model(vl_path, torch_dtype="fp32", device="cpu", for_training=False, return_processor=True)


def test_the_tiny_vl_model_passes(vl):
    model, tokenizer, processor = vl
    assert vision_problems(model, tokenizer, processor) == []
    check_vision_model(model, tokenizer, processor)  # no raise


def test_a_text_model_has_nothing_to_check(tiny):
    assert vision_problems(tiny[0], tiny[1], None) == []


def test_a_processor_from_another_model(vl):
    model, tokenizer, _ = vl
    other = load_processor(build_tiny_vl_model(vocab_size=800, patch_size=7))
    problems = vision_problems(model, tokenizer, other, where="(here)")
    text = "\n".join(problems)
    assert "the tokenizer inside the processor is not the model's tokenizer (here) (800 vs 768 tokens" in text
    assert "patch_size=7 but the vision tower's config has patch_size=14 (here)" in text
    assert all("Fix:" in p for p in problems)


def test_a_tokenizer_without_the_image_pad(vl):
    model, _, processor = vl
    text_tokenizer = load_hf_model(build_tiny_model(), torch_dtype="fp32")[1]
    problems = vision_problems(model, text_tokenizer, None, where="(here)", tokenizer_key="model.tokenizer_path")
    assert problems[0].startswith("the tokenizer has no single token for '<|image_pad|>' (image_token_id=")
    assert "(here)" in problems[0] and "drop model.tokenizer_path" in problems[0]
    assert any("chat template cannot render an image part" in p for p in problems)  # ChatML: string content only


def test_a_mismatched_image_token_id(vl):
    model, tokenizer, processor = vl
    config = copy.deepcopy(model.config)
    config.image_token_id = config.video_token_id
    problems = vision_problems(config, tokenizer, processor, where="(here)")
    assert any(f"config image_token_id={config.video_token_id} but the tokenizer encodes '<|image_pad|>' as "
               f"{model.config.image_token_id} (here)" in p for p in problems)
    assert any("expands images into token '<|image_pad|>'" in p for p in problems)


def test_a_mismatched_merge_size(vl):
    model, tokenizer, processor = vl
    bad = copy.copy(processor)
    bad.image_processor = copy.deepcopy(processor.image_processor)
    bad.image_processor.merge_size = 1
    problems = vision_problems(model, tokenizer, bad, where="(here)")
    assert len(problems) == 1
    assert "merge_size=1 but the vision tower's config has spatial_merge_size=2 (here)" in problems[0]
    assert "set merge_size=2 in preprocessor_config.json" in problems[0]


def test_a_tokenizer_is_not_a_processor(vl):
    model, tokenizer, _ = vl
    problems = vision_problems(model, tokenizer, tokenizer)
    assert len(problems) == 1 and "is not a vision-language processor" in problems[0]


def test_check_vision_model_raises_a_verl_error(vl):
    model, tokenizer, processor = vl
    config = copy.deepcopy(model.config)
    config.vision_config.patch_size = 16
    with pytest.raises(ModelError, match=r"(?s)failed 1 load-time check.*patch_size=14 but the vision tower's "
                                         r"config has patch_size=16") as info:
        check_vision_model(config, tokenizer, processor, source="m")
    assert isinstance(info.value, VerlError)


def _edited(src: str, dst: Path, file: str, **changes) -> str:
    shutil.copytree(src, dst)
    data = json.loads((dst / file).read_text())
    data.update(changes)
    (dst / file).write_text(json.dumps(data))
    return str(dst)


def test_the_loader_refuses_a_folder_with_a_wrong_image_token_id(vl_path, tmp_path: Path):
    config = json.loads((Path(vl_path) / "config.json").read_text())
    folder = _edited(vl_path, tmp_path / "m", "config.json", image_token_id=config["vision_start_token_id"])
    with pytest.raises(ModelError, match=rf"config image_token_id={config['vision_start_token_id']} but the "
                                         rf"tokenizer encodes '<\|image_pad\|>' as {config['image_token_id']}"):
        load_hf_model(folder, torch_dtype="fp32")


def test_the_loader_refuses_a_folder_with_a_wrong_merge_size(vl_path, tmp_path: Path):
    folder = _edited(vl_path, tmp_path / "m", "preprocessor_config.json", merge_size=4)
    _, _, report = load_hf_model_with_report(folder, torch_dtype="fp32", weights=False)
    assert len(report.problems) == 1
    assert f"the image processor inside the processor loaded from {folder} has merge_size=4" in report.problems[0]
    assert report.processor is not None  # the report still carries what was loaded, for `verl check`


def test_the_loader_names_a_substitute_tokenizer(vl_path):
    text = build_tiny_model()
    _, _, report = load_hf_model_with_report(vl_path, tokenizer_name=text, torch_dtype="fp32", weights=False)
    joined = "\n".join(report.problems)
    assert f"(model {vl_path}, tokenizer {text})" in joined
    assert "the tokenizer has no single token for '<|image_pad|>'" in joined
    assert f"the tokenizer inside the processor loaded from {vl_path} is not the model's tokenizer" in joined
