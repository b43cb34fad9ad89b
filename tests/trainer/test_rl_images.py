"""RL on prompts with images (a vision-language policy): our sampler's prefill with pixels and multimodal
positions equals `generate` and a forward pass; the rows carry their images through a step; what cannot take
images yet is refused before any model loads."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_support import tiny_config

from verl.config.schema import DataConfig
from verl.data.images import load_images
from verl.errors import ConfigError, DataError, ModelError
from verl.models.hf_loader import load_hf_model
from verl.models.tiny import build_from_spec
from verl.models.tiny_vl import build_tiny_vl_model
from verl.models.vision import batch_processor_inputs, vision_token_ids
from verl.rollout import HFKVCacheEngine, SamplingParams
from verl.rollout.prompts import PromptCodec
from verl.trainer.checks.image_checks import check_images
from verl.trainer.forward.logprobs import response_logprobs
from verl.utils.positions import position_ids_from_mask

PIL = pytest.importorskip("PIL.Image")


def image(size: int, seed: int):
    return PIL.fromarray(np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8))


def odd_length(prompt, response, ground_truth, **kw):  # varies within a group: every group has a signal
    return float(len(response) % 2)


ROWS = [{"prompt": "<image>How many?", "images": [image(56, 0)]}, {"prompt": "What is 2+2?"},
        {"prompt": "<image> or <image>?", "images": [image(28, 1), image(64, 2)]}]


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen2_vl"])
def vl(request):
    """A tiny VL model in float32 with its weights spread (seeded), so that tokens depend on the images."""
    model, tokenizer, processor = load_hf_model(build_tiny_vl_model(arch=request.param), torch_dtype="fp32",
                                                device="cpu", for_training=False, return_processor=True)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.2)
    return model.eval(), tokenizer, processor


def encoded(vl, rows=ROWS):
    _, tokenizer, processor = vl
    return PromptCodec(tokenizer, DataConfig(max_prompt_length=64), processor).encode_batch(rows)


def test_the_sampler_with_images_equals_generate_and_a_forward(vl):
    model, tokenizer, processor = vl
    ids, mask, images = encoded(vl)
    assert images[1] is None and images[0].count == 1 and images[2].count == 2
    engine = HFKVCacheEngine(model)
    banned = sorted(vision_token_ids(model).values())
    steps = 8
    greedy = engine.generate(ids, mask, SamplingParams(temperature=0, max_new_tokens=steps), images=images)
    inputs = batch_processor_inputs(processor, [load_images(r) for r in ROWS], [r["prompt"] for r in ROWS],
                                    chat=False)
    assert torch.equal(inputs["input_ids"], ids)
    want = model.generate(**inputs, max_new_tokens=steps, do_sample=False, suppress_tokens=banned, eos_token_id=None,
                          pad_token_id=tokenizer.pad_token_id)[:, ids.shape[1]:]
    assert torch.equal(greedy.response_ids, want)
    assert len({tuple(r) for r in want.tolist()}) > 1  # the rows differ: the images reach the tokens

    sampled = engine.generate(ids, mask, SamplingParams(temperature=1.0, max_new_tokens=steps, n=2),
                              generator=torch.Generator().manual_seed(3), images=images)
    rows = [i for i in images for _ in range(2)]
    full = torch.cat([sampled.prompt_ids, sampled.response_ids], 1)
    attention = torch.cat([sampled.prompt_mask, sampled.response_mask], 1)
    # independent: transformers' own positions (from the processor's token types) and pixels, all in one forward
    pixels = torch.cat([r.pixel_values for r in rows if r is not None])
    grids = torch.cat([r.image_grid_thw for r in rows if r is not None])
    types = (full == model.config.image_token_id).int()
    with torch.no_grad():
        logits = model(input_ids=full, attention_mask=attention, pixel_values=pixels, image_grid_thw=grids,
                       mm_token_type_ids=types).logits[:, ids.shape[1] - 1:-1].double()
        ours, entropy = response_logprobs(model, full, attention, position_ids_from_mask(attention), steps,
                                          images=rows, with_entropy=True)
        chunked, chunked_entropy = response_logprobs(model, full, attention, position_ids_from_mask(attention), steps,
                                                     images=rows, with_entropy=True, chunked=True)
    assert torch.allclose(chunked, ours, atol=1e-5) and torch.allclose(chunked_entropy, entropy, atol=1e-4)
    assert torch.isfinite(entropy).all()
    full_softmax = logits.log_softmax(-1).gather(-1, sampled.response_ids.unsqueeze(-1)).squeeze(-1)
    # the policy's distribution leaves out the vision tokens (never sampled): the sampler's and the recompute's
    logits[..., banned] = -float("inf")
    reference = logits.log_softmax(-1).gather(-1, sampled.response_ids.unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(ours.double(), reference, atol=1e-5)  # the recompute with images
    assert torch.allclose(sampled.logprobs.double(), reference, atol=1e-5)
    assert not torch.allclose(full_softmax, reference, atol=1e-5)  # (the vision tokens had probability here)
    assert not torch.isin(sampled.response_ids, torch.tensor(banned)).any()


def test_rows_with_images_on_a_text_policy_are_refused_with_the_row():
    model, tokenizer = load_hf_model(build_from_spec("tiny"), torch_dtype="fp32", device="cpu", for_training=False)
    row = {"prompt": "<image>How many?", "images": [image(28, 0)], "file": "data.jsonl", "line": 7}
    with pytest.raises(DataError, match=r"data.jsonl:7.*text only.*vision-language"):
        PromptCodec(tokenizer, DataConfig()).encode_batch([{"prompt": "hi"}, row])
    ids, mask = PromptCodec(tokenizer, DataConfig()).encode([{"prompt": "hi"}])
    with pytest.raises(ModelError, match="not a vision-language model"):
        HFKVCacheEngine(model).generate(ids, mask, SamplingParams(max_new_tokens=2), images=[object()])


def test_a_prompt_longer_than_the_limit_with_its_image_tokens_is_an_error_naming_it(vl):
    _, tokenizer, processor = vl
    row = {"prompt": "<image>How many?", "images": [image(84, 0)], "file": "train.jsonl", "line": 3}
    with pytest.raises(DataError, match=r"train.jsonl:3.*image tokens|train.jsonl:3.*images' tokens"):
        PromptCodec(tokenizer, DataConfig(max_prompt_length=8), processor).encode_batch([row])


def test_rl_steps_carry_each_rows_images_and_train_the_vision_tower(tmp_path):
    from verl.models.vision import vision_parameter_names
    from verl.trainer.rl_trainer import RLTrainer

    rows = [{"prompt": f"<image>Colour {i}?", "images": [image(56, i)], "ground_truth": str(i % 3)} for i in range(4)]
    config = tiny_config(tmp_path, "rl", {"model": {"path": "tiny:qwen2_5_vl"},
                                          "data": {"train_batch_size": 2, "max_prompt_length": 64},
                                          "rollout": {"n": 4, "max_new_tokens": 6},
                                          "actor": {"micro_batch_size": 4, "lr": 1e-2},
                                          "trainer": {"total_steps": 2}})

    trainer = RLTrainer(config, rows=rows, reward_functions=[odd_length])
    tower = set(vision_parameter_names(trainer.model))
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if n in tower}
    batch = trainer.get_batch()
    assert len(batch.images) == len(batch) == 8
    for i, row in enumerate(batch.rows):  # each sample holds its own prompt's image, shared with its group
        assert batch.images[i].count == len(row["images"]) == 1 and batch.images[i] is batch.images[i - i % 4]
    sub = batch.select(torch.tensor([5, 1]))
    assert sub.images == [batch.images[5], batch.images[1]]
    trainer.step()
    moved = [n for n, p in trainer.model.named_parameters() if n in tower and not torch.equal(p, before[n])]
    assert moved  # the gradient reaches the vision tower through the pixels


@pytest.mark.parametrize("overrides,key", [({"actor": {"remove_padding": True}}, "actor.remove_padding"),
                                           ({"actor": {"sequence_parallel_size": 2}}, "sequence_parallel_size"),
                                           ({"devices": {"actor": [0], "rollout": [1]}}, "devices.rollout")])
def test_what_takes_no_images_yet_is_refused_for_a_vision_language_policy(tmp_path, overrides, key):
    from transformers import AutoConfig

    config = tiny_config(tmp_path, "rl", {"model": {"path": "tiny:qwen2_5_vl"}}, overrides)
    problems = check_images(config, "rl", AutoConfig.from_pretrained(build_tiny_vl_model()))
    assert len(problems) == 1 and isinstance(problems[0], ConfigError) and key in str(problems[0])
    assert "vision-language" in str(problems[0])
    text = AutoConfig.from_pretrained(build_from_spec("tiny"))
    assert check_images(config, "rl", text) == []


def test_vllm_rollouts_are_not_refused_for_a_vision_language_policy(tmp_path):
    """vLLM takes image prompts in its multimodal format (tests/rollout/test_vllm_images.py)."""
    from transformers import AutoConfig

    config = tiny_config(tmp_path, "rl", {"model": {"path": "tiny:qwen2_5_vl"}, "rollout": {"engine": "vllm"}})
    assert check_images(config, "rl", AutoConfig.from_pretrained(build_tiny_vl_model())) == []


def test_verl_check_refuses_packed_sft_for_a_vision_language_policy(tmp_path):
    from verl.trainer.checks.startup import check_startup

    path = build_tiny_vl_model()
    config = tiny_config(tmp_path, "sft", {"model": {"path": path}, "sft": {"packing": True}})
    problems = [str(p) for p in check_startup(config, world_size=1, model_path=path, device_type="cpu").problems]
    assert any("sft.packing=false" in p and "vision-language" in p for p in problems)


@pytest.mark.parametrize("freeze", [True, False])
def test_lora_adapts_the_language_model_and_the_tower_follows_its_setting(tmp_path, freeze):
    """LoRA adapters go on the language model only; the vision tower is frozen, or trains in full as a module
    saved with the adapters (`actor.freeze_vision_tower`). A step on image rows runs either way."""
    pytest.importorskip("peft")
    from verl.models.vision import vision_tower
    from verl.trainer.rl_trainer import RLTrainer

    rows = [{"prompt": f"<image>Colour {i}?", "images": [image(56, i)], "ground_truth": "1"} for i in range(2)]
    config = tiny_config(tmp_path, "rl", {"model": {"path": "tiny:qwen2_5_vl", "lora": {"rank": 4}},
                                          "data": {"train_batch_size": 2, "max_prompt_length": 64},
                                          "rollout": {"n": 2, "max_new_tokens": 4},
                                          "actor": {"micro_batch_size": 4, "freeze_vision_tower": freeze},
                                          "trainer": {"total_steps": 1}})
    trainer = RLTrainer(config, rows=rows, reward_functions=[odd_length])
    tower, _ = vision_tower(trainer.model)
    names = [n for n, _ in trainer.model.named_parameters()]
    assert any("lora_A" in n and "language_model" in n for n in names)
    assert not any("lora_" in n for n in names if n.startswith(tower + "."))
    trainable_tower = [n for n, p in trainer.model.named_parameters() if n.startswith(tower + ".") and p.requires_grad]
    assert bool(trainable_tower) is not freeze
    trainer.step()


def test_a_frozen_vision_tower_does_not_train_in_a_full_fine_tune(tmp_path):
    from verl.models.vision import vision_parameter_names
    from verl.trainer.rl_trainer import RLTrainer

    config = tiny_config(tmp_path, "rl", {"model": {"path": "tiny:qwen2_5_vl"},
                                          "data": {"max_prompt_length": 64, "train_batch_size": 1},
                                          "actor": {"freeze_vision_tower": True}})
    trainer = RLTrainer(config, rows=[{"prompt": "<image>?", "images": [image(28, 0)], "ground_truth": "1"}],
                        reward_functions=[lambda prompt, response, ground_truth, **kw: 0.0])
    tower = set(vision_parameter_names(trainer.model))
    params = dict(trainer.model.named_parameters())
    assert tower and not any(params[n].requires_grad for n in tower)
    assert all(p.requires_grad for n, p in params.items() if n not in tower)


def test_a_trained_vision_language_checkpoint_exports_with_its_processor_and_resumes(tmp_path):
    """The checkpoint keeps the processor beside the config and tokenizer; `verl ckpt export` writes a folder that
    loads as the same image-text-to-text model with a processor giving the same inputs; a rerun resumes."""
    from verl.checkpoint.hf_export import export_hf
    from verl.trainer.rl_trainer import RLTrainer

    rows = [{"prompt": f"<image>Colour {i}?", "images": [image(56, i)], "ground_truth": "1"} for i in range(2)]
    config = tiny_config(tmp_path / "run", "rl", {"model": {"path": "tiny:qwen2_5_vl"},
                                                  "data": {"train_batch_size": 2, "max_prompt_length": 64},
                                                  "rollout": {"n": 2, "max_new_tokens": 4},
                                                  "actor": {"micro_batch_size": 4, "lr": 1e-2},
                                                  "checkpoint": {"save_interval": 1},
                                                  "trainer": {"total_steps": 1, "resume": "auto"}})
    trainer = RLTrainer(config, rows=rows, reward_functions=[odd_length])
    trainer.fit()
    ckpt = tmp_path / "run" / "checkpoints" / "step_1"
    out = export_hf(ckpt, tmp_path / "hf")
    model, _, processor = load_hf_model(str(out), torch_dtype="fp32", device="cpu", for_training=False,
                                        return_processor=True)
    assert type(model).__name__ == type(trainer.model).__name__
    trained = dict(trainer.model.named_parameters())
    assert all(torch.equal(p, trained[n]) for n, p in model.named_parameters())
    want = batch_processor_inputs(trainer.parts.processor, [load_images(rows[0])], [rows[0]["prompt"]])
    got = batch_processor_inputs(processor, [load_images(rows[0])], [rows[0]["prompt"]])
    assert all(torch.equal(want[k], got[k]) for k in want)
    again = RLTrainer(config, rows=rows, reward_functions=[odd_length])
    again.fit()  # resumes at the end: nothing left to train
    assert again.step_count == 1
    assert all(torch.equal(p, trained[n]) for n, p in again.model.named_parameters())


def test_an_fsdp2_sharded_vision_language_policy_samples_and_trains_with_images(tmp_path, vl):
    """FSDP2 shards the decoder layers and the vision blocks (`_no_split_modules`); gathered for the rollout it
    samples the unsharded model's tokens, and the log-probs with images backpropagate into the shards."""
    import copy

    import torch.distributed as dist

    from verl.distributed.fsdp import apply_fsdp, gathered
    from verl.trainer.fsdp_config import FSDPConfig
    from verl.utils.positions import position_ids_from_mask

    model = copy.deepcopy(vl[0]).requires_grad_(True)
    ids, mask, images = encoded(vl)
    params = SamplingParams(temperature=0, max_new_tokens=4)
    want = HFKVCacheEngine(model).generate(ids, mask, params, images=images).response_ids
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        sharded = apply_fsdp(model.train(), FSDPConfig(), group=dist.group.WORLD, device_type="cpu")
        with gathered(sharded):
            out = HFKVCacheEngine(sharded).generate(ids, mask, params, images=images)
        assert torch.equal(out.response_ids, want)
        full = torch.cat([out.prompt_ids, out.response_ids], 1)
        attention = torch.cat([out.prompt_mask, out.response_mask], 1)
        logprobs, _ = response_logprobs(sharded, full, attention, position_ids_from_mask(attention), 4, images=images)
        logprobs.sum().backward()
        tower = [p for n, p in sharded.named_parameters() if ".visual." in f".{n}"]
        assert tower and all(p.grad is not None for p in tower)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("freeze", [False, True])
