"""The memory plan's start-up phase and a rollout rank's plan (`verl check --gpu-memory 80`), for Qwen2.5-14B and
Qwen2.5-32B GRPO planned on this CPU from folders holding config.json alone.

Start-up: each FSDP2-sharded role is built on the meta device and each rank reads only its shards
(`verl.models.sharded_load`), so a rank holds its roles' shards in their held dtypes (fp32 masters of the
policy, the bf16 reference), no gradients or optimizer moments yet, and a colocated vLLM's share while it starts;
where the models load whole first (a split placement, one process) the whole copies are the peak.
"""

from __future__ import annotations

import re

import pytest
from qwen2_config import write_qwen2_config  # pytest puts this folder on sys.path

from verl.cli.main import main
from verl.config.loader import load_config
from verl.distributed.memory_plan import plan_memory, suggestions
from verl.trainer.checks.startup import check_startup

GIB = 2**30
GPU = 80  # --gpu-memory, GiB
V = 152064
# the published shapes: hidden, layers, heads, KV heads, ffn; and the parameter counts they give
MODELS = {"14b": (5120, 48, 40, 8, 13824, 14_770_033_664), "32b": (5120, 64, 40, 8, 27648, 32_763_876_352)}
PROMPTS, SAMPLES, PROMPT_LEN, RESPONSE_LEN = 512, 8, 1024, 4096
ASYNC_1_NODE = ("devices.actor=[0,1,2,3,4,5]", "devices.ref=[0,1,2,3,4,5]", "devices.rollout=[6,7]",
                "rollout.max_staleness=1")


def params(size: str) -> int:
    h, layers, heads, kv_heads, ffn, published = MODELS[size]
    kv = kv_heads * h // heads
    layer = 2 * h * h + 2 * h * kv + h + 2 * kv + 3 * h * ffn + 2 * h  # q,o; k,v; q/k/v biases; MLP; 2 norms
    total = 2 * V * h + layers * layer + h  # embeddings, untied head, layers, final norm
    assert total == published
    return total


def _folder(tmp_path_factory, size: str):
    h, layers, heads, kv_heads, ffn, _ = MODELS[size]
    folder = tmp_path_factory.mktemp(f"qwen2.5-{size}-config-only")
    write_qwen2_config(folder, hidden=h, layers=layers, heads=heads, kv_heads=kv_heads, ffn=ffn, vocab=V)
    cfg = folder / "grpo.yaml"  # fp32 master weights, bf16 compute; KL to a reference; colocated vLLM
    cfg.write_text(f"""
trainer: {{kind: rl, device: cuda, run_dir: {folder / 'run'}}}
model: {{path: {folder}, dtype: float32}}
fsdp: {{mixed_precision: true, activation_checkpointing: true}}
env: {{name: arithmetic}}
data: {{train_batch_size: {PROMPTS}, max_prompt_length: {PROMPT_LEN}}}
rollout: {{engine: vllm, n: {SAMPLES}, max_new_tokens: {RESPONSE_LEN}}}
actor: {{kl_loss_coef: 0.001, micro_batch_size: 2}}
""")
    return cfg


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    return {size: _folder(tmp_path_factory, size) for size in MODELS}


def _inputs(cfg, world: int, *overrides):
    config = load_config(str(cfg), list(overrides))
    report = check_startup(config, world_size=world, model_path=config.model.path, device_type="cpu")
    assert report.plan_inputs is not None, [str(p) for p in report.problems]
    return report.plan_inputs


def _check(cfg, capsys, *args) -> str:
    main(["check", str(cfg), *args, "--gpu-memory", str(GPU)])
    return capsys.readouterr().out


def _startup_peak(out: str) -> tuple[float, str]:
    [(peak, verdict)] = re.findall(r"  start-up phase \(models loading[^\n]*\n(?:    [^\n]*\n)*?    peak\s+([\d.]+)"
                                   r"\s+of 80\.0 \((fits|DOES NOT FIT)\)", out)
    return float(peak), verdict


def first_principles_startup(size: str, ranks: int, utilization: float, *, critic: bool = False) -> float:
    """An actor rank's start-up peak, each role read as its own 1/`ranks` shard: the policy's fp32 weights and
    the bf16 reference (no gradients, no AdamW moments: those come at the first step), then vLLM's share of
    the device while it starts (the critic, when there is one, is sharded after vLLM sleeps)."""
    p = params(size)
    runtime = 1 * GIB  # CUDA context + NCCL
    while_vllm = p * 4 / ranks + p * 2 / ranks + utilization * GPU * GIB + runtime
    loaded = p * 4 / ranks + p * 2 / ranks + (p * 4 / ranks if critic else 0) + 1 * GIB + runtime  # vLLM asleep
    return max(while_vllm, loaded)


@pytest.mark.parametrize("size", ["14b", "32b"])
def test_8_nodes_the_start_up_fits_and_agrees_with_first_principles_within_15_percent(configs, capsys, size):
    out = _check(configs[size], capsys, "--nproc", "8", "--nnodes", "8")
    peak, verdict = _startup_peak(out)
    assert verdict == "fits" and peak < GPU
    x = _inputs(configs[size], 64)
    assert x.reads_shards and dict((r, n) for r, _, n in x.loading) == {"actor": 64, "ref": 64}
    plan = plan_memory(x, GPU * GIB)
    assert peak == round(plan.startup_peak / GIB, 2)
    assert plan.startup_peak == pytest.approx(first_principles_startup(size, 64, x.gpu_memory_utilization), rel=0.15)
    assert "each rank reads only its shards" in out
    # a critic too (GAE): sharded after vLLM starts, so the peak is still vLLM's start
    gae = plan_memory(_inputs(configs[size], 64, "algorithm.adv_estimator=gae"), GPU * GIB)
    assert gae.startup_peak == pytest.approx(first_principles_startup(size, 64, x.gpu_memory_utilization,
                                                                      critic=True), rel=0.15)


