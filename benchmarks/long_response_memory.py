"""Peak memory of one GRPO update on one long response, plain vs chunked log-probs, against the memory plan.

Run by hand (not a test):
    python benchmarks/long_response_memory.py [--tokens 2048 8192 16384] [--rss-tokens 2048] [--layers 24]

The model has Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 heads, 2 KV heads, intermediate 4864, the real
vocabulary of 151,936, tied embeddings) with random weights, float32, sdpa attention, activation checkpointing
per layer (`fsdp.activation_checkpointing`: without it 8k tokens keep 22 GB of activations whatever happens
to the logits). The update is one micro-batch of one response after a 64-token prompt: the log-probs
(`verl.trainer.forward.logprobs.response_logprobs`, entropy for logging) with `actor.chunked_logprobs` false (plain) or
true (chunked), the PPO-clip loss against detached old log-probs with random advantages (token mean), and its
backward. The weights' gradients exist before it starts, as from an earlier micro-batch of the same update;
"above state" is the peak beyond weights + gradients, which is what the response length changes.

Each case runs in a fresh child process, measured one of two ways:
* tracked (every length): the model and the step run on fake tensors (torch's FakeTensorMode: every operator
  of eager PyTorch with its shapes and dtypes, no arithmetic), and a TorchDispatchMode adds up the bytes of
  every tensor storage from the operator that makes it until Python frees it; the peak is the most bytes
  alive at once. These are the tensors' own bytes, what a GPU's caching allocator is asked for (before its
  rounding and fragmentation). Two data-dependent checks are skipped there (the label range and the head's
  one-position logit check), which allocate a few KiB, and transformers is told the sequence has no padding
  (it cannot read a fake mask; a real run of an unpadded sequence skips the 4-D mask the same way).
* rss (`--rss-tokens`): the same step with real arithmetic; peak = VmHWM after resetting it
  (/proc/self/clear_refs) minus VmRSS just before the step, with allocations of 128 KiB and more mmapped
  (MALLOC_MMAP_THRESHOLD_) so that freed tensors leave the resident set. A 2k-token case takes about 4
  minutes on 2 CPU cores; this checks the tracked figure on a real allocator.

The estimate is `verl.distributed.memory_plan`'s update phase for this step (one unsharded process, float32,
checkpointed; no optimizer state: the update's first optimizer step comes after its micro-batches).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

GIB = 2**30
PROMPT = 64
QWEN25_05B = dict(hidden_size=896, num_attention_heads=14, num_key_value_heads=2, intermediate_size=4864,
                  vocab_size=151_936, tie_word_embeddings=True, rope_theta=1_000_000.0)


def build(layers: int, response: int) -> Any:
    """The model (checkpointed per decoder layer) and one prompt + response."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from verl.distributed.fsdp import checkpoint_decoder_layers

    config = Qwen2Config(num_hidden_layers=layers, max_position_embeddings=PROMPT + response + 1, **QWEN25_05B)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    checkpoint_decoder_layers(model)
    model.train()
    ids = torch.randint(0, config.vocab_size, (1, PROMPT + response))
    for p in model.parameters():  # the gradients of an earlier micro-batch
        p.grad = torch.zeros_like(p)
    return model, ids


def update(model: Any, ids: Any, response: int, chunked: bool) -> None:
    """One micro-batch of a GRPO update: log-probs, PPO-clip loss, backward."""
    import torch

    from verl.algorithms import ppo_policy_loss
    from verl.trainer.forward.logprobs import response_logprobs

    mask = torch.ones_like(ids)
    positions = torch.arange(ids.shape[1])[None]
    logprobs, entropy = response_logprobs(model, ids, mask, positions, response, with_entropy=True,
                                          entropy_grad=False, chunked=chunked)
    advantages = torch.ones(1, response)  # (a constant: fake tensors hold no values anyway)
    loss, _ = ppo_policy_loss(logprobs, logprobs.detach(), advantages, torch.ones(1, response))
    loss.backward()


def tracked(layers: int, response: int, chunked: bool) -> dict[str, float]:
    """The peak of live tensor bytes during the update, on fake tensors."""
    import weakref

    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves
    from transformers import masking_utils

    import verl.algorithms.head_logprobs as head_logprobs
    import verl.algorithms.logits as logits

    head_logprobs._check_labels = logits._check_labels = lambda *a: None  # data-dependent: no data here
    torch.allclose = lambda *a, **k: True
    # transformers cannot read a fake mask's values, so it would build the 4-D causal mask that a real run of
    # an unpadded sequence skips (sdpa's is_causal): answer as the real run does
    masking_utils._ignore_causal_mask_sdpa = lambda *a, **k: True

    class LiveBytes(TorchDispatchMode):
        def __init__(self, existing: set[int]) -> None:
            super().__init__()
            self.live: dict[int, int] = {}
            self.existing, self.now, self.peak = existing, 0, 0

        def _free(self, key: int) -> None:
            self.now -= self.live.pop(key)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    storage = t.untyped_storage()
                    key = id(storage)
                    if key not in self.live and key not in self.existing:
                        self.live[key] = storage.nbytes()
                        self.now += storage.nbytes()
                        self.peak = max(self.peak, self.now)
                        weakref.finalize(storage, self._free, key)
            return out

    with FakeTensorMode(allow_non_fake_inputs=True):
        model, ids = build(layers, response)
        state = [p.untyped_storage() for p in model.parameters()] + [p.grad.untyped_storage() for p in
                                                                      model.parameters()]
        probe = LiveBytes({id(s) for s in state})
        with probe:
            update(model, ids, response, chunked)
        state_bytes = sum(s.nbytes() for s in state)
    return {"above": probe.peak / GIB, "state": state_bytes / GIB}