def test_the_memory_plan_counts_the_vision_tower(tmp_path, freeze):
    """The plan's model state counts the tower's parameters, its shape is the language model's (not a vision
    block's), and a trained tower's saved activations are planned for every prompt token being an image's."""
    from verl.distributed.memory_plan_micro_batch import forward_backward_parts
    from verl.trainer.checks.startup import check_startup

    path = build_tiny_vl_model()
    config = tiny_config(tmp_path, "rl", {"model": {"path": path}, "trainer": {"device": "cuda"},
                                          "data": {"max_prompt_length": 64}, "rollout": {"max_new_tokens": 16},
                                          "actor": {"micro_batch_size": 2, "freeze_vision_tower": freeze}})
    report = check_startup(config, world_size=1, model_path=path, device_type="cpu")
    x = report.plan_inputs
    model = load_hf_model(path, torch_dtype="fp32", device="cpu", for_training=False)[0]
    assert x.shape.total_params == sum(p.numel() for p in model.parameters())
    decoder = model.model.language_model.layers[0]
    assert x.shape.layer_params == sum(p.numel() for p in decoder.parameters())
    parts = dict(forward_backward_parts(x))
    vision = [v for k, v in parts.items() if k.startswith("vision tower")]
    if freeze:
        assert vision == []
        return
    v = model.config.vision_config
    patches = 2 * 64 * v.spatial_merge_size ** 2  # 2 sequences x 64 prompt tokens, each token 4 patches
    c, h, i = x.compute_bytes, v.hidden_size, v.intermediate_size
    norms = 2 * (4 * h + c * h)  # two norms: float32 input, output
    attention = c * (h + 3 * h + h + h) + 4 * v.num_heads  # input, q/k/v, output, o-projection's input; lse
    mlp = c * h + c * 4 * i  # input; gate, silu(gate), up, product
    per_patch = norms + attention + mlp
    assert vision == [patches * v.depth * per_patch]


