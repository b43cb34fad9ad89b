"""GPU check: rollout tokens/s (ours vs HF generate), GRPO update MFU, peak memory and seconds per stage.

On the H200 (``--device cuda``, the default shape): a random Qwen2.5-0.5B-shaped model (hidden 896, 24
layers, 14 heads / 2 KV heads, MLP 4864, vocab 151,936) in bfloat16; 64 prompts x 8 samples, 256 new
tokens; 10 GRPO steps of the real trainer. ``--device cpu --small`` runs the same code on a tiny shape for
a smoke test anywhere. Prints a table and a final ratio line; writes ``gpu_check.json`` under ``--out``.

Targets (checked and reported, on CUDA only): our sampler >= 3x HF generate tokens/s; update MFU >= 35%;
no step's wall time above 1.2x the sum of its stages.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import time
from pathlib import Path

import torch

QWEN05B = dict(hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, intermediate_size=4864,
               vocab_size=151936, max_position_embeddings=2048)
SMALL = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=256, vocab_size=768,
             max_position_embeddings=1024)
PEAK_BF16_TFLOPS = {"H200": 989.5, "H100": 989.5, "A100": 312.0}  # dense bf16, no sparsity


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _timed(fn, device: torch.device) -> tuple[float, object]:
    _sync(device)
    start = time.perf_counter()
    out = fn()
    _sync(device)
    return time.perf_counter() - start, out


def _peak_tflops(device: torch.device, override: float | None) -> float | None:
    if override:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)


def build_model_dir(shape: dict, out: Path, device: torch.device, dtype: torch.dtype) -> str:
    """A random model of `shape` saved with the tiny local tokenizer (ids below 8192 are a subset of any
    larger vocabulary, as a padded vocabulary is in Qwen2.5), built directly on `device`."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from verl.models.tiny import build_tiny_model

    tiny = build_tiny_model()
    cfg = AutoConfig.from_pretrained(tiny)
    cfg.update({"hidden_size": shape["hidden_size"], "num_hidden_layers": shape["num_layers"],
                "num_attention_heads": shape["num_heads"], "num_key_value_heads": shape["num_kv_heads"],
                "intermediate_size": shape["intermediate_size"], "vocab_size": shape["vocab_size"],
                "max_position_embeddings": shape["max_position_embeddings"], "tie_word_embeddings": True})
    if hasattr(cfg, "layer_types"):
        cfg.layer_types = ["full_attention"] * shape["num_layers"]
    path = out / "model"
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny).save_pretrained(path)
    return str(path)


def rollout_benchmark(model, args, device: torch.device, vocab: int) -> dict:
    """Same prompts, same number of sampled tokens (no eos stop): our sampler against model.generate."""
    from verl.rollout import HFKVCacheEngine, SamplingParams

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, vocab, (args.prompts, args.prompt_len), generator=g)
    lengths = torch.randint(args.prompt_len // 2, args.prompt_len + 1, (args.prompts,), generator=g)
    mask = (torch.arange(args.prompt_len) >= (args.prompt_len - lengths).unsqueeze(1)).long()
    ids, mask = ids.masked_fill(mask == 0, 0).to(device), mask.to(device)
    params = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens, n=args.samples)
    tokens = args.prompts * args.samples * args.new_tokens
    compile_ok = "compile" in inspect.signature(HFKVCacheEngine.__init__).parameters
    engine = HFKVCacheEngine(model, **({"compile": True} if compile_ok and args.compile else {}))
    gen = torch.Generator(device=device).manual_seed(0)
    warm = SamplingParams(temperature=1.0, max_new_tokens=min(8, args.new_tokens), n=args.samples)
    engine.generate(ids, mask, warm, generator=gen)  # warm-up (and compilation, when on)
    ours_s, _ = _timed(lambda: engine.generate(ids, mask, params, generator=gen), device)
    rep_ids, rep_mask = ids.repeat_interleave(args.samples, 0), mask.repeat_interleave(args.samples, 0)
    model.generate(input_ids=rep_ids[:2], attention_mask=rep_mask[:2], do_sample=True, max_new_tokens=4,
                   min_new_tokens=4, pad_token_id=0)  # warm-up
    hf_s, _ = _timed(lambda: model.generate(input_ids=rep_ids, attention_mask=rep_mask, do_sample=True,
                                            top_k=0, max_new_tokens=args.new_tokens,
                                            min_new_tokens=args.new_tokens, pad_token_id=0), device)
    return {"rollout_tokens": tokens, "ours_s": ours_s, "hf_generate_s": hf_s,
            "ours_tokens_per_s": tokens / ours_s, "hf_tokens_per_s": tokens / hf_s,
            "speedup_vs_hf": hf_s / ours_s, "compiled": bool(compile_ok and args.compile),
            "compile_available": compile_ok}


