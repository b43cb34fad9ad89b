"""The memory plan with tensor parallelism (`verl check`): a Llama-3.1-70B-shaped GRPO (1k prompt + 4k response
tokens, a KL loss to a reference, our sampler) on 16 nodes x 8 H100 80GB, planned on this CPU from a folder
holding config.json alone.

FSDP alone cannot run it: the sampler gathers the whole policy (141 GB in bfloat16) on every GPU. The check must
say so, name the tensor-parallel size that makes it fit, and agree within 15% with an estimate written here from
first principles (our own arithmetic, not the plan's code) at that size and the others.
"""

from __future__ import annotations

import json
import re

import pytest

from verl.cli.main import main
from verl.config.loader import load_config
from verl.distributed.memory_plan import plan_memory, suggestions
from verl.trainer.checks.startup import check_startup

GIB = 2**30
H100 = 79.1  # GiB: the total memory torch reports for an H100 80GB
# Llama-3.1-70B's published shape
H, L, HEADS, KV_HEADS, FFN, V = 8192, 80, 64, 8, 28672, 128256
KV = KV_HEADS * H // HEADS
NODES, PER_NODE = 16, 8
N = NODES * PER_NODE
PROMPTS, SAMPLES, PROMPT_LEN, RESPONSE_LEN = 128, 8, 1024, 4096


@pytest.fixture(scope="module")
def llama70b(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama-3.1-70b-config-only")
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": H, "num_hidden_layers": L,
        "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "intermediate_size": FFN, "vocab_size": V,
        "tie_word_embeddings": False, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "hidden_act": "silu", "torch_dtype": "bfloat16"}))
    cfg = folder / "grpo.yaml"  # fp32 master weights, bf16 compute; KL to a reference; checkpointed layers
    cfg.write_text(f"""
trainer: {{kind: rl, device: cuda, run_dir: {folder / 'run'}}}
model: {{path: {folder}, dtype: float32}}
fsdp: {{mixed_precision: true, activation_checkpointing: true}}
env: {{name: arithmetic}}
data: {{train_batch_size: {PROMPTS}, max_prompt_length: {PROMPT_LEN}}}
rollout: {{engine: hf, n: {SAMPLES}, max_new_tokens: {RESPONSE_LEN}}}
actor: {{kl_loss_coef: 0.001, micro_batch_size: 1}}
""")
    return cfg


def _inputs(cfg, *overrides):
    config = load_config(str(cfg), list(overrides))
    report = check_startup(config, world_size=N, model_path=config.model.path, device_type="cpu")
    assert report.plan_inputs is not None, [str(p) for p in report.problems]
    return report.plan_inputs


def first_principles(tp: int) -> tuple[float, float, float]:
    """(start-up, rollout, update) peak per GPU in bytes at tensor-parallel size `tp`, from the shape alone."""
    layer = 2 * H * H + 2 * H * KV + 3 * H * FFN + 2 * H  # q, o; k, v; gate, up, down; two norms
    params = 2 * V * H + L * layer + H  # embeddings, untied head, layers, final norm
    assert params == 70_553_706_496  # Llama-3.1-70B's published count
    runtime = 1 * GIB  # CUDA context + NCCL
    # every GPU holds 1/N of the fp32 policy (weights, gradients, two AdamW moments) and of the bf16 reference:
    # FSDP shards each tensor-parallel part over the N/tp replicas
    actor, ref = params * 16 / N, params * 2 / N
    startup = params * 4 / N + ref + runtime  # each rank reads its rows and columns; no gradients, no moments yet
    # rollout: a tensor-parallel group samples its replica's rows from its 1/tp of the bf16 policy
    rows = PROMPTS * SAMPLES // (N // tp)
    weights = params * 2 / tp
    kv_cache = rows * (PROMPT_LEN + RESPONSE_LEN) * L * 2 * KV * 2 / tp  # keys and values, bf16, split by KV heads
    rollout = params * 12 / N + ref + weights + kv_cache + rows * V * 4 / tp + runtime
    # update, one 5k-token sequence, checkpointed: every layer's bf16 input, one layer's activations recomputed
    # (its norms' and projections' inputs whole on every rank, what lies between the projections split by tp)
    tokens = PROMPT_LEN + RESPONSE_LEN
    whole = 2 * (4 * H + 2 * H) + 2 * H + 2 * H
    split = (2 * H + 4 * KV + 2 * H + 2 * H + 8 * FFN) / tp
    acts = tokens * (L * 2 * H + whole + split)
    logits = 2 * 2 * RESPONSE_LEN * V / tp  # bf16 logits of this rank's vocabulary shard + their gradient
    fsdp = (2 * V * H + 2 * layer) * 2 / tp * 2  # gathered bf16 root + 2 layers of this tp part, and gradients
    update = actor + ref + fsdp + acts + logits + runtime
    return startup, rollout, update


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_the_70b_plan_agrees_with_first_principles_within_15_percent(llama70b, tp):
    x = _inputs(llama70b, f"actor.tensor_parallel_size={tp}")
    assert x.tensor_parallel == tp and x.rows_per_rank == PROMPTS * SAMPLES // (N // tp)
    plan = plan_memory(x, int(H100 * GIB))
    want = first_principles(tp)
    for got, expected, what in zip((plan.startup_peak, plan.rollout_peak, plan.update_peak), want,
                                   ("start-up", "rollout", "update"), strict=True):
        assert got == pytest.approx(expected, rel=0.15), f"TP={tp} {what}"
    device = H100 * GIB
    assert plan.fits is (max(want) <= device)  # where the estimate is clear of the device's size: 1, 2 over, 4, 8 in
    assert plan.fits is (tp >= 4)


