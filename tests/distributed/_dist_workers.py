"""Worker bodies for the multi-process tests (spawned with torch.multiprocessing; gloo on CPU)."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist
from launch_support import rendezvous

SEQ_LEN = 8
GLOBAL_BATCH = 4
STEPS = 3
LR = 1e-2
SGD_LR = 1.0


def launch(fn, world: int, out_dir: str) -> None:
    """Start `world` workers. Fork where available: the children inherit the imported torch/transformers
    (~10 s per process otherwise on a busy 2-core machine); each child then joins a fresh gloo group."""
    import multiprocessing

    import torch.multiprocessing as mp

    import verl.distributed  # noqa: F401 - imported before forking so children do not re-import

    tiny_qwen2()
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    with rendezvous() as env:  # this process hosts the store: a port nothing else can take first
        mp.start_processes(fn, args=(world, int(env["MASTER_PORT"]), out_dir), nprocs=world, join=True,
                           start_method=method)


def setup(rank: int, world: int, port: int):
    """What torchrun would export (the store hosted by `launch`, as by torchrun's agent), then our own
    init_distributed reads it."""
    from verl.distributed.process import init_distributed

    torch.set_num_threads(1)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        TORCHELASTIC_USE_AGENT_STORE="True",
    )
    # The rendezvous waits for the slowest rank to start: 4 ranks importing torch and transformers beside another
    # test session on 2 cores have taken over 60 s (a collective that truly hangs fails after this as well).
    env = init_distributed(timeout_s=180)
    assert (env.rank, env.world_size, env.backend, env.device.type) == (rank, world, "gloo", "cpu")
    return env


def tiny_qwen2(seed: int = 0) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        tie_word_embeddings=False,
        use_cache=False,
    )
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(cfg).float()


def global_batch(seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 64, (GLOBAL_BATCH, SEQ_LEN), generator=g)


def sft_loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy; every row has the same token count, so rank means average exactly."""
    return model(input_ids=ids, labels=ids, use_cache=False).loss


def make_optimizer(model: torch.nn.Module, name: str) -> torch.optim.Optimizer:
    """SGD for weight equivalence: AdamW divides by sqrt(v), which turns float noise on parameters with a
    mathematically zero gradient (the attention key bias is softmax-invariant) into lr-sized updates."""
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=SGD_LR)
    return torch.optim.AdamW(model.parameters(), lr=LR)


def train(model, ids: torch.Tensor, steps: int, *, world_group=None, optimizer: str = "adamw") -> list[float]:
    """`steps` optimizer steps on `ids`; returns the global mean loss per step."""
    opt = make_optimizer(model, optimizer)
    losses = []
    for _ in range(steps):
        loss = sft_loss(model, ids)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        value = loss.detach().float().clone()
        if dist.is_initialized():
            dist.all_reduce(value, group=world_group)
            value /= dist.get_world_size(world_group)
        losses.append(float(value))
    return losses


