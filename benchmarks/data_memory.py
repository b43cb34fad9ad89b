"""Peak memory of training on data larger than memory: a ~2 GB JSONL file and a ~2 GB save_to_disk folder.

Run by hand (not a test):  python benchmarks/data_memory.py --size-mb 2048
Each dataset is loaded the way `verl train` loads it -- `split_train_val` (every row checked, the bad ones
reported with their line or row; data.on_bad_row=skip), the dataset environment over the rows (its start-up
checks of every row's data_source and ground truth), then `--batches` shuffled batches of prompts drawn as
training draws them -- in a fresh process, which reports its peak RSS (getrusage) and its RSS right after the
imports. The data's share is the difference; the rows stay in their files (`verl.data.index`), so it should
be a few bytes per row, not the file. The baseline is what holding the rows costs (`load_rows`, a list of
dicts), measured on the first --baseline-mb of the JSONL and scaled linearly to the file size.

The files go to a temporary folder (--dir; deleted afterwards). The script checks the free disk first and
stops with the size that fits; --size-mb scales everything down. --tokenizer tiny also counts prompt tokens
(as training does with the model's tokenizer; slow: ~0.5 ms a row on this CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORDS = ("the quick brown fox jumps over a lazy dog while reasoning step by step about arithmetic and the answer "
         "to what comes next in the sequence").split()
BAD_EVERY = 10_007  # one bad row (a null prompt) per this many, so the report has something to name
SHARD_MB = 500  # datasets' default max_shard_size


def rows(size_bytes: int):
    """~1 KB prompt rows (question/answer/data_source, as GSM8K-style data), with a bad row now and then."""
    n = written = 0
    while written < size_bytes:
        text = " ".join(WORDS[(n * 7 + i) % len(WORDS)] for i in range(150 + n % 50))
        row = {"question": f"problem {n}: {text}?", "answer": str(n % 1000), "data_source": ("gsm8k", "math")[n % 2],
               "id": n}
        if n % BAD_EVERY == BAD_EVERY - 1:
            row["question"] = None
        yield row
        written += len(text) + 80
        n += 1


def make_jsonl(path: Path, size_mb: int) -> int:
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for row in rows(size_mb << 20):
            f.write(json.dumps(row) + "\n")
            n += 1
    return n


def make_arrow_folder(folder: Path, size_mb: int) -> int:
    """A Dataset.save_to_disk folder: data-NNNNN-of-NNNNN.arrow shards (Arrow IPC stream, batches of 1000 rows,
    as datasets writes them), state.json and dataset_info.json."""
    import pyarrow as pa

    folder.mkdir(parents=True)
    shards = max(1, -(-size_mb // SHARD_MB))
    names = [f"data-{i:05d}-of-{shards:05d}.arrow" for i in range(shards)]
    schema = pa.schema([("question", pa.string()), ("answer", pa.string()), ("data_source", pa.string()),
                        ("id", pa.int64())], metadata={"huggingface": json.dumps({"info": {"features": {}}})})
    per_shard, n, shard, writer, sink, written = (size_mb << 20) // shards, 0, -1, None, None, 0
    batch: list[dict] = []

    def flush() -> None:
        if batch:
            writer.write_batch(pa.RecordBatch.from_pylist(batch, schema=schema))
            batch.clear()

    for row in rows(size_mb << 20):
        if writer is None or (written >= per_shard * (shard + 1) and shard + 1 < shards):
            flush()
            if writer is not None:
                writer.close()
                sink.close()
            shard += 1
            sink = pa.OSFile(str(folder / names[shard]), "wb")
            writer = pa.ipc.new_stream(sink, schema)
        batch.append(row)
        written += len(row["question"] or "") + 80
        n += 1
        if len(batch) == 1000:
            flush()
    flush()
    writer.close()
    sink.close()
    for i in range(shard + 1, shards):  # a size that did not fill every shard: empty ones, as state.json lists them
        with pa.OSFile(str(folder / names[i]), "wb") as s, pa.ipc.new_stream(s, schema):
            pass
    (folder / "state.json").write_text(json.dumps({"_data_files": [{"filename": x} for x in names],
                                                   "_fingerprint": "bench", "_format_columns": None,
                                                   "_format_kwargs": {}, "_format_type": None,
                                                   "_output_all_columns": False, "_split": None}))
    (folder / "dataset_info.json").write_text(json.dumps({"features": {}}))
    return n


# Runs in a fresh process: load as training does, print one JSON line.
CHILD = r"""
import json, resource, sys, time
from verl.config.loader import build_config
from verl.env import build_env
from verl.data.split import split_train_val
from verl.data import load_rows

