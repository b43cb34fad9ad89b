"""Experiment for ``rollout.compile``: the decode step compiled with torch.compile on a static KV cache,
against verl's eager fast decode step (``HFKVCacheEngine``), on the same prompts, seed and sampler.

The compiled step is written here, not in ``verl/``: it decides whether the option is worth having. It
takes the eager step's fused projections (as plain matmuls), keeps a KV cache of fixed shape
[rows, kv_heads, prompt + new tokens, head_dim] written with ``index_copy_`` at a slot given as a
tensor, and attends over the whole cache with a mask of the filled slots, so every step has the same
shapes and one compiled graph serves the whole rollout (no eos stopping: rows are never dropped).

Prints the first call's cost (compilation included), steady-state per-rollout seconds of both sides as
interleaved rounds at 1 thread, whether both sampled the same tokens, and a final ratio line.
Run: ``python benchmarks/rollout_compile.py --model tiny:qwen2:256:10 --batch 4 --n 4 --new-tokens 32``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ab import interleaved, ratio_line  # noqa: E402
from dpo import model_dir  # noqa: E402
from rollout import _prompts  # noqa: E402


def static_decode_step(decode: Any) -> Any:
    """A pure function of (tokens, positions, slot, mask, k caches, v caches) -> logits, over ``decode``'s
    prepared weights (a prepared ``LlamaStyleDecodeStep`` whose projections are all plain)."""
    from verl.rollout.fast_decode import _Linear

    layers = []
    for layer, plan in zip(decode.layers, decode.plans, strict=True):
        attn = layer.self_attn
        lins = (plan.qkv, plan.o, plan.gate_up, plan.down)
        if not all(isinstance(lin, _Linear) for lin in lins) or hasattr(attn, "q_norm"):
            raise SystemExit("the compiled step needs plain Llama/Qwen2 projections (no LoRA, no q/k norms)")
        kv_heads = attn.k_proj.weight.shape[0] // attn.head_dim
        layers.append((lins, layer.input_layernorm, layer.post_attention_layernorm, kv_heads, attn.head_dim,
                       attn.scaling))
    embed = decode.base.embed_tokens.weight
    final_norm, lm_head = decode.base.norm, decode.lm_head
    cos_table, sin_table = decode.cos, decode.signed_sin

    def norm(x: torch.Tensor, module: Any) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), module.weight, module.variance_epsilon)

    def mm(x: torch.Tensor, lin: Any) -> torch.Tensor:
        out = x @ lin.weight if lin.kernel == "mm" else F.linear(x, lin.weight)
        return out if lin.bias is None else out + lin.bias

    def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat([x2, x1], dim=-1) * sin

    def step(tokens: torch.Tensor, positions: torch.Tensor, slot: torch.Tensor, mask: torch.Tensor,
             k_cache: list[torch.Tensor], v_cache: list[torch.Tensor]) -> torch.Tensor:
        rows = tokens.shape[0]
        filled = mask & (torch.arange(mask.shape[-1], device=mask.device) <= slot)
        hidden = F.embedding(tokens, embed)
        cos, sin = cos_table[positions].unsqueeze(1), sin_table[positions].unsqueeze(1)
        for i, ((qkv, o, gate_up, down), in_norm, post_norm, kv_heads, head_dim, scaling) in enumerate(layers):
            states = mm(norm(hidden, in_norm), qkv).view(rows, -1, head_dim)
            q_heads = states.shape[1] - 2 * kv_heads
            qk = rope(states[:, : q_heads + kv_heads], cos, sin)
            k_cache[i].index_copy_(2, slot, qk[:, q_heads:].unsqueeze(2))
            v_cache[i].index_copy_(2, slot, states[:, q_heads + kv_heads:].unsqueeze(2))
            q = qk[:, :q_heads].reshape(rows, kv_heads, -1, head_dim)
            out = F.scaled_dot_product_attention(q, k_cache[i], v_cache[i], attn_mask=filled, scale=scaling)
            hidden = hidden + mm(out.reshape(rows, -1), o)
            gate, up = mm(norm(hidden, post_norm), gate_up).chunk(2, dim=-1)
            hidden = hidden + mm(F.silu(gate) * up, down)
        return mm(norm(hidden, final_norm), lm_head)

    return step


def engine_cache_kw(model: Any) -> str:
    """The cache keyword of this model's forward (``cache`` in newer transformers)."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def static_rollout(model: Any, step: Any, ids: torch.Tensor, mask: torch.Tensor, params: Any,
                   generator: torch.Generator) -> torch.Tensor:
    """The engine's rollout (shared-prompt prefill, then one step per token) on a static cache."""
    from verl.rollout.sampling import sample_step
    from verl.utils.positions import position_ids_from_mask

    try:
        from transformers.cache_utils import DynamicCache
    except ImportError:  # pragma: no cover
        raise SystemExit("needs transformers with DynamicCache") from None
    n, max_new = params.n, params.max_new_tokens
    batch, prompt_len = ids.shape
    rows, cap = batch * n, prompt_len + max_new
    with torch.inference_mode():
        mask_bool = mask.bool()
        positions = position_ids_from_mask(mask_bool)
        cache = DynamicCache(config=model.config)
        out = model(input_ids=ids.masked_fill(~mask_bool, 0), attention_mask=mask_bool.long(),
                    position_ids=positions, use_cache=True, logits_to_keep=1, **{engine_cache_kw(model): cache})
        logits = out.logits[:, -1, :].repeat_interleave(n, dim=0)
        k_cache, v_cache = [], []
        for layer in cache.layers:
            for src, dst in ((layer.keys, k_cache), (layer.values, v_cache)):
                buf = src.new_zeros(rows, src.shape[1], cap, src.shape[3])
                buf[:, :, :prompt_len] = src.repeat_interleave(n, dim=0)
                dst.append(buf)
        next_pos = (positions[:, -1] + 1).repeat_interleave(n, dim=0)
        decode_mask = torch.cat([mask_bool.repeat_interleave(n, dim=0), mask_bool.new_ones(rows, max_new)],
                                dim=1)[:, None, None, :]
        response = torch.zeros(rows, max_new, dtype=torch.long)
        for t in range(max_new):
            tokens, _ = sample_step(logits, float(params.temperature), params.top_k, float(params.top_p),
                                    generator)
            response[:, t] = tokens
            if t == max_new - 1:
                break
            slot = torch.tensor([prompt_len + t])
            logits = step(tokens, next_pos, slot, decode_mask, k_cache, v_cache)
            next_pos = next_pos + 1
    return response


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny:qwen2:256:10")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--mode", default=None, help="torch.compile mode (default: inductor's default)")
    parser.add_argument("--freezing", action="store_true", help="inductor freezing (weights as constants, "
                        "prepacked matmuls)")
    parser.add_argument("--no-compile", action="store_true", help="run the static step eagerly (isolates "
                        "the static cache from the compiler)")
    args = parser.parse_args(argv)

    from transformers import AutoModelForCausalLM

    from verl.rollout import HFKVCacheEngine, SamplingParams

    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(model_dir(args.model), dtype=torch.float32).eval()
    vocab = model.get_input_embeddings().num_embeddings
    ids, mask = _prompts(args.batch, args.prompt_len, vocab, args.seed)
    params = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=args.new_tokens,
                            eos_token_ids=[], pad_token_id=0, n=args.n)
    engine = HFKVCacheEngine(model)
    if engine.fast_decode_reason:
        raise SystemExit(f"the eager fast step does not apply: {engine.fast_decode_reason}")
    eager_ids = engine.generate(ids, mask, params, torch.Generator().manual_seed(args.seed)).response_ids
    from verl.rollout.fast_decode import LlamaStyleDecodeStep

    decode = LlamaStyleDecodeStep(model)
    with torch.inference_mode():
        decode.prepare(ids.shape[1] + args.new_tokens, torch.device("cpu"), torch.float32)
    step = static_decode_step(decode)
    if not args.no_compile:
        import torch._inductor.config as inductor_config

        inductor_config.freezing = args.freezing
        step = torch.compile(step, fullgraph=True, dynamic=False, mode=args.mode)

    def first() -> torch.Tensor:
        return static_rollout(model, step, ids, mask, params, torch.Generator().manual_seed(args.seed))

    start = time.perf_counter()
    static_ids = first()
    first_s = time.perf_counter() - start
    same = torch.equal(static_ids, eager_ids)
    generator = torch.Generator().manual_seed(args.seed)
    result = interleaved(lambda: engine.generate(ids, mask, params, generator),
                         lambda: static_rollout(model, step, ids, mask, params, generator), args.rounds)
    name = "eager static step" if args.no_compile else f"compiled step (mode={args.mode}, freezing={args.freezing})"
    print(f"{args.model}: batch {args.batch} x n {args.n}, prompt <= {args.prompt_len}, {args.new_tokens} new "
          f"tokens, {args.threads} thread(s)")
    print(f"first call of the {name}: {first_s:.2f}s (one rollout, compilation included); "
          f"steady state {result['candidate_s']:.3f}s per rollout, eager engine {result['baseline_s']:.3f}s")
    print(f"same tokens as the eager engine under seed {args.seed}: {same}")
    print(ratio_line(name, result, "eager HFKVCacheEngine"))
    return float(result["ratio"])


if __name__ == "__main__":
    import doc_table

    raise SystemExit(doc_table.run(main, doc_table.prefixed("first call", "same tokens", "ratio"),
                                   doc=doc_table.ROOT / "docs" / "optimizations.md"))
