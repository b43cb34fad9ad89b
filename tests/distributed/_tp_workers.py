"""Workers of the tensor-parallel tests (tests/distributed/test_tensor_parallel.py): gloo on CPU, float32.

Each rank also computes the single-process reference itself (a plain copy of the same weights, no
collectives), so a test compares what one process computes alone with what the TP group computes split."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from _dist_workers import setup
from torch.distributed.tensor import DTensor

TEMPERATURE = 0.7
ROWS, WIDTH = 4, 12
ENTROPY_COEF = 0.01
MAX_NORM = 0.05  # below every model's gradient norm here: the clipping scales


def tiny_path() -> str:
    """The tiny local Qwen2 (tied embeddings, vocabulary 768): 4 heads, 2 KV heads, intermediate 64."""
    from verl.models.tiny import build_tiny_model

    return build_tiny_model(hidden_size=32, num_heads=4, num_kv_heads=2, intermediate_size=64)


def build(kind: str) -> torch.nn.Module:
    """A float32 causal LM, the same weights on every call: the tiny Qwen2 from disk (tied, sdpa), or an untied
    Llama (eager attention) or Qwen3 (sdpa, q/k norms) made from a config."""
    if kind == "qwen2_tied":
        from transformers import AutoModelForCausalLM

        from verl.models.hf_loader import without_hub_kernels

        model = AutoModelForCausalLM.from_pretrained(tiny_path(), dtype=torch.float32, attn_implementation="sdpa")
        return without_hub_kernels(model).float()
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    common = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False, use_cache=False)
    if kind == "llama":
        cfg, cls, attn = LlamaConfig(**common), LlamaForCausalLM, "eager"
    else:
        cfg, cls, attn = Qwen3Config(head_dim=8, **common), Qwen3ForCausalLM, "sdpa"
    cfg._attn_implementation = attn
    torch.manual_seed(0)
    return cls(cfg).float()


def batch(vocab: int, seed: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [ROWS, WIDTH] and per-token advantages [ROWS, WIDTH - 1]."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (ROWS, WIDTH), generator=g), torch.randn(ROWS, WIDTH - 1, generator=g)


def grpo_loss(logprobs: torch.Tensor, entropy: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
    """A GRPO-like loss: mean of -logprob * advantage, minus an entropy bonus."""
    return (-logprobs * advantages).mean() - ENTROPY_COEF * entropy.mean()


def reference(model: torch.nn.Module, ids: torch.Tensor, adv: torch.Tensor) -> dict:
    """The single-process numbers: verl's own log-prob and entropy functions on the whole logits."""
    from verl.algorithms import entropy_from_logits, token_logprobs

    logits = model(input_ids=ids[:, :-1], use_cache=False).logits
    logprobs = token_logprobs(logits, ids[:, 1:], temperature=TEMPERATURE)
    entropy = entropy_from_logits(logits, temperature=TEMPERATURE)
    loss = grpo_loss(logprobs, entropy, adv)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM))
    torch.optim.SGD(model.parameters(), lr=1.0).step()
    return {"logprobs": logprobs.detach(), "entropy": entropy.detach(), "loss": float(loss.detach()),
            "grads": grads, "norm": norm, "state": model.state_dict()}


def split(model: torch.nn.Module, ids: torch.Tensor, adv: torch.Tensor) -> dict:
    """The same numbers from a TP model: logits stay sharded over the vocabulary; gradients gathered whole;
    then a clipped SGD step and the full state dict (gathered on rank 0)."""
    from verl.distributed.fsdp import full_state_dict
    from verl.distributed.tensor_parallel import clip_grad_norm_, vocab_parallel_logprobs

    logits = model(input_ids=ids[:, :-1], use_cache=False).logits
    assert isinstance(logits, DTensor), type(logits)
    local_width = logits.to_local().shape[-1]
    logprobs, entropy = vocab_parallel_logprobs(logits, ids[:, 1:], temperature=TEMPERATURE)
    loss = grpo_loss(logprobs, entropy, adv)
    loss.backward()
    layouts = {n: (p.grad.placements, p.grad.to_local().shape) == (p.placements, p.to_local().shape)
               for n, p in model.named_parameters() if isinstance(p, DTensor)}
    grads = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
             for n, p in model.named_parameters()}
    norm = float(clip_grad_norm_(model.parameters(), MAX_NORM))
    torch.optim.SGD(model.parameters(), lr=1.0).step()
    return {"logprobs": logprobs.detach(), "entropy": entropy.detach(), "loss": float(loss.detach()), "grads": grads,
            "norm": norm, "state": full_state_dict(model), "local_vocab": (local_width, logits.shape[-1]),
            "layouts": layouts, "tied": model.lm_head.weight is model.model.embed_tokens.weight}