def reference_run(optimizer: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, no FSDP, the whole global batch: what the sharded runs must reproduce."""
    model = tiny_qwen2()
    losses = train(model, global_batch(), STEPS, optimizer=optimizer)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


# --------------------------------------------------------------------------------------------------
def two_rank_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    """Equivalence run, the FSDPConfig matrix and the planted collective mismatch, in one process group."""
    from verl.config.fsdp import FSDPConfig, MixedPrecisionSpec
    from verl.distributed import CollectiveGuard, RoleGroups
    from verl.distributed.fsdp import apply_fsdp, full_state_dict
    from verl.distributed.mapping import validate_device_mapping
    from verl.errors import DistributedError

    setup(rank, world, port)
    mapping = validate_device_mapping(
        None,
        world_size=world,
        algorithm_needs_critic=False,
        needs_ref=False,
        needs_reward_model=False,
        role_dtypes={"actor": "float32"},
        visible_devices=None,
        cuda_visible_devices=None,
    )
    local_ids = global_batch().chunk(world)[rank]

    # 1. equivalence: actor FULL_SHARD over both ranks, each rank half of the global batch
    groups = RoleGroups.create(mapping, timeout_s=30)
    model = apply_fsdp(tiny_qwen2(), FSDPConfig(), mesh=groups.mesh("actor"))
    losses = train(model, local_ids, STEPS, optimizer="sgd")
    state = full_state_dict(model)
    if rank == 0:
        torch.save({"losses": losses, "state": state}, Path(out_dir) / "equivalence.pt")

    # 2. the matrix: every valid combination trains; fp32 ones match the reference step for step
    results = []
    strategies = [
        ("FULL_SHARD", None),
        ("SHARD_GRAD_OP", None),
        ("HYBRID_SHARD", 1),
        ("HYBRID_SHARD", 2),
        ("NO_SHARD", None),
    ]
    i = 0
    for strategy, hybrid in strategies:
        for mixed in (False, True):
            for ckpt in (False, True):
                for offload in (False, True):
                    cfg = FSDPConfig(
                        sharding_strategy=strategy,
                        hybrid_shard_size=hybrid,
                        mixed_precision=MixedPrecisionSpec() if mixed else False,
                        activation_checkpointing=ckpt,
                        cpu_offload=offload,
                        limit_all_gathers=bool(i % 2),
                        use_orig_params=True,
                    )
                    i += 1
                    cfg.check(world, uses_lora=False, device_type="cpu")
                    groups = RoleGroups.create(mapping, timeout_s=30, fsdp=cfg)
                    model = apply_fsdp(tiny_qwen2(), cfg, mesh=groups.mesh("actor"))
                    losses = train(model, local_ids, 2)
                    results.append((cfg.model_dump_json(), losses))
    if rank == 0:
        torch.save({"matrix": results}, Path(out_dir) / "matrix.pt")

    # 3. planted mismatches: a rank that never arrives, and ranks at different stages
    guard = CollectiveGuard(timeout_s=2)
    if rank == 0:
        try:
            guard.arrive("ref_logprobs", (0, 1))
        except DistributedError as err:
            Path(out_dir, "timeout.txt").write_text(str(err))
    groups = RoleGroups.create(mapping, timeout_s=5)
    try:
        if rank == 0:
            groups.all_reduce(torch.ones(2), "actor", stage="reward_scores")
        else:
            groups.barrier("actor", stage="critic_values")
    except DistributedError as err:
        Path(out_dir, f"mismatch{rank}.txt").write_text(str(err))
    dist.barrier()
    dist.destroy_process_group()


# --------------------------------------------------------------------------------------------------
def split_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    """actor [0,1], critic [2,3], ref [0], reward [3]: batches move between groups; FSDP per group."""
    from verl.config.fsdp import FSDPConfig
    from verl.distributed import RoleGroups
    from verl.distributed.fsdp import apply_fsdp
    from verl.distributed.mapping import validate_device_mapping

    setup(rank, world, port)
    mapping = validate_device_mapping(
        {"actor": [0, 1], "critic": [2, 3], "ref": [0], "reward": [3]},
        world_size=world,
        algorithm_needs_critic=True,
        needs_ref=True,
        needs_reward_model=True,
        role_dtypes={"actor": "float32", "critic": "float32", "ref": "float32", "reward": "float32"},
        visible_devices=None,
        cuda_visible_devices=None,
    )
    groups = RoleGroups.create(mapping, timeout_s=30)
    ids = global_batch()
    full = {
        "input_ids": ids,
        "mask": torch.ones(GLOBAL_BATCH, SEQ_LEN, dtype=torch.bool),
        "reward": torch.arange(GLOBAL_BATCH, dtype=torch.float64),
    }
    record: dict[str, object] = {}

    # rollout on the actor group: rank r holds rows of its data-parallel shard (uneven on purpose: 3 + 1)
    shard = None
    if groups.has("actor"):
        rows = slice(0, 3) if rank == 0 else slice(3, 4)
        shard = {k: v[rows] for k, v in full.items()}
    # the same sequence of transfers on every rank, in the same order
    to_ref = groups.move_batch(shard, "actor", "ref", stage="ref_logprobs")
    to_critic = groups.move_batch(shard, "actor", "critic", stage="critic_values")
    critic_out = None
    if to_critic is not None:
        critic_out = {**to_critic, "values": to_critic["reward"] * 10}
    to_reward = groups.move_batch(critic_out, "critic", "reward", stage="reward_scores")
    back = groups.move_batch(to_reward, "reward", "actor", stage="advantages")
    record.update(to_ref=to_ref, to_critic=to_critic, to_reward=to_reward, back=back)
    # shards of other widths cannot be concatenated: every actor rank refuses (none waits in the gather)
    from verl.errors import DistributedError

    try:
        groups.move_batch({"input_ids": ids[:1, : SEQ_LEN - rank]} if groups.has("actor") else None,
                          "actor", "ref", stage="ragged")
    except DistributedError as e:
        record["ragged"] = str(e)

    # each group trains its own FSDP model at the same time, on its own ranks only
    for role in ("actor", "critic"):
        if groups.has(role):
            model = apply_fsdp(tiny_qwen2(), FSDPConfig(), mesh=groups.mesh(role))
            local = full["input_ids"].chunk(2)[groups.ranks(role).index(rank)]
            record[f"{role}_losses"] = train(model, local, 1, world_group=groups.group(role))
    torch.save(record, Path(out_dir) / f"split{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


# --------------------------------------------------------------------------------------------------
RESPONSE_LEN = 4


def critic_batch() -> dict[str, torch.Tensor]:
    """A fixed PPO critic batch: left padding on odd rows, every row with RESPONSE_LEN response tokens
    (so each rank's token-mean loss averages exactly to the global token-mean)."""
    from verl.utils.positions import position_ids_from_mask as positions_from_mask

    g = torch.Generator().manual_seed(2)
    mask = torch.ones(GLOBAL_BATCH, SEQ_LEN, dtype=torch.long)
    mask[1::2, :2] = 0
    return {
        "input_ids": global_batch(),
        "attention_mask": mask,
        "position_ids": positions_from_mask(mask),
        "old_values": torch.randn(GLOBAL_BATCH, RESPONSE_LEN, generator=g),
        "returns": torch.randn(GLOBAL_BATCH, RESPONSE_LEN, generator=g),
        "response_mask": torch.ones(GLOBAL_BATCH, RESPONSE_LEN),
    }


def tiny_critic() -> torch.nn.Module:
    """ValueModel on the tiny actor with a non-zero head (the default zero head gives the backbone no
    gradient, which would make any gradient comparison vacuous)."""
    from verl.models.critic import ValueModel

    critic = ValueModel.from_actor(tiny_qwen2())
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        critic.value_head.weight.copy_(torch.randn(critic.value_head.weight.shape, generator=g))
        critic.value_head.bias.fill_(0.1)
    return critic


def critic_backward(critic: torch.nn.Module, batch: dict[str, torch.Tensor], *, in_place: bool) -> None:
    """The value loss as RLTrainer.update_critic computes it, then backward. With `in_place`, the raw
    critic output is first modified in place (an identity `mul_`), which a view output cannot survive."""
    from verl.algorithms.losses import value_loss
    from verl.trainer.forward.logprobs import response_values

    if in_place:
        raw = critic(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                     position_ids=batch["position_ids"])
        raw.mul_(1.0)
        values = raw[:, -RESPONSE_LEN - 1 : -1]
    else:
        values = response_values(critic, batch["input_ids"], batch["attention_mask"], batch["position_ids"],
                                 RESPONSE_LEN)
    loss, _ = value_loss(values, batch["old_values"], batch["returns"], batch["response_mask"], clip_range=0.2)
    loss.backward()


def critic_grads(critic: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Full (unsharded) gradients by parameter name; collective when the parameters are DTensors."""
    out = {}
    for name, p in critic.named_parameters():
        g = p.grad
        if g is not None and hasattr(g, "full_tensor"):
            g = g.full_tensor()
        out[name] = None if g is None else g.detach().clone()
    return out


def critic_grad_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    """FSDP2 critic on `world` ranks, each with its rows of the batch, vs one process on the whole batch."""
    import warnings

    from verl.config.fsdp import FSDPConfig
    from verl.distributed.fsdp import apply_fsdp

    setup(rank, world, port)
    batch = critic_batch()
    result: dict[str, object] = {}
    if rank == 0:
        reference = tiny_critic()
        critic_backward(reference, batch, in_place=False)
        result["reference"] = critic_grads(reference)

    critic = apply_fsdp(tiny_critic(), FSDPConfig())
    local = {k: v.chunk(world)[rank] for k, v in batch.items()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for in_place in (False, True):
            critic.zero_grad(set_to_none=True)
            critic_backward(critic, local, in_place=in_place)
            result["in_place" if in_place else "sharded"] = critic_grads(critic)
    result["warnings"] = [str(w.message) for w in caught]
    torch.save(result, Path(out_dir) / f"critic{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


# --------------------------------------------------------------------------------------------------
def chunked_batch() -> dict[str, torch.Tensor]:
    """2 prompts x 2 samples (left-padded prompts, right-padded responses) and per-token loss weights."""
    g = torch.Generator().manual_seed(4)
    prompt_mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]]).repeat_interleave(2, 0)
    prompt_ids = torch.randint(1, 64, (2, 4), generator=g).repeat_interleave(2, 0) * prompt_mask
    response_mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    response_ids = torch.randint(1, 64, (4, 5), generator=g) * response_mask
    weights = torch.randn(4, 5, generator=g) * response_mask
    return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "response_ids": response_ids,
            "response_mask": response_mask, "weights": weights}


def chunked_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor], *, chunked: bool, shared: bool | str,
                 scale: float) -> None:
    """A policy-gradient-shaped loss (weighted log-probs, an entropy bonus) at temperature 0.8, backward;
    `shared="packed"`: the rows packed into one (actor.remove_padding)."""
    from types import SimpleNamespace

    from verl.trainer.forward.logprobs import packed_logprobs, response_logprobs, shared_prompt_logprobs
    from verl.utils.positions import position_ids_from_mask

    kwargs = dict(temperature=0.8, with_entropy=True, chunked=chunked)
    if shared == "packed":
        mask = torch.cat([batch["prompt_mask"], batch["response_mask"]], 1)
        mb = SimpleNamespace(input_ids=torch.cat([batch["prompt_ids"], batch["response_ids"]], 1),
                             attention_mask=mask, position_ids=position_ids_from_mask(mask),
                             response_ids=batch["response_ids"], response_attention=batch["response_mask"])
        lp, ent = packed_logprobs(model, mb, **kwargs)
    elif shared:
        lp, ent = shared_prompt_logprobs(model, batch["prompt_ids"], batch["prompt_mask"], batch["response_ids"],
                                         batch["response_mask"], **kwargs)
    else:
        ids = torch.cat([batch["prompt_ids"], batch["response_ids"]], 1)
        mask = torch.cat([batch["prompt_mask"], batch["response_mask"]], 1)
        lp, ent = response_logprobs(model, ids, mask, position_ids_from_mask(mask), ids.shape[1] - 4, **kwargs)
    loss = (batch["weights"] * lp).sum() - 0.1 * (batch["response_mask"] * ent).sum()
    (loss * scale).backward()


def chunked_logprob_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    """The chunked log-probs of an FSDP2-sharded, tied-embedding policy on `world` ranks (each its rows) vs
    the plain log-probs of one unsharded process on all rows: full gradients per parameter."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from verl.config.fsdp import FSDPConfig
    from verl.distributed.fsdp import apply_fsdp

    setup(rank, world, port)

    def model() -> torch.nn.Module:
        cfg = Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                          tie_word_embeddings=True)
        torch.manual_seed(0)
        return Qwen2ForCausalLM(cfg).float()

    batch = chunked_batch()
    result: dict[str, object] = {}
    for shared in (False, True, "packed"):
        if rank == 0:
            reference = model()
            chunked_loss(reference, batch, chunked=False, shared=shared is True, scale=1.0)
            result[f"reference{shared}"] = critic_grads(reference)
        sharded = apply_fsdp(model(), FSDPConfig())
        local = {k: v.chunk(world)[rank] for k, v in batch.items()}
        chunked_loss(sharded, local, chunked=True, shared=shared, scale=float(world))  # FSDP2 averages
        result[f"chunked{shared}"] = critic_grads(sharded)
        result[f"gathered_after_backward{shared}"] = sharded._get_fsdp_state()._fsdp_param_group.is_unsharded
    from verl.trainer.forward.logprobs import response_logprobs
    from verl.utils.positions import position_ids_from_mask

    ids = torch.cat([batch["prompt_ids"], batch["response_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["response_mask"]], 1)
    rows = slice(rank * 4 // world, (rank + 1) * 4 // world)
    with torch.no_grad():  # a reference's pass: no backward reshards the head, the capture does
        got, _ = response_logprobs(sharded, ids[rows], mask[rows], position_ids_from_mask(mask)[rows], 5, chunked=True)
        result["gathered_after_no_grad"] = sharded._get_fsdp_state()._fsdp_param_group.is_unsharded
        if rank == 0:
            want, _ = response_logprobs(model(), ids, mask, position_ids_from_mask(mask), 5)
            result["no_grad"] = (got, want[rows])
    # LoRA: the peft wrapper over the FSDP2-sharded model (its Hugging Face model is the root, as
    # verl.trainer.compose.components.shard does it); the adapters' gradients against one plain process
    from verl.config.schema import LoraConfig
    from verl.models.lora import apply_lora, base_of

    def lora_model() -> torch.nn.Module:
        wrapped = apply_lora(model(), LoraConfig(rank=4))
        g = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for name, p in wrapped.named_parameters():
                if "lora_" in name:
                    p.copy_(0.1 * torch.randn(p.shape, generator=g))
        return wrapped

    if rank == 0:
        reference = lora_model()
        chunked_loss(reference, batch, chunked=False, shared=False, scale=1.0)
        result["lora_reference"] = {n: p.grad.clone() for n, p in reference.named_parameters() if p.grad is not None}
    wrapped = lora_model()
    apply_fsdp(base_of(wrapped), FSDPConfig())
    chunked_loss(wrapped, local, chunked=True, shared=False, scale=float(world))
    result["lora_chunked"] = {n: p.grad.full_tensor() for n, p in wrapped.named_parameters() if p.grad is not None}
    torch.save(result, Path(out_dir) / f"chunked{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def offload_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    """FSDP2 with and without CPUOffloadPolicy (`*.cpu_offload`), each rank its rows: the same gradients and
    the same weights after one AdamW step (on a CPU device the policy moves nothing but takes its own path:
    the optimizer steps on the offloaded shards)."""
    from verl.config.fsdp import FSDPConfig
    from verl.distributed.fsdp import apply_fsdp

    setup(rank, world, port)
    ids = global_batch().chunk(world)[rank]
    result: dict[str, object] = {}
    for offload in (False, True):
        model = apply_fsdp(tiny_qwen2(), FSDPConfig(cpu_offload=offload))
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        sft_loss(model, ids).backward()
        grads = critic_grads(model)
        opt.step()
        weights = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
        result[offload] = {"grads": grads, "weights": weights,
                           "offloads": model._get_fsdp_state()._fsdp_param_group.fsdp_params[0].offload_to_cpu}
    torch.save(result, Path(out_dir) / f"offload{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()