def test_verl_check_says_fsdp_alone_does_not_fit_and_which_tensor_parallel_size_does(llama70b, capsys):
    code = main(["check", str(llama70b), "--nproc", str(PER_NODE), "--nnodes", str(NODES), "--gpu-memory", str(H100)])
    out = capsys.readouterr().out
    assert "memory plan per GPU on an actor rank (GiB)" in out and "DOES NOT FIT" in out
    assert re.search(r"sampler: gathered policy weights\s+131\.4\d", out)  # 70.6B bf16 weights on one GPU
    [fix] = [line for line in out.splitlines() if "actor.tensor_parallel_size=" in line and ": rollout" in line]
    assert "actor.tensor_parallel_size=4:" in fix and fix.endswith("(fits)"), fix
    fits = suggestions(_inputs(llama70b), int(H100 * GIB))
    assert [f for f in fits if f.startswith("actor.tensor_parallel_size=")] == [fix.strip().removeprefix("- ")]
    # taking it: the check plans TP=4 over 32 replicas, and it fits
    assert main(["check", str(llama70b), "--nproc", str(PER_NODE), "--nnodes", str(NODES), "--gpu-memory", str(H100),
                 "actor.tensor_parallel_size=4"]) in (0, 1)
    out = capsys.readouterr().out
    assert "32 data-parallel replica(s) x 4 tensor-parallel ranks" in out
    assert "DOES NOT FIT" not in out and "(1/4: tensor-parallel)" in out
    assert code == 1


def test_a_vllm_run_is_told_the_size_and_the_keys_tensor_parallelism_needs_too(llama70b):
    x = _inputs(llama70b, "rollout.engine=vllm", "actor.remove_padding=true")
    plan = plan_memory(x, int(H100 * GIB))
    assert not plan.fits and any(name.startswith("vLLM: its weights alone") for name, _ in plan.rollout)
    assert x.tensor_parallel_sizes == (2, 4, 8) and x.tensor_parallel_keys == ("actor.remove_padding=false",)
    [fix] = [f for f in suggestions(x, int(H100 * GIB)) if f.startswith("actor.tensor_parallel_size=")]
    size = int(fix.split("=")[1].split(",")[0])
    assert fix.startswith(f"actor.tensor_parallel_size={size}, actor.remove_padding=false:") and fix.endswith("(fits)")
    # taken: vLLM's weights in its share are its 1/size part
    y = _inputs(llama70b, "rollout.engine=vllm", f"actor.tensor_parallel_size={size}")
    assert plan_memory(y, int(H100 * GIB)).fits
    assert any(f"(1/{size}: tensor-parallel)" in n for n in plan_memory(y, int(H100 * GIB)).notes)


def test_no_tensor_parallel_size_is_offered_where_the_run_cannot_take_one(llama70b):
    assert _inputs(llama70b, "algorithm.adv_estimator=gae").tensor_parallel_sizes == ()  # a critic: no TP plan
    assert _inputs(llama70b, "actor.tensor_parallel_size=8").tensor_parallel_sizes == ()  # nothing above 8
