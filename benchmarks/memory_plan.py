"""The per-GPU memory plan `verl check` prints, for Qwen2.5-7B GRPO on 8 nodes x 8 H100 80GB.

Run by hand (not a test):  python benchmarks/memory_plan.py [key=value ...] [--write-docs]

It writes a folder holding only Qwen2.5-7B's config.json (its published shape: hidden 3584, 28 layers, 28
heads, 4 KV heads, intermediate 18944, vocab 152064, untied embeddings) and a GRPO config (512 prompts x 8
responses, 1k prompt + 4k response tokens, colocated vLLM, fp32 master weights with bf16 compute, KL to a
reference), runs `verl check CONFIG --nproc 8 --nnodes 8 --gpu-memory 79.1` on this machine (no GPU
needed: the run is refused here, the plan is printed), echoes the plan and prints its summary lines (the
start-up, rollout and update phases of an actor rank).
`key=value` items change the config, as on `verl train`'s command line. The figures are the plan's
arithmetic, not a measurement on a GPU.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import sys
import tempfile
from pathlib import Path

import doc_table

QWEN25_7B = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584,
             "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
             "intermediate_size": 18944, "vocab_size": 152064, "tie_word_embeddings": False,
             "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
             "hidden_act": "silu", "torch_dtype": "bfloat16"}
GPU_GIB = "79.1"  # what torch reports as an H100 80GB's total memory


def main() -> int:
    from verl.cli.main import main as verl

    overrides = sys.argv[1:]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "config.json").write_text(json.dumps(QWEN25_7B))
        config = folder / "grpo_qwen7b.yaml"
        config.write_text(f"""
trainer: {{kind: rl, device: cuda, run_dir: {folder / 'run'}}}
model: {{path: {folder}, dtype: float32}}
fsdp: {{mixed_precision: true}}
env: {{name: arithmetic}}
data: {{train_batch_size: 512, max_prompt_length: 1024}}
rollout: {{engine: vllm, n: 8, max_new_tokens: 4096}}
actor: {{kl_loss_coef: 0.001}}
""")
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            verl(["check", str(config), *overrides, "--nproc", "8", "--nnodes", "8", "--gpu-memory", GPU_GIB])
    text = out.getvalue()
    start = text.index("memory plan per GPU")
    block = text[start:].split("\nproblem:", 1)[0]
    print(block)
    phases = re.findall(r"  (start-up|rollout|update) phase[^\n]*\n(.*?)\n    peak\s+([\d.]+)\s+of [\d.]+ "
                        r"\((fits|DOES NOT FIT)\)", block, re.S)
    for name, body, peak, verdict in phases:
        parts = [re.match(r"\s*(.*?)\s{2,}([\d.]+)$", line).groups() for line in body.splitlines()]
        print(f"{name}: peak {peak} GiB of {GPU_GIB} ({verdict.lower()}): "
              + ", ".join(f"{p} {v}" for p, v in parts))
    for line in block.splitlines():
        if line.startswith("  ") and (": rollout " in line or line.startswith("  start-up: ")):
            print(f"try: {line.strip()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(doc_table.run(main, doc_table.prefixed("start-up:", "rollout:", "update:", "try:"),
                                   doc=doc_table.ROOT / "docs" / "multigpu.md"))