def rss(layers: int, response: int, chunked: bool) -> dict[str, float]:
    """VmHWM during the update minus VmRSS before it, with real arithmetic."""
    import ctypes
    import gc

    model, ids = build(layers, response)
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    state = sum(p.numel() * 4 * 2 for p in model.parameters()) / GIB
    before = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    start = time.perf_counter()
    update(model, ids, response, chunked)
    return {"above": (_status("VmHWM") - before) / GIB, "state": state, "seconds": time.perf_counter() - start}


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def estimate(layers: int, response: int, chunked: bool) -> float:
    """The memory plan's update phase beyond the model state, for this step."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from verl.distributed.fsdp import find_decoder_layers
    from verl.distributed.memory_plan import CUDA_RUNTIME_BYTES, ModelShape, PlanInputs, plan_memory

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(Qwen2Config(num_hidden_layers=layers, **QWEN25_05B))
    shape = ModelShape.from_model(model, find_decoder_layers(model)[0])
    x = PlanInputs(shape=shape, resident={}, compute_bytes=4, master_bytes=4, micro_batch=1, prompt_len=PROMPT,
                   response_len=response, activation_checkpointing=True, chunked_logprobs=chunked, sharded=False,
                   padded_mask=False)
    return (plan_memory(x, None).update_peak - CUDA_RUNTIME_BYTES) / GIB


def child(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(args.threads)
    fn = tracked if args.method == "tracked" else rss
    result = fn(args.layers, args.child, args.chunked)
    print(json.dumps(result), flush=True)


def measure(method: str, layers: int, response: int, chunked: bool, threads: int) -> dict[str, float] | str:
    """One case in a fresh child; its result, or why it has none."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1", "MALLOC_MMAP_THRESHOLD_": "131072"}
    cmd = [sys.executable, __file__, "--child", str(response), "--method", method, "--layers", str(layers),
           "--threads", str(threads)] + (["--chunked"] if chunked else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        return f"failed ({proc.returncode}): {proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ''}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="*", default=[2048, 8192, 16384], help="response lengths")
    parser.add_argument("--rss-tokens", type=int, nargs="*", default=[2048],
                        help="lengths also measured with real arithmetic (minutes each on a CPU)")
    parser.add_argument("--layers", type=int, default=24, help="decoder layers (24 = Qwen2.5-0.5B)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the rss runs")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--method", choices=("tracked", "rss"), default="tracked", help=argparse.SUPPRESS)
    parser.add_argument("--chunked", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return 0
    import doc_table

    rows, tracked_above, ratios = [], {}, []
    for response in args.tokens:
        for chunked in (False, True):
            path = "chunked" if chunked else "plain"
            t = measure("tracked", args.layers, response, chunked, 1)
            r = measure("rss", args.layers, response, chunked, args.threads) if response in args.rss_tokens else None
            plan = estimate(args.layers, response, chunked)
            if isinstance(t, str):
                rows.append(f"| {response} | {path} | {t} | | | | |")
                continue
            tracked_above[response, chunked] = t["above"]
            ratios.append(plan / t["above"])
            rss_cell = "" if r is None else r if isinstance(r, str) else (
                f"{r['above']:.2f} ({plan / r['above']:.2f}x, {r['seconds']:.0f} s)")
            rows.append(f"| {response} | {path} | {t['above']:.2f} | {rss_cell} | {plan:.2f} | "
                        f"{plan / t['above']:.2f} | {t['state'] + t['above']:.2f} |")
            print(f"# {response} {path}: tracked {t['above']:.2f} GiB above state, plan {plan:.2f}"
                  + ("" if r is None else f", rss {r}"), file=sys.stderr, flush=True)
    print(f"CPU: {doc_table.cpu_label()}; {time.strftime('%Y-%m-%d')}; Qwen2.5-0.5B shape, {args.layers} layers, "
          f"vocab 151936, float32, checkpointed; one response after a {PROMPT}-token prompt; GiB")
    print("| response tokens | log-probs | peak above weights + grads (tracked) | the same, rss (plan / rss, "
          "time) | plan | plan / tracked | peak incl. weights + grads |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    for response in args.tokens:
        if (response, False) in tracked_above and (response, True) in tracked_above:
            print(f"ratio chunked / plain peak above weights + grads at {response} tokens: "
                  f"{tracked_above[response, True] / tracked_above[response, False]:.3f}"
                  + (" (target <= 0.25)" if response == 8192 else ""))
    if ratios:
        print(f"ratio plan / tracked: {min(ratios):.2f} to {max(ratios):.2f} (target 0.80 to 1.20)")
    return 0


if __name__ == "__main__":
    import doc_table

    raise SystemExit(doc_table.run(main, doc_table.table_and("ratio"), doc=doc_table.ROOT / "docs" / "multigpu.md"))
