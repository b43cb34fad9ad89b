"""The vLLM engine with image prompts, against a multimodal stand-in `vllm.LLM`.

The engine sends each row with images in vLLM's multimodal format (the ids with one image pad per image, and the
row's PIL images); the stand-in does what vLLM does with it: runs the model's image processor on the images,
expands each single pad into the image's tokens (refusing a prompt whose pads do not match its images), and
samples with the real tiny vision-language model's forward on the pixels (transformers' own multimodal
positions), applying the request's logit bias as vLLM's logits processors do. So the engine's tokens can be
compared with our own sampler's and `generate`'s, and its log-probs with the trainer's recompute over the
expanded ids that the batch keeps."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from tiny_support import tiny_config

from verl.config.schema import DataConfig
from verl.data.images import load_images
from verl.errors import DataError, ModelError
from verl.models.hf_loader import load_hf_model
from verl.models.tiny_vl import build_tiny_vl_model
from verl.models.vision import batch_processor_inputs, load_processor, vision_token_ids
from verl.models.vision_inputs import RowImages
from verl.rollout import HFKVCacheEngine, SamplingParams, VLLMEngine, build_engine
from verl.rollout.prompts import PromptCodec
from verl.rollout.vllm_images import UNSAMPLED_LOGIT_BIAS, VisionTokens, pad_runs
from verl.rollout.weight_sync import policy_weights
from verl.trainer.forward.logprobs import response_logprobs
from verl.utils.positions import position_ids_from_mask

from .test_vllm_sync import StandInLLM, draw, stand_in_vllm  # noqa: F401 - the fixture

PIL = pytest.importorskip("PIL.Image")


class StandInVLLM(StandInLLM):
    """`vllm.LLM` for a vision-language model: a prompt's `multi_modal_data["image"]` goes through the model's
    image processor, and each single image pad of `prompt_token_ids` becomes the image's pad tokens (vLLM's
    prompt update for Qwen-VL); the count of pads must be the count of images, as vLLM requires."""

    @staticmethod
    def load_model(model: str) -> torch.nn.Module:
        from transformers import AutoModelForImageTextToText

        return AutoModelForImageTextToText.from_pretrained(model, dtype=torch.float32).eval()

    def __init__(self, model: str, **kwargs):
        super().__init__(model, **kwargs)
        self.processor = load_processor(model)
        self.pad = int(self.weights.config.image_token_id)
        self.merge = int(self.weights.config.vision_config.spatial_merge_size)
        self.seen_prompts: list[list[dict]] = []

    def expand(self, prompt: dict) -> tuple[list[int], dict]:
        """(the prompt's ids with each image's pads expanded, the forward's image inputs) as vLLM processes it."""
        tokens = list(prompt["prompt_token_ids"])
        data = dict(prompt.get("multi_modal_data") or {})
        if set(data) - {"image"}:
            raise ValueError(f"stand-in vLLM: modalities {sorted(data)}; this model takes 'image'")
        if "image" not in data:
            return tokens, {}
        images = data["image"] if isinstance(data["image"], list) else [data["image"]]
        out = self.processor.image_processor(images=images, return_tensors="pt")
        sizes = iter((out["image_grid_thw"].prod(-1) // self.merge**2).tolist())
        found = tokens.count(self.pad)
        if found != len(images):
            raise ValueError(f"Expected there to be {len(images)} prompt updates corresponding to {len(images)} "
                             f"image items, but instead found {found} prompt updates!")
        expanded = [t for token in tokens for t in ([self.pad] * next(sizes) if token == self.pad else [token])]
        return expanded, {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}

    def generate(self, prompts, sampling_params=None, *, use_tqdm: bool = True):
        assert not self.sleeping and self.kv_cache, "generate() on a sleeping engine"
        self.log.append("generate")
        per_prompt = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        assert len(per_prompt) == len(prompts), "vLLM: one SamplingParams, or one per prompt"
        self.seen_params.append(per_prompt)
        self.seen_prompts.append(list(prompts))
        expanded = [self.expand(p) for p in prompts]  # vLLM processes every prompt before it schedules any
        results = []
        for (ids, images), params in zip(expanded, per_prompt, strict=True):
            outputs = []
            for j in range(params.n):
                seed = params.seed + j if params.seed is not None else self.seed_rng.getrandbits(63)
                tokens, logprobs = self._sample(ids, images, params, seed)
                entries = [{t: SimpleNamespace(logprob=lp)} for t, lp in zip(tokens, logprobs, strict=True)]
                outputs.append(SimpleNamespace(token_ids=tokens, logprobs=entries))
            results.append(SimpleNamespace(prompt_token_ids=ids, outputs=outputs))
        return results

    def _sample(self, ids: list[int], images: dict, params, seed: int) -> tuple[list[int], list[float]]:
        """One completion, a whole forward per token (no cache), with transformers' own multimodal positions."""
        tokens: list[int] = []
        logprobs: list[float] = []
        for step in range(params.max_tokens):
            full = torch.tensor([ids + tokens])
            with torch.no_grad():
                logits = self.weights(input_ids=full, mm_token_type_ids=(full == self.pad).int(),
                                      **images).logits[0, -1].float()
            tok, lp = draw(logits, params, seed, len(ids) + step,
                           processed=self.logprobs_mode == "processed_logprobs")
            tokens.append(tok)
            logprobs.append(lp)
            if tok in params.stop_token_ids:
                break
        return tokens, logprobs


@pytest.fixture
def stand_in_vl_vllm(request, monkeypatch):
    """The stand-in `vllm` module of test_vllm_sync.py, its `LLM` the multimodal one."""
    module = request.getfixturevalue("stand_in_vllm")
    monkeypatch.setattr(module, "LLM", StandInVLLM)
    return module


def image(size: int, seed: int):
    return PIL.fromarray(np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8))


# an image row, a text row, a row with two images (4, then 1 and 4 image tokens)
ROWS = [{"prompt": "<image>How many?", "images": [image(56, 0)]}, {"prompt": "What is 2+2?"},
        {"prompt": "<image> or <image>?", "images": [image(28, 1), image(64, 2)]}]


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen2_vl"])
def vl(request):
    """A tiny VL model's folder and the model in float32 with its weights spread (seeded), so that tokens depend
    on the images; the engine is pushed these weights, as the trainer pushes the policy's."""
    path = build_tiny_vl_model(arch=request.param)
    model, tokenizer, processor = load_hf_model(path, torch_dtype="fp32", device="cpu", for_training=False,
                                                return_processor=True)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.2)
    return path, model.eval(), tokenizer, processor


def encoded(vl, rows=ROWS, keep_pictures=True):
    _, _, tokenizer, processor = vl
    codec = PromptCodec(tokenizer, DataConfig(max_prompt_length=64), processor, keep_pictures=keep_pictures)
    return codec.encode_batch(rows)


def engine_for(vl) -> VLLMEngine:
    path, model, _, _ = vl
    engine = build_engine("vllm", model)  # the trainer's way: the path, and the loaded model's config
    assert engine.model_path == path and isinstance(engine.llm, StandInVLLM)
    engine.load_policy_weights(policy_weights(model))
    return engine


def test_vllm_with_images_samples_what_our_sampler_and_generate_do(vl, stand_in_vl_vllm):
    """Greedy, a batch of an image row, a text row and a two-image row: vLLM's tokens are our sampler's and
    `generate`'s on the same images; vLLM got one pad per image and the images, the output keeps the expanded ids."""
    _, model, tokenizer, processor = vl
    ids, mask, images = encoded(vl)
    assert images[1] is None and [len(images[0].pictures), len(images[2].pictures)] == [1, 2]
    engine = engine_for(vl)
    params = SamplingParams(temperature=0, max_new_tokens=8)
    out = engine.generate(ids, mask, params, images=images)
    ours = HFKVCacheEngine(model).generate(ids, mask, params, images=images)
    assert torch.equal(out.response_ids, ours.response_ids)
    banned = sorted(vision_token_ids(model).values())
    inputs = batch_processor_inputs(processor, [load_images(r) for r in ROWS], [r["prompt"] for r in ROWS],
                                    chat=False)
    want = model.generate(**inputs, max_new_tokens=8, do_sample=False, suppress_tokens=banned, eos_token_id=None,
                          pad_token_id=tokenizer.pad_token_id)[:, ids.shape[1]:]
    assert torch.equal(out.response_ids, want)
    assert len({tuple(r) for r in want.tolist()}) > 1  # the rows differ: the images reach the tokens

    assert torch.equal(out.prompt_ids, ids) and torch.equal(out.prompt_mask, mask)  # the expanded ids, kept
    sent = engine.llm.seen_prompts[-1]
    pad = model.config.image_token_id
    assert [p["prompt_token_ids"].count(pad) for p in sent] == [1, 0, 2]
    assert [len(p.get("multi_modal_data", {}).get("image", [])) for p in sent] == [1, 0, 2]
    assert sent[2]["multi_modal_data"]["image"] == list(images[2].pictures)
    expanded = [engine.llm.expand(p)[0] for p in sent]  # what vLLM re-expands is exactly our prompt
    assert expanded == [row[m.bool()].tolist() for row, m in zip(ids, mask, strict=True)]
    (sampling,) = {id(p): p for p in engine.llm.seen_params[-1]}.values()
    assert sampling.logit_bias == dict.fromkeys(banned, UNSAMPLED_LOGIT_BIAS)


def test_vllm_log_probs_with_images_equal_the_trainers_recompute_over_the_expanded_ids(vl, stand_in_vl_vllm):
    """Sampled (n=2, temperature 0.8): the engine's processed log-probs are the trainer's recompute over the output's
    (expanded) prompt ids with each row's pixels, and no response holds a vision token."""
    _, model, _, _ = vl
    ids, mask, images = encoded(vl)
    engine = engine_for(vl)
    steps = 6
    out = engine.generate(ids, mask, SamplingParams(temperature=0.8, max_new_tokens=steps, n=2), images=images)
    rows = [i for i in images for _ in range(2)]
    full = torch.cat([out.prompt_ids, out.response_ids], 1)
    attention = torch.cat([out.prompt_mask, out.response_mask], 1)
    with torch.no_grad():
        recomputed, _ = response_logprobs(model, full, attention, position_ids_from_mask(attention), steps,
                                          images=rows, temperature=0.8)
    real = out.response_mask.bool()
    assert torch.allclose(out.logprobs[real], recomputed[real].float(), atol=1e-5)
    assert not torch.isin(out.response_ids, torch.tensor(sorted(vision_token_ids(model).values()))).any()


def test_a_vision_language_policy_on_vllm_bans_vision_tokens_for_text_rows_too(vl, stand_in_vl_vllm):
    ids, mask, images = encoded(vl, rows=[ROWS[1]])
    assert images == [None]
    engine = engine_for(vl)
    engine.generate(ids, mask, SamplingParams(temperature=0, max_new_tokens=2))
    (prompt,) = engine.llm.seen_prompts[-1]
    assert "multi_modal_data" not in prompt and engine.llm.seen_params[-1][0].logit_bias


def _with(ids: torch.Tensor, row: int, tokens: list[int]) -> torch.Tensor:
    """`ids` with row `row`'s last len(tokens) ids replaced (the prompts are left-padded)."""
    out = ids.clone()
    out[row, -len(tokens):] = torch.tensor(tokens)
    return out


def test_prompts_whose_image_pads_do_not_match_their_images_are_refused_naming_the_row(vl, stand_in_vl_vllm):
    _, model, _, _ = vl
    ids, mask, images = encoded(vl)
    engine = engine_for(vl)
    pad, text = model.config.image_token_id, 100
    params = SamplingParams(temperature=0, max_new_tokens=2)
    row2 = ids[2][mask[2].bool()].tolist()
    calls = engine.llm.log.count("generate")
    bad = {
        "no pads": (_with(ids, 0, [text if t == pad else t for t in ids[0][mask[0].bool()].tolist()]),
                    r"prompt row 0: .* 0 run\(s\) of lengths \[\].*1 image\(s\) take runs of \[4\]"),
        "an extra pad": (_with(ids, 0, [pad]), r"prompt row 0: .* 2 run\(s\) of lengths \[4, 1\]"),
        "a run cut short": (_with(ids, 2, [text if k == row2.index(pad) else t for k, t in enumerate(row2)]),
                            r"prompt row 2: .* lengths \[4\].*take runs of \[1, 4\]"),
        "a pad in a text row": (_with(ids, 1, [pad]), r"prompt row 1: 1 image pad token\(s\) .* but no image"),
    }
    for what, (bad_ids, message) in bad.items():
        with pytest.raises(DataError, match=message):
            engine.generate(bad_ids, mask, params, images=images)
        assert engine.llm.log.count("generate") == calls, what  # refused before vLLM ran
    with pytest.raises(DataError, match=r"prompt row 0: .*pictures is None.*keep_pictures=True"):
        engine.generate(ids, mask, params, images=encoded(vl, keep_pictures=False).images)
    lost = RowImages(images[2].pixel_values, images[2].image_grid_thw, images[2].pictures[:1])
    with pytest.raises(DataError, match=r"prompt row 2: 1 kept image\(s\) but 2"):
        engine.generate(ids, mask, params, images=[images[0], None, lost])
    with pytest.raises(DataError, match=r"2 rows of images for 3 prompts"):
        engine.generate(ids, mask, params, images=images[:2])
    # and vLLM itself: the expanded pads sent as they are would be one image per pad, not per image
    expanded = {"prompt_token_ids": ids[0][mask[0].bool()].tolist(),
                "multi_modal_data": {"image": list(images[0].pictures)}}
    with pytest.raises(ValueError, match="1 image items, but instead found 4 prompt updates"):
        engine.llm.generate([expanded], engine._vllm_params(params, None))


@pytest.mark.usefixtures("stand_in_vllm")
def test_images_for_a_text_policy_on_vllm_are_a_model_error(vl):
    from verl.models.tiny import build_tiny_model

    ids, mask, images = encoded(vl)
    engine = VLLMEngine(build_tiny_model())
    assert engine.vision is None
    with pytest.raises(ModelError, match=r"prompts with images.*vision-language model"):
        engine.generate(ids, mask, SamplingParams(max_new_tokens=2), images=images)


def test_pad_runs_and_the_vision_tokens_read_from_the_config(vl):
    assert pad_runs([5, 9, 9, 9, 6, 9, 7, 9, 9], 9) == ([5, 9, 6, 9, 7, 9], [3, 1, 2])
    assert pad_runs([], 9) == ([], []) and pad_runs([1, 2], 9) == ([1, 2], [])
    path, model, _, _ = vl
    from_object = VisionTokens.of(model.config)
    from_folder = VisionTokens.of(VLLMEngine.__init__.__globals__["_model_config"](path))  # a dict: config.json
    assert from_object == from_folder and from_object.image_token_id == model.config.image_token_id
    assert from_object.merge_size == 2 and set(from_object.unsampled) == set(vision_token_ids(model).values())
    assert VisionTokens.of({"model_type": "qwen2"}) is None and VisionTokens.of(None) is None
    # a model without Qwen's spatial merge: its pad runs are matched to its images by count only
    unmerged = VisionTokens.of({"vision_config": {}, "image_token_index": 7})
    assert (unmerged.image_token_id, unmerged.merge_size) == (7, None)
    two = RowImages(torch.zeros(8, 4), torch.tensor([[1, 2, 2], [1, 2, 2]]))
    assert unmerged.runs_match([3, 5], two)[0] and not unmerged.runs_match([3], two)[0]
    assert from_object.runs_match([1, 1], two) == (True, "runs of [1, 1]")


def test_rl_steps_on_vllm_with_image_rows(tmp_path, stand_in_vl_vllm):
    """rollout.engine=vllm on a vision-language policy, image and text rows: every rollout is pushed the updated
    weights and samples the rows' images in vLLM's format, and its log-probs are the policy's (the on-policy
    guard's drift stays at rounding) at every step."""
    from rl_support import read_metrics

    from verl.trainer.rl_trainer import RLTrainer

    rows = [{"prompt": f"<image>Colour {i}?", "images": [image(56, i)], "ground_truth": str(i % 2)}
            for i in range(3)] + [{"prompt": "Colour?", "ground_truth": "1"}]
    config = tiny_config(tmp_path, "rl", {"model": {"path": "tiny:qwen2_5_vl"},
                                          "data": {"train_batch_size": 2, "max_prompt_length": 64},
                                          "rollout": {"engine": "vllm", "n": 2, "max_new_tokens": 4,
                                                      "temperature": 0.7},
                                          "actor": {"micro_batch_size": 4, "lr": 5e-2},
                                          "trainer": {"total_steps": 3}})

    def odd_length(prompt, response, ground_truth, **kw):
        return float(len(response) % 2)

    trainer = RLTrainer(config, rows=rows, reward_functions=[odd_length])
    assert trainer.engine.vision is not None and trainer.prompts.keep_pictures
    trainer.fit()
    llm = trainer.engine.llm
    assert llm.log.count("load_weights") == llm.log.count("generate") == 3
    sent = [p for call in llm.seen_prompts for p in call]
    pad = trainer.model.config.image_token_id
    with_images = [p for p in sent if "multi_modal_data" in p]
    assert with_images and all(p["prompt_token_ids"].count(pad) == 1 for p in with_images)
    for row in read_metrics(tmp_path):
        assert row["rollout/logprob_diff_max"] < 1e-4