def _finish(out: dict, out_dir: str, name: str, rank: int) -> None:
    torch.save(out, Path(out_dir) / f"{name}{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


# --------------------------------------------------------------------------------------------------
def tp_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    """TP over all ranks: each architecture against one process, the float64 reference of the vocabulary-
    parallel log-probs (local shards and DTensor input) against log_softmax on the whole logits, and the
    sampler's tokens."""
    from torch.distributed.device_mesh import init_device_mesh

    from verl.distributed.tensor_parallel import apply_tensor_parallel

    setup(rank, world, port)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    out: dict = {}
    for kind in ("qwen2_tied", "llama", "qwen3"):
        plain = build(kind)
        ids, adv = batch(plain.config.vocab_size)
        out[kind] = {"want": reference(plain, ids, adv),
                     "got": split(apply_tensor_parallel(build(kind), mesh), ids, adv)}
    out["float64"] = float64_case(rank, world, mesh)
    out["meta"] = meta_case(mesh)
    out["sampler"] = sampler_case(mesh)
    out["deferred"] = deferred_case(mesh)
    _finish(out, out_dir, "tp", rank)


def deferred_case(tp_mesh, dp_mesh=None) -> dict:
    """The tiny Qwen2 built on the meta device with its weights deferred to its safetensors file (as a sharded
    start-up builds it), split over `tp_mesh` (and FSDP2-sharded over `dp_mesh`), then materialised: each rank
    reads its rows and columns. The full state dict (gathered on rank 0) and the share of the file read."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from verl.config.fsdp import FSDPConfig
    from verl.distributed.fsdp import apply_fsdp, full_state_dict
    from verl.distributed.tensor_parallel import apply_tensor_parallel
    from verl.models.sharded_load import bytes_read, defer_weights, materialise

    path = tiny_path()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=torch.float32)
    assert defer_weights(model, path)
    apply_tensor_parallel(model, tp_mesh)
    if dp_mesh is not None:
        apply_fsdp(model, FSDPConfig(), mesh=dp_mesh)
    before = bytes_read()
    materialise(model, "cpu")
    read = bytes_read() - before
    return {"state": full_state_dict(model), "read": read / (Path(path) / "model.safetensors").stat().st_size}


def sampler_case(mesh) -> dict:
    """verl's sampler (HFKVCacheEngine: prefill, KV cache, decode) on the TP-split model and on the plain one,
    left-padded prompts, greedy and at temperature 1 with the same generator: {name: {temperature: (response
    ids, log-probs)}}."""
    from verl.distributed.tensor_parallel import apply_tensor_parallel
    from verl.rollout.base import SamplingParams
    from verl.rollout.hf_engine import HFKVCacheEngine

    g = torch.Generator().manual_seed(11)
    ids = torch.randint(0, 768, (3, 6), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding, as prompts of different lengths come
    mask[2, :4] = 0
    out: dict = {}
    for name, model in (("want", build("qwen2_tied")), ("got", apply_tensor_parallel(build("qwen2_tied"), mesh))):
        engine = HFKVCacheEngine(model)
        out[name] = {}
        for temperature in (0.0, 1.0):
            params = SamplingParams(temperature=temperature, max_new_tokens=8, pad_token_id=0)
            res = engine.generate(ids, mask, params, generator=torch.Generator().manual_seed(3))
            out[name][temperature] = (res.response_ids, res.logprobs)
    return out


def meta_case(mesh) -> dict:
    """A model built on the meta device, split, then loaded from a full state dict that only rank 0 holds
    (the way a sharded role starts): the same log-probs as the plain model."""
    from verl.algorithms import token_logprobs_and_entropy
    from verl.distributed.fsdp import load_full_state_dict
    from verl.distributed.tensor_parallel import apply_tensor_parallel, vocab_parallel_logprobs

    plain = build("qwen2_tied")
    with torch.device("meta"):
        model = type(plain)(plain.config)
    apply_tensor_parallel(model, mesh)
    model.to_empty(device="cpu")
    state = dict(plain.state_dict()) if dist.get_rank() == 0 else {}  # (the load replaces the dict's values)
    load_full_state_dict(model, state, from_rank0=True)
    buffers = dict(plain.named_buffers())
    with torch.no_grad():
        for name, buffer in model.named_buffers():  # rotary buffers: not in a state dict, recomputed on load
            buffer.copy_(buffers[name])
        ids, _ = batch(plain.config.vocab_size)
        got = vocab_parallel_logprobs(model(input_ids=ids[:, :-1]).logits, ids[:, 1:], temperature=TEMPERATURE)
        want = token_logprobs_and_entropy(plain(input_ids=ids[:, :-1]).logits, ids[:, 1:], temperature=TEMPERATURE)
    return {"got": got, "want": want, "tied": model.lm_head.weight is model.model.embed_tokens.weight}


def float64_case(rank: int, world: int, mesh) -> dict:
    """vocab_parallel_logprobs on float64 logits [3, 5, 16] (large scale, banned -inf tokens, a label at each
    shard's edge) against log_softmax on the whole logits: values and the gradients of a weighted sum."""
    from verl.distributed.tensor_parallel import vocab_parallel_logprobs

    g = torch.Generator().manual_seed(11)
    full = torch.randn(3, 5, 16, generator=g, dtype=torch.float64) * 30
    full[0, 0, 3] = full[1, 2, 9] = float("-inf")
    labels = torch.randint(0, 16, (3, 5), generator=g)
    labels[0, :4] = torch.tensor([0, 7, 8, 15])
    w_lp, w_ent = torch.randn(3, 5, generator=g, dtype=torch.float64), torch.randn(3, 5, generator=g,
                                                                                     dtype=torch.float64)
    t = 0.9
    whole = full.clone().requires_grad_(True)
    logp = torch.log_softmax(whole / t, -1)
    want_lp = logp.gather(-1, labels[..., None]).squeeze(-1)
    want_ent = -(logp.exp() * torch.where(logp.isinf(), torch.zeros_like(logp), logp)).sum(-1)
    ((w_lp * want_lp).sum() + (w_ent * want_ent).sum()).backward()
    width = 16 // world
    res = {"want": (want_lp.detach(), want_ent.detach(), whole.grad)}
    for name in ("local", "dtensor"):
        shard = full[..., rank * width:(rank + 1) * width].clone().requires_grad_(True)
        if name == "local":
            lp, ent = vocab_parallel_logprobs(shard, labels, mesh.get_group(), temperature=t)
        else:
            lp, ent = vocab_parallel_logprobs(DTensor.from_local(shard, mesh, [torch.distributed.tensor.Shard(2)]),
                                              labels, temperature=t)
        ((w_lp * lp).sum() + (w_ent * ent).sum()).backward()
        parts = [torch.empty_like(shard) for _ in range(world)]
        dist.all_gather(parts, shard.grad.contiguous())
        res[name] = (lp.detach(), ent.detach(), torch.cat(parts, -1))
    return res


def dp_tp_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    """TP=2 inside, FSDP2 over dp=2 (4 ranks): each dp rank its half of the rows; log-probs, entropy, loss and
    the gradients (averaged over dp by FSDP2, gathered whole) against one process on all rows."""
    from verl.config.fsdp import FSDPConfig
    from verl.distributed.fsdp import apply_fsdp
    from verl.distributed.tensor_parallel import apply_tensor_parallel, dp_tp_mesh

    setup(rank, world, port)
    mesh = dp_tp_mesh(world // 2, 2)
    dp = mesh["dp"].get_local_rank()
    out: dict = {"coords": (dp, mesh["tp"].get_local_rank())}
    for kind in ("qwen2_tied", "llama", "qwen3"):
        plain = build(kind)
        ids, adv = batch(plain.config.vocab_size)
        want = reference(plain, ids, adv)
        model = apply_tensor_parallel(build(kind), mesh["tp"])
        apply_fsdp(model, FSDPConfig(), mesh=mesh["dp"])
        rows = slice(dp * ROWS // 2, (dp + 1) * ROWS // 2)
        got = split(model, ids[rows], adv[rows])
        want["logprobs"], want["entropy"] = want["logprobs"][rows], want["entropy"][rows]
        want["loss"] = float(grpo_loss(want["logprobs"], want["entropy"], adv[rows]))  # this rank's rows' loss
        out[kind] = {"want": want, "got": got, "rows": (rows.start, rows.stop)}
    out["deferred"] = deferred_case(mesh["tp"], mesh["dp"])
    _finish(out, out_dir, "dptp", rank)