def rss_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

def rss_now():  # (anonymous, file-backed) MB now: mapped Arrow pages read so far are file-backed, droppable
    status = open("/proc/self/status").read()
    get = lambda key: int(status.split(key + ":")[1].split()[0]) / 1024
    return get("RssAnon"), get("RssFile")

mode, path, tokenizer_spec, batches, batch_size = (
    sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
)
tokenizer = None
if tokenizer_spec != "none":
    from verl.models.hf_loader import load_tokenizer
    from verl.models.tiny import build_tiny_model
    tokenizer = load_tokenizer(build_tiny_model())
after_imports, anon_after_imports = rss_mb(), rss_now()[0]
t0 = time.perf_counter()
if mode == "list":  # the baseline: every row held in memory
    rows, report = load_rows(path, "prompt", on_bad_row="skip")
    print(json.dumps({"after_imports": after_imports, "peak": rss_mb(),
                      "anon_growth": rss_now()[0] - anon_after_imports, "rows": report.total_rows}))
    sys.exit(0)
config = build_config({"data": {"train_files": [path], "on_bad_row": "skip", "max_prompt_length": 4096},
                       "reward": {"functions": [{"name": "exact_match"}]}, "trainer": {"seed": 1}})
split = split_train_val(config, "prompt", tokenizer)
train, val = split.rows()
env = build_env(config.env, reward_functions=config.reward.functions, train_rows=train, val_rows=val, seed=1)
checked = time.perf_counter() - t0
t1 = time.perf_counter()
for _ in range(batches):
    drawn = env.get_batch(batch_size)
per_batch = (time.perf_counter() - t1) / max(batches, 1)
report = split.reports["train"]
bad = [f"{e['file'].split('/')[-1]}{':' if e['file'].endswith('.jsonl') else ' row '}{e['line']}"
       for st in report.reasons.values() for e in st.examples][:2]
anon, file_backed = rss_now()
print(json.dumps({"after_imports": after_imports, "peak": rss_mb(), "anon_growth": anon - anon_after_imports,
                  "file_backed": file_backed,
                  "rows": report.total_rows, "kept": len(train),
                  "bad": report.dropped_rows, "examples": bad, "index_mb": train.nbytes() / 2**20,
                  "check_s": checked, "batch_ms": per_batch * 1e3, "last_prompt": drawn[-1]["prompt"][:20]}))