def test_a_critic_on_a_vision_language_policy_sees_the_images(tmp_path):
    """PPO with GAE: the critic (the policy's backbone with a value head) gets each row's pixels and multimodal
    positions, its values equal a forward with transformers' own positions, and its update reaches its tower."""
    from verl.models.vision import vision_parameter_names
    from verl.trainer.rl_trainer import RLTrainer

    rows = [{"prompt": f"<image>Colour {i}?", "images": [image(56, i)], "ground_truth": "1"} for i in range(2)]
    config = tiny_config(tmp_path, "rl", {"model": {"path": "tiny:qwen2_5_vl"},
                                          "data": {"train_batch_size": 2, "max_prompt_length": 64},
                                          "rollout": {"n": 2, "max_new_tokens": 4},
                                          "algorithm": {"adv_estimator": "gae"}, "trainer": {"total_steps": 1}})
    trainer = RLTrainer(config, rows=rows, reward_functions=[odd_length])
    critic = trainer.critic
    with torch.no_grad():
        critic.value_head.weight.normal_(generator=torch.Generator().manual_seed(0))
    batch = trainer.generate(trainer.get_batch())
    with torch.no_grad():
        values = trainer.critic_values(batch)
        pixels = torch.cat([r.pixel_values for r in batch.images])
        grids = torch.cat([r.image_grid_thw for r in batch.images])
        ids, mask = batch.input_ids[:, :-1], batch.attention_mask[:, :-1]
        hidden = critic.backbone(input_ids=ids, attention_mask=mask, pixel_values=pixels, image_grid_thw=grids,
                                 mm_token_type_ids=(ids == critic.config.image_token_id).int()).last_hidden_state
        want = critic.value_head(hidden.float()).squeeze(-1)[:, -batch.response_ids.shape[1]:]
    real = batch.response_mask.bool()
    assert torch.allclose(values[real], want[real], atol=1e-5)
    tower = set(vision_parameter_names(critic))
    before = {n: p.detach().clone() for n, p in critic.named_parameters() if n in tower}
    trainer.step()
    assert any(not torch.equal(p, before[n]) for n, p in critic.named_parameters() if n in tower)
