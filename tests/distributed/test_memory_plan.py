"""The per-GPU memory plan (`verl check`): Qwen2.5-7B GRPO on 8 x 8 H100 80GB, planned on this CPU.

The plan must agree within +-20% with an estimate written here from first principles (our own arithmetic,
not the plan's code), print from a folder holding config.json alone for a vLLM run on a machine without a
GPU (refusing to train there, not to plan), and name settings that make a plan that does not fit fit.
"""

from __future__ import annotations

import re

import pytest
from qwen2_config import write_qwen2_config  # pytest puts this folder on sys.path

from verl.cli.main import main
from verl.config.loader import load_config
from verl.distributed.memory_plan import plan_memory, suggestions
from verl.trainer.checks.memory_inputs import model_shape, vllm_memory_utilization
from verl.trainer.checks.startup import check_startup

GIB = 2**30
H100 = 79.1  # GiB: the total memory torch reports for an H100 80GB
# Qwen2.5-7B's published shape
H, L, HEADS, KV_HEADS, FFN, V = 3584, 28, 28, 4, 18944, 152064
KV = KV_HEADS * H // HEADS
NODES, PER_NODE = 8, 8
N = NODES * PER_NODE
PROMPTS, SAMPLES, PROMPT_LEN, RESPONSE_LEN = 512, 8, 1024, 4096