def test_the_start_up_holds_no_gradients_or_optimizer_moments(configs):
    x = _inputs(configs["32b"], 8, "actor.kl_loss_coef=0")  # the policy alone, over 8 ranks
    parts = dict(plan_memory(x, None).startup)
    assert parts["policy weights: this rank's shard (1/8)"] == -(-params("32b") * 4 // 8)
    plan = plan_memory(x.with_(engine="hf"), GPU * GIB)
    assert plan.startup_moment == "models loaded" and plan.startup_peak == -(-params("32b") * 4 // 8) + GIB


def test_1_node_split_placement_loads_whole_models_and_does_not_fit(configs, capsys):
    """Asynchronous GRPO on one node (6 trainer ranks, 2 rollout ranks): a split placement loads the 14B policy
    whole in fp32 (55 GiB) and copies it whole into the bf16 reference (27.5 GiB) before sharding: 83.5 GiB, over
    80 though both phases of a step fit; the plan says so and what reading shards would hold."""
    out = _check(configs["14b"], capsys, *ASYNC_1_NODE, "--nproc", "8")
    peak, verdict = _startup_peak(out)
    p = params("14b")
    assert verdict == "DOES NOT FIT" and peak == round((p * 4 + p * 2 + GIB) / GIB, 2)
    assert "policy weights: loaded whole (before sharding)" in out
    assert "because of a split placement" in out
    x = _inputs(configs["14b"], 8, *ASYNC_1_NODE)
    plan = plan_memory(x, GPU * GIB)
    assert not x.reads_shards and plan.rollout_peak <= GPU * GIB and plan.update_peak <= GPU * GIB
    [line] = [s for s in suggestions(x, GPU * GIB) if s.startswith("start-up: ")]
    assert line.endswith("(fits)") and f"hold {(p * 6 + GIB) / GIB:.1f} GiB" in line
    assert f"start-up: whole models before sharding hold {(p * 6 + GIB) / GIB:.1f} GiB" in out
    # the same node colocated: each rank reads its shards, and the start-up fits
    colocated = plan_memory(_inputs(configs["14b"], 8), GPU * GIB)
    assert colocated.inputs.reads_shards and colocated.startup_peak <= GPU * GIB


def test_one_process_names_the_launch_whose_shards_fit(configs):
    x = _inputs(configs["14b"], 1)
    plan = plan_memory(x.with_(engine="hf"), GPU * GIB)
    p = params("14b")
    assert "policy weights: loaded whole (not sharded over several ranks)" in dict(plan.startup)
    assert plan.startup_peak == p * 4 + p * 2 + GIB  # the whole fp32 policy, its whole bf16 copy
    [line] = [s for s in suggestions(x.with_(engine="hf"), GPU * GIB) if s.startswith("start-up: ")]
    assert "on 2 GPUs (--nproc 2)" in line and line.endswith("(fits)")


def test_a_rollout_rank_has_a_plan_of_its_own(configs, capsys):
    out = _check(configs["14b"], capsys, *ASYNC_1_NODE, "--nproc", "8")
    assert "memory plan per GPU on a rollout rank (GiB; devices.rollout, 2 rank(s) that only generate)" in out
    x = _inputs(configs["14b"], 8, *ASYNC_1_NODE)
    p, h, layers, kv = params("14b"), 5120, 48, 8 * 128
    plan = plan_memory(x, GPU * GIB)
    # start-up: the policy whole in its fp32 master dtype; then vLLM awake with its share, the weight
    # deliveries landing one bucket at a time (the largest tensor, the embeddings, in bf16)
    assert sum(b for _, b in plan.rollout_rank_startup) == p * 4 + GIB
    assert (sum(b for _, b in plan.rollout_rank)
            == int(x.rollout_rank.gpu_memory_utilization * GPU * GIB) + V * h * 2 + GIB)
    assert plan.rollout_rank_peak == max(p * 4 + GIB, sum(b for _, b in plan.rollout_rank))  # vLLM: 0.9 there
    assert re.search(r"generating phase\n(?:    [^\n]*\n)*?    peak\s+[\d.]+\s+of 80\.0 \(fits\)", out)
    # our sampler instead: the fp32 copy, its fp32 KV cache for this rank's rows (4096 / 2), the logits
    hf = plan_memory(_inputs(configs["14b"], 8, *ASYNC_1_NODE, "rollout.engine=hf"), GPU * GIB)
    rows, seq = PROMPTS * SAMPLES // 2, PROMPT_LEN + RESPONSE_LEN
    assert sum(b for _, b in hf.rollout_rank) == (p * 4 + rows * seq * layers * 2 * kv * 4 + rows * V * 4
                                                 + V * h * 2 + GIB)
    assert hf.fits is False and any(s.startswith("rollout rank: our sampler")
                                    for s in suggestions(hf.inputs, GPU * GIB))
    # 32B: a rollout rank cannot even load the whole fp32 policy (122 GiB)
    big = plan_memory(_inputs(configs["32b"], 8, *ASYNC_1_NODE), GPU * GIB)
    assert big.rollout_rank_peak > GPU * GIB
    assert any(s.startswith("rollout rank: loading the whole policy") for s in suggestions(big.inputs, GPU * GIB))


def test_a_synchronous_run_has_no_rollout_rank_plan(configs, capsys):
    out = _check(configs["14b"], capsys, "--nproc", "8", "--nnodes", "8")
    assert "rollout rank" not in out and plan_memory(_inputs(configs["14b"], 64), None).rollout_rank == []