"""


def child(mode: str, path: Path, tokenizer: str, batches: int, batch_size: int) -> dict:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", CHILD, mode, str(path), tokenizer, str(batches), str(batch_size)],
                         capture_output=True, text=True, env=env, check=False)
    if out.returncode != 0:
        raise SystemExit(f"loading {path} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def du_mb(path: Path) -> float:
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    return sum(p.stat().st_size for p in files) / 2**20


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mb", type=int, default=2048, help="size of each generated dataset (default 2048)")
    ap.add_argument("--baseline-mb", type=int, default=100, help="JSONL size the rows-in-memory baseline loads")
    ap.add_argument("--formats", default="jsonl,arrow", help="which datasets to generate: jsonl, arrow or both")
    ap.add_argument("--tokenizer", default="none", choices=["none", "tiny"], help="count prompt tokens too")
    ap.add_argument("--batches", type=int, default=50, help="shuffled batches drawn after the checks")
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--dir", default=None, help="where the temporary files go (default: the system temp dir)")
    args = ap.parse_args()
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    base = Path(args.dir or tempfile.gettempdir())
    need_mb = args.size_mb * len(formats) * 1.1 + args.baseline_mb
    free_mb = shutil.disk_usage(base).free / 2**20
    if free_mb < need_mb + 1024:
        fit = int((free_mb - 1024 - args.baseline_mb) / (1.1 * len(formats)))
        print(f"{base} has {free_mb:.0f} MB free, this run needs {need_mb:.0f} MB (+1 GB spare); rerun with "
              f"--size-mb {max(fit, 0)} or --dir on a larger disk", file=sys.stderr)
        return 2

    results = []
    with tempfile.TemporaryDirectory(dir=base, prefix="verl_data_memory_") as d:
        tmp = Path(d)
        jsonl, folder = tmp / "train.jsonl", tmp / "train_hf"
        t0 = time.perf_counter()
        made = {}
        if "jsonl" in formats or args.baseline_mb:
            made["jsonl"] = make_jsonl(jsonl, args.size_mb if "jsonl" in formats else args.baseline_mb)
        if "arrow" in formats:
            made["arrow"] = make_arrow_folder(folder, args.size_mb)
        print(f"generated {', '.join(f'{k} {v} rows' for k, v in made.items())} in {time.perf_counter() - t0:.0f} s")
        small = tmp / "head.jsonl"
        with open(jsonl, "rb") as src, open(small, "wb") as dst:
            for line in src:
                dst.write(line)
                if dst.tell() >= args.baseline_mb << 20:
                    break
        baseline = child("list", small, "none", 0, 1)
        for fmt, path in (("jsonl", jsonl), ("arrow", folder)):
            if fmt in formats:
                results.append((fmt, du_mb(path), child("index", path, args.tokenizer, args.batches, args.batch_size)))
        small_mb = du_mb(small)

    per_mb = (baseline["peak"] - baseline["after_imports"]) / small_mb
    print(f"| data | file MB | rows | bad rows (first named) | peak RSS MB | RSS after imports MB | peak growth MB | "
          f"private (anonymous) growth MB | file-backed RSS at the end MB | index MB | check s | "
          f"ms per batch of {args.batch_size} |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for fmt, size, r in results:
        print(f"| {fmt} | {size:.0f} | {r['rows']} | {r['bad']} ({', '.join(r['examples'])}) | {r['peak']:.0f} "
              f"| {r['after_imports']:.0f} | {r['peak'] - r['after_imports']:.0f} | {r['anon_growth']:.0f} "
              f"| {r['file_backed']:.0f} | {r['index_mb']:.0f} | {r['check_s']:.0f} | {r['batch_ms']:.1f} |")
    print(f"baseline: the rows held as dicts (load_rows) grow RSS by {per_mb:.2f} MB per MB of JSONL "
          f"({small_mb:.0f} MB measured: {baseline['peak'] - baseline['after_imports']:.0f} MB)")
    for fmt, size, r in results:
        held, private = per_mb * size, max(r["anon_growth"], 1.0)
        print(f"ratio {fmt} ({size:.0f} MB, {r['rows'] / 1e6:.2f} M rows, {r['bad']} bad rows named, e.g. "
              f"{r['examples'][0] if r['examples'] else '-'}): rows held in memory (scaled: {held:.0f} MB) / verl's "
              f"private memory growth ({private:.0f} MB) = {held / private:.0f}x; "
              f"peak RSS +{r['peak'] - r['after_imports']:.0f}"
              f" MB over {r['after_imports']:.0f} MB after imports; checked in {r['check_s']:.0f} s; "
              f"{r['batch_ms']:.0f} ms per batch of {args.batch_size}")
    return 0


if __name__ == "__main__":
    import doc_table

    raise SystemExit(
        doc_table.run(main, doc_table.prefixed("baseline", "ratio"), doc=doc_table.ROOT / "docs" / "data.md")
    )