@pytest.fixture(scope="module")
def qwen7b(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen2.5-7b-config-only")
    write_qwen2_config(folder, hidden=H, layers=L, heads=HEADS, kv_heads=KV_HEADS, ffn=FFN, vocab=V)
    cfg = folder / "grpo.yaml"  # fp32 master weights, bf16 compute; KL to a reference; colocated vLLM
    cfg.write_text(f"""
trainer: {{kind: rl, device: cuda, run_dir: {folder / 'run'}}}
model: {{path: {folder}, dtype: float32}}
fsdp: {{mixed_precision: true}}
env: {{name: arithmetic}}
data: {{train_batch_size: {PROMPTS}, max_prompt_length: {PROMPT_LEN}}}
rollout: {{engine: vllm, n: {SAMPLES}, max_new_tokens: {RESPONSE_LEN}}}
actor: {{kl_loss_coef: 0.001, chunked_logprobs: false}}
""")
    return cfg


def _inputs(cfg, *overrides):
    config = load_config(str(cfg), list(overrides))
    report = check_startup(config, world_size=N, model_path=config.model.path, device_type="cpu")
    assert report.plan_inputs is not None, [str(p) for p in report.problems]
    return report.plan_inputs


def first_principles(*, checkpointing: bool, micro_batch: int, utilization: float,
                     chunked: bool = False) -> tuple[float, float]:
    """(rollout, update) peak per GPU in bytes, from the model's shape and the run's settings alone."""
    layer = 2 * H * H + 2 * H * KV + H + 2 * KV + 3 * H * FFN + 2 * H  # q,o; k,v; q/k/v biases; MLP; 2 norms
    params = 2 * V * H + L * layer + H  # embeddings, untied head, layers, final norm
    assert params == 7_615_616_512  # Qwen2.5-7B's published count
    actor = params * (4 + 4 + 8) / N  # fp32 weights, gradients, two AdamW moments, sharded over 64 GPUs
    ref = params * 2 / N  # frozen bf16 reference, sharded the same way
    runtime = 1 * GIB  # CUDA context + NCCL
    # rollout: the training state stays (gradients freed), vLLM takes its share of the device
    push = V * H * 4  # the weight push gathers one full fp32 tensor at a time: the largest, the head
    rollout = params * (4 + 8) / N + ref + utilization * H100 * GIB + push + runtime
    # update: activations per token per layer after Korthikanti et al. 2022 (34 h bytes for a GPT layer in
    # 16-bit), adjusted: a fused attention kernel (no s^2 terms), no dropout masks, GQA keys/values, SwiGLU
    # MLP (input + gate, up, silu, product: 2h + 8i), bf16 layer norms (2 x 2h)
    per_token = (2 * H + 2 * H + 4 * KV + 2 * H + 2 * H) + (2 * H + 8 * FFN) + 2 * 2 * H
    tokens = micro_batch * (PROMPT_LEN + RESPONSE_LEN)
    acts = tokens * (L * 2 * H + per_token) if checkpointing else tokens * L * per_token
    logits = 2 * 2 * micro_batch * RESPONSE_LEN * V  # bf16 logits saved for backward + their gradient
    if chunked:  # 2^26 logits at a time (441 tokens): bf16 projection, 3 float32 copies; fp32 head gradient
        logits = (2**26 // V) * V * (2 + 3 * 4) + V * H * 4
    fsdp = 2 * (2 * V * H + 2 * layer) * 2  # gathered bf16 embeddings/head + 2 layers, and their gradients
    update = actor + ref + fsdp + acts + logits + 1 * GIB + runtime  # 1 GiB: vLLM asleep
    return rollout, update


@pytest.mark.parametrize("checkpointing, micro_batch, chunked", [(False, 8, False), (True, 8, False), (True, 2, False),
                                                                 (False, 1, False), (True, 8, True), (True, 1, True)])
def test_the_7b_plan_agrees_with_first_principles_within_20_percent(qwen7b, checkpointing, micro_batch, chunked):
    x = _inputs(qwen7b, f"fsdp.activation_checkpointing={str(checkpointing).lower()}",
                f"actor.micro_batch_size={micro_batch}", f"actor.chunked_logprobs={str(chunked).lower()}")
    assert x.chunked_logprobs is chunked
    plan = plan_memory(x, int(H100 * GIB))
    want_rollout, want_update = first_principles(checkpointing=checkpointing, micro_batch=micro_batch,
                                                 utilization=x.gpu_memory_utilization, chunked=chunked)
    assert plan.rollout_peak == pytest.approx(want_rollout, rel=0.2)
    assert plan.update_peak == pytest.approx(want_update, rel=0.2)


def params_bytes(width: int) -> int:
    return 7_615_616_512 * width


def test_verl_check_prints_the_plan_on_a_cpu_machine_from_a_config_only_folder(qwen7b, capsys):
    """A vLLM run for 64 GPUs, checked here as it will run (cuda, bfloat16 compute): refused to train here (no
    vLLM installed), planned anyway, with what fits."""
    code = main(["check", str(qwen7b), "--nproc", str(PER_NODE), "--nnodes", str(NODES), "--gpu-memory", str(H100)])
    out = capsys.readouterr().out
    assert code == 1 and "rollout.engine=vllm but the vllm package is not installed" in out
    assert "memory plan per GPU on an actor rank (GiB)" in out
    peaks = [float(v) for v in re.findall(r"peak\s+([\d.]+)\s+of 79\.1", out)]
    x = _inputs(qwen7b)
    plan = plan_memory(x, int(H100 * GIB))
    assert peaks == [round(plan.startup_peak / GIB, 2), round(plan.rollout_peak / GIB, 2),
                     round(plan.update_peak / GIB, 2)]
    assert "DOES NOT FIT" in out  # 8 sequences of 5k tokens, every layer's activations kept
    assert "fsdp.activation_checkpointing=true: rollout" in out and "(fits)" in out
    assert f"gpu_memory_utilization {vllm_memory_utilization(load_config(str(qwen7b), []))}" in out


def test_the_settings_it_names_make_the_plan_fit(qwen7b):
    x = _inputs(qwen7b, "actor.micro_batch_size=16")
    device = int(H100 * GIB)
    assert plan_memory(x, device).fits is False
    fixes = suggestions(x, device)
    fitting = [f for f in fixes if f.endswith("(fits)")]
    assert fitting and fixes[0].startswith("actor.chunked_logprobs=true")  # cheapest first, if not enough here
    assert fixes[1].startswith("fsdp.activation_checkpointing=true")
    [offload] = [f for f in fixes if f.startswith("actor.activation_offload=true")]
    assert re.search(r"\(fits; [\d.]+ GiB of host memory\)$", offload)  # what it costs the host, too
    # each named setting, applied to the config, gives the plan it promised
    for fix in fitting:
        keys = [k.strip() for k in fix.removeprefix("together: ").split(":")[0].split(",")]
        overrides = [k for k in keys if not k.startswith("rollout.vllm.")]
        y = _inputs(qwen7b, "actor.micro_batch_size=16", *overrides)
        util = [float(k.split("=")[1]) for k in keys if k.startswith("rollout.vllm.gpu_memory_utilization")]
        if util:  # the key may not exist in this config schema yet: applied to the plan's inputs
            y = y.with_(gpu_memory_utilization=util[0])
        assert plan_memory(y, device).fits, fix


def test_when_both_phases_are_over_it_names_a_fix_for_each_together(qwen7b):
    x = _inputs(qwen7b).with_(gpu_memory_utilization=0.97)
    device = int(H100 * GIB)
    plan = plan_memory(x, device)
    assert plan.update_peak > device and plan.rollout_peak > device
    [both] = [f for f in suggestions(x, device) if f.startswith("together: ")]
    assert "fsdp.activation_checkpointing=true" in both and "rollout.vllm.gpu_memory_utilization=" in both
    assert both.endswith("(fits)")


def test_a_vllm_share_too_large_for_the_rollout_names_a_smaller_one(qwen7b):
    x = _inputs(qwen7b, "fsdp.activation_checkpointing=true").with_(gpu_memory_utilization=0.97)
    device = int(H100 * GIB)
    plan = plan_memory(x, device)
    assert plan.update_peak <= device < plan.rollout_peak
    [fix] = [f for f in suggestions(x, device) if f.startswith("rollout.vllm.gpu_memory_utilization=")]
    util = float(fix.split("=")[1].split(":")[0])
    assert fix.endswith("(fits)") and 0.5 < util < 0.97
    assert plan_memory(x.with_(gpu_memory_utilization=util + 0.05), device).rollout_peak > device


def test_the_reference_is_planned_sharded_over_the_actor_ranks(qwen7b):
    x = _inputs(qwen7b)
    assert x.resident["ref"][0] == -(-params_bytes(2) // N)
    assert x.resident["actor"] == (-(-params_bytes(4) // N), -(-params_bytes(4) // N), 2 * -(-params_bytes(4) // N))


def test_model_shape_reads_the_config_only_folder(qwen7b):
    config = load_config(str(qwen7b), [])
    shape = model_shape(config, config.model.path)
    assert (shape.hidden, shape.layers, shape.kv_dim, shape.intermediate, shape.vocab) == (H, L, KV, FFN, V)
    assert shape.total_params == 7_615_616_512 and shape.head_params == shape.embed_params == V * H


def _part(plan, start: str) -> int:
    [value] = [b for name, b in plan.update if name.startswith(start)]
    return value


def test_long_responses_chunked_logprobs_sequence_parallel_and_offload(qwen7b):
    """A 16k-token response, one per micro-batch, checkpointed: each long-response setting changes the terms
    it should, by the amounts written out here (bf16 compute, FSDP2)."""
    base = ("fsdp.activation_checkpointing=true", "actor.micro_batch_size=1", "rollout.max_new_tokens=16384")
    tokens, response = PROMPT_LEN + 16384, 16384
    per_token = 2 * (4 * H + 2 * H) + 2 * (4 * H + 2 * KV) + 4 * HEADS + 2 * (H + 4 * FFN)  # one layer, bf16
    layer = per_token + 2 * 2 * FFN  # its activations and the gradients of the MLP's two widest tensors
    final = (4 + 2 * 2) * H  # final norm (float32 input, bf16 output), the head's input
    plain = plan_memory(_inputs(qwen7b, *base), None)
    assert _part(plain, "attention mask (sdpa, 1 padded rows") == tokens * tokens * (2 + 1)  # bf16 + bool
    assert _part(plain, "activations (17408 tokens, checkpointed") == tokens * L * 2 * H
    logits = 2 * 2 * response * V + 3 * 2**26 * 4  # bf16 logits + gradient, three float32 chunks
    assert _part(plain, "backward: logits + their gradient") == tokens * final + logits

    chunked_inputs = _inputs(qwen7b, *base, "actor.chunked_logprobs=auto")
    assert chunked_inputs.chunked_logprobs  # 16k x 152k logits: auto turns it on
    chunked = plan_memory(chunked_inputs, None)
    # 441 tokens x V at a time (bf16 projection, three float32 copies) + the float32 head gradient: less than
    # one layer's backward, which is now the largest working set
    assert tokens * final + 441 * V * (2 + 12) + V * H * 4 < tokens * layer
    assert _part(chunked, "backward: one layer (17408 tokens)") == tokens * layer
    assert plain.update_peak - chunked.update_peak > 4 * GIB

    sp2 = plan_memory(chunked_inputs.with_(sequence_parallel=2), None)
    assert _part(sp2, "activations (8704 tokens per rank of 2") == tokens // 2 * L * 2 * H
    # half the tokens: now the chunked log-probs' working set (its head gradient does not shrink) is the larger
    assert _part(sp2, "backward: chunked log-probs (441 of 8192") == tokens // 2 * final + 441 * V * 14 + V * H * 4
    assert tokens // 2 * layer < tokens // 2 * final + 441 * V * 14 + V * H * 4
    assert _part(sp2, "attention mask") == tokens * tokens * 3  # each rank attends over the whole sequence
    halved = plan_memory(_inputs(qwen7b, *base).with_(sequence_parallel=2), None)
    assert _part(halved, "backward: logits + their gradient") == tokens // 2 * final + 2 * 2 * (response // 2) * V \
        + 3 * 2**26 * 4

    offloaded = plan_memory(_inputs(qwen7b, *base, "actor.chunked_logprobs=true", "actor.activation_offload=true"),
                            None)
    assert _part(offloaded, "activations (17408 tokens): offloaded") == 0
    assert _part(offloaded, "backward: one layer") == tokens * layer
    host = tokens * (L * 2 * H + final) / GIB
    assert f"actor.activation_offload: {host:.1f} GiB of saved activations" in " ".join(offloaded.notes)
    flash = plan_memory(_inputs(qwen7b, *base, "model.attn_implementation=flash_attention_2"), None)
    assert not any(name.startswith("attention mask") for name, _ in flash.update)  # varlen kernels take no mask


def test_cpu_offload_per_role(qwen7b):
    both = ("algorithm.adv_estimator=gae",)  # a critic on the actor's ranks too
    x = _inputs(qwen7b, *both)
    assert {"actor", "critic", "ref"} <= set(x.resident)
    actor_only = plan_memory(_inputs(qwen7b, *both, "actor.cpu_offload=true"), None)
    assert _part(actor_only, "actor weights") == 0 and _part(actor_only, "critic weights") > 0
    assert _part(actor_only, "reference weights") > 0
    everything = plan_memory(_inputs(qwen7b, *both, "fsdp.cpu_offload=true", "critic.cpu_offload=false"), None)
    assert _part(everything, "actor weights") == 0 and _part(everything, "reference weights") == 0
    assert _part(everything, "critic weights") > 0  # its own switch wins over fsdp.cpu_offload


def test_one_plain_process_has_no_gathered_layers(qwen7b):
    x = _inputs(qwen7b)
    sharded, plain = plan_memory(x, None), plan_memory(x.with_(sharded=False), None)
    assert any(name.startswith("gathered") for name, _ in sharded.update)
    assert not any(name.startswith(("gathered", "unsharded")) for name, _ in plain.update)


def test_the_chunked_rule():
    from verl.distributed.memory_plan import CHUNKED_AUTO_LOGITS, chunks_logits

    assert CHUNKED_AUTO_LOGITS == 2**28
    assert chunks_logits("auto", 1767, 151_936) and not chunks_logits("auto", 1766, 151_936)
    assert chunks_logits(True, 1, 10) and not chunks_logits(False, 10**6, 151_936)


def test_sequence_parallel_size_is_validated():
    from verl.errors import ConfigError

    with pytest.raises((ConfigError, ValueError), match="sequence_parallel_size"):
        load_config(None, ["actor.sequence_parallel_size=0"])


def test_sequence_parallel_is_in_the_plan(qwen7b):
    config = load_config(str(qwen7b), ["actor.sequence_parallel_size=2"])
    report = check_startup(config, world_size=N, model_path=config.model.path, device_type="cpu")
    assert report.plan_inputs is not None and report.plan_inputs.sequence_parallel == 2
    assert not [str(p) for p in report.problems if "sequence_parallel_size" in str(p)]


def test_sft_and_dpo_plan_the_update_phase_only(qwen7b, capsys):
    """An SFT step is the RL update of the same micro-batch shape without a rollout phase, a reference or a
    sleeping vLLM; DPO's adds its frozen reference (unless precomputed: then freed)."""
    shape = ["data.max_response_length=4096", "actor.micro_batch_size=2", "fsdp.activation_checkpointing=true"]
    device = int(H100 * GIB)
    sft = plan_memory(_inputs(qwen7b, "trainer.kind=sft", *shape), device)
    assert sft.rollout == [] and "rollout phase" not in sft.render() and "update phase" in sft.render()
    rl = plan_memory(_inputs(qwen7b, "rollout.max_new_tokens=4096", "actor.kl_loss_coef=0", "rollout.engine=hf",
                             *shape), device)
    assert sft.update_peak == rl.update_peak and sft.update == rl.update
    dpo = plan_memory(_inputs(qwen7b, "trainer.kind=dpo", *shape), device)
    assert dpo.update_peak == sft.update_peak + params_bytes(2) // N  # the bf16 reference, sharded over 64 GPUs
    precomputed = plan_memory(_inputs(qwen7b, "trainer.kind=dpo", "dpo.precompute_ref=true", *shape), device)
    assert precomputed.update_peak == sft.update_peak
    # SFT's `auto` counts every position of a micro-batch (5,120 x 152,064 logits here): chunked
    assert _inputs(qwen7b, "trainer.kind=sft", "actor.chunked_logprobs=auto", *shape).chunked_logprobs
    code = main(["check", str(qwen7b), "trainer.kind=sft", *shape, "--nproc", str(PER_NODE), "--nnodes", str(NODES),
                 "--gpu-memory", str(H100)])
    out = capsys.readouterr().out
    assert "memory plan per GPU on an actor rank (GiB)" in out and "update phase" in out, (code, out[-2000:])
    assert "rollout phase" not in out


def test_split_and_packed_forwards_build_no_attention_mask(qwen7b):
    def mask_parts(*overrides):
        return [name for name, _ in plan_memory(_inputs(qwen7b, *overrides), None).update if "attention mask" in name]

    assert mask_parts() and mask_parts("trainer.kind=sft")  # padded rows through sdpa
    for overrides in (["actor.sequence_parallel_size=4"], ["actor.remove_padding=true"],
                      ["trainer.kind=sft", "sft.packing=true"], ["trainer.kind=dpo", "actor.sequence_parallel_size=2"]):
        assert mask_parts(*overrides) == [], overrides