def grpo_benchmark(model_dir: str, args, device: torch.device, n_params: int, peak: float | None) -> dict:
    """`args.steps` GRPO steps of the real RLTrainer; per-stage seconds, step wall time, update MFU."""
    from verl.config import load_config
    from verl.trainer.rl_trainer import RLTrainer

    class Timed(RLTrainer):
        def step(self):
            _sync(self.device)
            start = time.perf_counter()
            metrics = super().step()
            _sync(self.device)
            metrics["bench/step_wall_s"] = time.perf_counter() - start
            return metrics

        def update_policy(self, batch):  # tokens the update runs over (prompt + response, no padding)
            self.bench_tokens = int(batch.attention_mask.sum())
            return super().update_policy(batch)

    run_dir = Path(args.out) / "grpo_run"
    config = load_config(overrides=[
        f"model.path={model_dir}", "model.dtype=auto", f"trainer.device={device.type}",
        "env.name=arithmetic", "env.kwargs.num_val=0", f"data.train_batch_size={args.prompts}",
        f"data.max_prompt_length={args.prompt_len * 4}", f"rollout.n={args.samples}",
        f"rollout.max_new_tokens={args.new_tokens}", f"actor.micro_batch_size={args.micro_batch}",
        "actor.lr=1e-6", f"trainer.total_steps={args.steps}", f"trainer.run_dir={run_dir}",
        "trainer.val_before_train=false", "trainer.resume=never", "logging.backends=[jsonl]",
        "checkpoint.save_interval=0", "rollout.max_logprob_drift=null",
    ] + (["trainer.cpu_threads=1"] if device.type == "cpu" else []))
    trainer = Timed(config)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    update_flops, rows = [], []
    original = trainer.step

    def step_and_count():
        metrics = original()
        update_flops.append(6.0 * n_params * trainer.bench_tokens * config.actor.ppo_epochs)
        rows.append(metrics)
        return metrics

    trainer.step = step_and_count
    trainer.fit()
    stages = sorted({k.removeprefix("timing/") for r in rows for k in r if k.startswith("timing/")} - {"step"})
    per_stage = {s: sum(r.get(f"timing/{s}", 0.0) for r in rows) / len(rows) for s in stages}
    ratios = [r["bench/step_wall_s"] / max(r["timing/step"], 1e-9) for r in rows]
    update_s = [r["timing/update"] for r in rows]
    mfu = None
    if peak:
        mfu = sum(update_flops) / sum(update_s) / (peak * 1e12)
    return {"steps": len(rows), "seconds_per_stage": per_stage,
            "step_wall_s": [r["bench/step_wall_s"] for r in rows], "step_stage_sum_s": [r["timing/step"] for r in rows],
            "worst_step_over_stage_sum": max(ratios), "update_tflops": sum(update_flops) / sum(update_s) / 1e12,
            "update_mfu": mfu, "peak_gpu_memory_gib": (torch.cuda.max_memory_allocated() / 2**30
                                                       if device.type == "cuda" else None),
            "rollout_tokens_per_s_in_training": [r.get("perf/tokens_per_s") for r in rows]}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--small", action="store_true", help="tiny shapes: a smoke test of this script")
    parser.add_argument("--out", default=os.environ.get("OUT", "gpu_check_out"))
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--prompts", type=int, default=None)
    parser.add_argument("--samples", type=int, default=None)
    parser.add_argument("--new-tokens", type=int, default=None)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--micro-batch", type=int, default=None)
    parser.add_argument("--no-compile", dest="compile", action="store_false")
    parser.add_argument("--peak-tflops", type=float, default=None, help="device peak bf16 TFLOPS for MFU")
    parser.add_argument("--skip-grpo", action="store_true")
    args = parser.parse_args(argv)
    small = args.small
    args.steps = args.steps or (2 if small else 10)
    args.prompts = args.prompts or (4 if small else 64)
    args.samples = args.samples or (2 if small else 8)
    args.new_tokens = args.new_tokens or (8 if small else 256)
    args.micro_batch = args.micro_batch or (4 if small else 32)
    if small:
        args.prompt_len = min(args.prompt_len, 8)
    args.dtype = "bfloat16" if args.device == "cuda" else "float32"
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but no CUDA device is visible; use --device cpu --small for a smoke run")
    if device.type == "cpu":
        torch.set_num_threads(1)
    Path(args.out).mkdir(parents=True, exist_ok=True)

    from transformers import AutoModelForCausalLM

    shape = SMALL if small else QWEN05B
    t0 = time.perf_counter()
    dtype = getattr(torch, args.dtype)
    model_dir = build_model_dir(shape, Path(args.out), device, dtype)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa").to(device).eval()
    n_params = sum(p.numel() for p in model.parameters())
    build_s = time.perf_counter() - t0
    peak = _peak_tflops(device, args.peak_tflops)
    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
              "torch": torch.__version__, "shape": shape, "params": n_params, "dtype": args.dtype,
              "prompts": args.prompts, "samples": args.samples, "new_tokens": args.new_tokens,
              "model_build_s": build_s, "peak_tflops": peak}
    result["rollout"] = rollout_benchmark(model, args, device, shape["vocab_size"])
    # written now and again at the end: a GRPO part cut off by its time limit keeps the rollout figures
    (Path(args.out) / "gpu_check.json").write_text(json.dumps(result, indent=2))
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if not args.skip_grpo:
        result["grpo"] = grpo_benchmark(model_dir, args, device, n_params, peak)
    on_gpu = device.type == "cuda" and not small
    r, g = result["rollout"], result.get("grpo", {})
    result["targets"] = {
        "sampler_speedup_ge_3x": (r["speedup_vs_hf"] >= 3.0) if on_gpu else None,
        "update_mfu_ge_35pct": (g.get("update_mfu") is not None and g["update_mfu"] >= 0.35) if on_gpu and g else None,
        "step_le_1_2x_stage_sum": (g["worst_step_over_stage_sum"] <= 1.2) if g else None,
    }
    (Path(args.out) / "gpu_check.json").write_text(json.dumps(result, indent=2))
    print(f"{'measure':<36} value")
    print(f"{'-' * 36} {'-' * 20}")
    print(f"{'device / params':<36} {result['device']} / {n_params / 1e6:.1f}M {args.dtype}")
    print(f"{'rollout tokens/s: ours':<36} {r['ours_tokens_per_s']:.0f} (compiled: {r['compiled']})")
    print(f"{'rollout tokens/s: HF generate':<36} {r['hf_tokens_per_s']:.0f}")
    if g:
        for stage, secs in g["seconds_per_stage"].items():
            print(f"{'seconds/step: ' + stage:<36} {secs:.3f}")
        mfu = f"{g['update_mfu'] * 100:.1f}%" if g["update_mfu"] is not None else "n/a (no known peak)"
        print(f"{'update TFLOPS / MFU':<36} {g['update_tflops']:.2f} / {mfu}")
        print(f"{'worst step wall / stage sum':<36} {g['worst_step_over_stage_sum']:.3f}")
        mem = g["peak_gpu_memory_gib"]
        print(f"{'peak GPU memory':<36} {'n/a (cpu)' if mem is None else f'{mem:.2f} GiB'}")
    print(f"targets: {result['targets']}")
    print(f"ratio: ours / HF generate tokens/s = {r['speedup_vs_hf']:.2f}x")
    return result


if __name__ == "__main__":
    main()
