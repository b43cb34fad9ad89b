"""Host syncs per decoded token of multi-turn episodes: the `end` callback (stop strings, the episode budget)
asked every token against every `eos_check_every` tokens.

Each time the host reads which rows ended, the device queue drains and the GPU idles while Python decides
(tens of microseconds per sync, per token, on a GPU; nothing on a CPU). The workload is the tiny model's
multi-turn rollout: episodes of a scripted environment whose turns end at a stop string (`--stop`), the
episode budget or max_new_tokens, with observations of varied lengths prefilled in between.
- baseline: `eos_check_every=1`, the host asks every token (what `end` forced before);
- candidate: `eos_check_every=8` (the default off the CPU).
Both sides sample the same seed and must write the same episodes (tokens equal, log-probs to float rounding:
asserted), so they do the same work. Syncs are counted where the engine reads device values on the host
(`hf_engine._to_host`, and bool()/int()/item()/tolist()/nonzero()/boolean-mask indexing in hf_engine.py); on
CUDA the count of torch's sync-debug warnings is printed as well, and the wall time (on CPU it shows only
that checking less often costs nothing there). The ratio line is baseline / candidate syncs per model token.
Run by hand: ``python benchmarks/decode_sync.py [--episodes 16] [--max-new-tokens 64] [--stop ee aa] [--device cuda]``.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings

import torch

from verl.env.multiturn import Done, MultiTurnEnv, Observation
from verl.models.hf_loader import load_hf_model
from verl.models.tiny import build_tiny_model
from verl.rollout import HFKVCacheEngine, SamplingParams, hf_engine
from verl.rollout.multiturn import MultiTurnRollout

SYNC_METHODS = ("__bool__", "__int__", "__float__", "item", "tolist", "nonzero", "cpu", "numpy")


class Scripted(MultiTurnEnv):
    def __init__(self, episodes: int, budget: int) -> None:
        rows = [{"prompt": f"{i}*{i % 7 + 2}=", "ground_truth": "0", "data_source": "s", "metadata": {"i": i}}
                for i in range(episodes)]
        super().__init__(rows, val_rows=rows, max_turns=4, max_episode_tokens=budget, shuffle=False)

    def start(self, row):
        return row["prompt"], {"i": row["metadata"]["i"], "turn": 0}

    def step(self, state, model_text):
        state["turn"] += 1
        if state["turn"] >= 3:
            return Done(reward=float(len(model_text) % 3))
        return Observation(" <r>" + "x" * (1 + (state["i"] * 3 + state["turn"]) % 9) + "</r>", tool_call=True)


class Syncs:
    """Counts the engine's host reads while active."""

    def __init__(self) -> None:
        self.reads = self.all = 0
        self._saved: list[tuple[object, str, object]] = []

    def __enter__(self) -> Syncs:
        real_to_host = hf_engine._to_host

        def to_host(t):
            self.reads += 1
            self.all += 1
            return real_to_host(t)

        def engine_frame() -> bool:
            code = sys._getframe(2).f_code
            return code.co_filename.endswith("hf_engine.py") and code.co_name not in ("_to_host", "settle")

        def wrap(real):
            def counted(t, *args, **kwargs):
                self.all += engine_frame()
                return real(t, *args, **kwargs)
            return counted

        def wrap_index(real):
            def counted(t, index, *args):
                parts = index if isinstance(index, tuple) else (index,)
                if any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts):
                    self.all += engine_frame()
                return real(t, index, *args)
            return counted

        self._patch(hf_engine, "_to_host", to_host)
        for name in SYNC_METHODS:
            self._patch(torch.Tensor, name, wrap(getattr(torch.Tensor, name)))
        for name in ("__getitem__", "__setitem__"):
            self._patch(torch.Tensor, name, wrap_index(getattr(torch.Tensor, name)))
        return self

    def _patch(self, owner, name, value) -> None:
        self._saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    def __exit__(self, *exc) -> None:
        for owner, name, value in reversed(self._saved):
            setattr(owner, name, value)


def rollout(model, tok, every: int, args, count: bool):
    env = Scripted(args.episodes, args.budget)
    runner = MultiTurnRollout(HFKVCacheEngine(model, eos_check_every=every), tok, args.stop)
    prompts, records = runner.start(env, env.val_rows(), 1)
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    params = SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens, eos_token_ids=[tok.eos_token_id],
                            pad_token_id=tok.pad_token_id)
    ids, mask = enc["input_ids"].to(args.device), enc["attention_mask"].to(args.device)
    generator = torch.Generator(device=args.device).manual_seed(0)
    syncs = Syncs()
    cuda_syncs = 0
    if args.device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    if count:
        with syncs:
            out = runner.run(env, records, ids, mask, params, generator=generator)
    elif args.device == "cuda":
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                out = runner.run(env, records, ids, mask, params, generator=generator)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        cuda_syncs = sum("synchroniz" in str(w.message) for w in caught)
    else:
        out = runner.run(env, records, ids, mask, params, generator=generator)
    if args.device == "cuda":
        torch.cuda.synchronize()
    return out, syncs, cuda_syncs, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--budget", type=int, default=200)
    parser.add_argument("--every", type=int, default=8)
    parser.add_argument("--stop", nargs="*", default=["ee", "aa"], help="stop strings that end a turn")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    torch.set_num_threads(1) if args.device == "cpu" else None
    model, tok = load_hf_model(build_tiny_model(variant="base"), torch_dtype=torch.float32, device=args.device)
    tok.padding_side = "left"
    model.eval()
    rows = {}
    for every in (1, args.every):
        out, syncs, _, _ = rollout(model, tok, every, args, count=True)
        _, _, cuda_syncs, seconds = rollout(model, tok, every, args, count=False)
        rows[every] = (out, syncs, cuda_syncs, seconds)
    base, cand = rows[1][0], rows[args.every][0]
    assert torch.equal(base.response_ids, cand.response_ids) and torch.equal(base.response_mask, cand.response_mask)
    assert torch.allclose(base.logprobs, cand.logprobs, atol=1e-5, rtol=0)
    tokens = int(base.response_mask.sum())
    print(f"{args.episodes} episodes, {tokens} model tokens, {sum(e.turns for e in base.episodes)} turns, "
          f"device {args.device}")
    print(f"{'eos_check_every':>16} {'host reads':>11} {'engine syncs':>13} {'per token':>10} {'cuda syncs':>11} "
          f"{'seconds':>8}")
    for every, (_, syncs, cuda_syncs, seconds) in rows.items():
        cuda = str(cuda_syncs) if args.device == "cuda" else "-"
        print(f"{every:>16} {syncs.reads:>11} {syncs.all:>13} {syncs.all / tokens:>10.3f} {cuda:>11} {seconds:>8.3f}")
    ratio = rows[1][1].all / rows[args.every][1].all
    print(f"ratio: engine host syncs per model token, eos_check_every=1 (baseline) / eos_check_every={args.every}: "
          f"{ratio:.2f}x fewer")


if __name__ == "__main__":
    main()
