"""The one table `benchmarks/gpu_check.sh` ends with: every part of the GPU check and its status.

It reads what the parts left under OUT (env.txt; pytest_gpu.xml, or when pytest was cut off by its time
limit and wrote no XML, its verbose log pytest_gpu.txt; gpu_check.json) and each part's exit status, so a
part that failed or ran out of time still has its row. Standard library only: it must run when the
environment check itself failed.

Statuses: pass; fail; skip (a test, with pytest's reason); timeout (the part hit its time limit, or the
test was running when it did); not run; miss (measured, target not met); measured (no target judged: off a
GPU, or a figure without a target); n/a (nothing to measure off a GPU).

    python benchmarks/gpu_check_table.py --out OUT --rc env=0 --rc pytest=1 --rc bench=124 --elapsed 431
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

TIMEOUT_RC = 124  # coreutils `timeout`
BUDGET_S = 480  # the whole check on one H200: 8 minutes
VERBOSE_LINE = re.compile(r"^(tests/\S+::\S+)(?: (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)(?: \((.*?)\))?)?")
VERBOSE_STATUS = {"PASSED": "pass", "XPASS": "pass", "FAILED": "fail", "ERROR": "fail", "SKIPPED": "skip",
                  "XFAIL": "skip"}


@dataclass(frozen=True)
class Row:
    part: str
    status: str
    detail: str = ""


def _rc_status(rc: int | None) -> str:
    if rc is None:
        return "not run"
    return "pass" if rc == 0 else "timeout" if rc == TIMEOUT_RC else "fail"


def _first_line(text: str | None) -> str:
    return (text or "").strip().splitlines()[0][:160] if (text or "").strip() else ""


def env_rows(out: Path, rcs: dict[str, int | None]) -> list[Row]:
    rows = []
    if "wheels" in rcs:
        rc = rcs["wheels"]
        rows.append(Row("wheels (.whl)", "skip", "none carried") if rc is None
                    else Row("wheels (.whl)", _rc_status(rc), "installed" if rc == 0 else "see pip.txt"))
    env = out / "env.txt"
    detail = " | ".join(env.read_text().split("\n")[:4]).strip(" |")[:200] if env.exists() else "no env.txt"
    rows.append(Row("env", _rc_status(rcs.get("env")), detail))
    return rows


def _from_junit(xml: Path) -> list[Row]:
    rows = []
    for case in ET.parse(xml).getroot().iter("testcase"):
        module = (case.get("classname") or "").rsplit(".", 1)[-1]
        name = f"{module}::{case.get('name')}"
        failed = case.find("failure") if case.find("failure") is not None else case.find("error")
        skipped = case.find("skipped")
        if failed is not None:
            rows.append(Row(name, "fail", _first_line(failed.get("message") or failed.text)))
        elif skipped is not None:
            rows.append(Row(name, "skip", _first_line(skipped.get("message"))))
        else:
            rows.append(Row(name, "pass", f"{float(case.get('time') or 0):.1f}s"))
    return rows


def _from_verbose_log(log: Path) -> list[Row]:
    """`pytest -v` lines; the test a cut-off run was in has its id and no outcome yet."""
    rows = []
    for line in log.read_text(errors="replace").splitlines():
        m = VERBOSE_LINE.match(line)
        if not m:
            continue
        node = m.group(1).removeprefix("tests/gpu/").replace(".py::", "::")
        if m.group(2):
            rows.append(Row(node, VERBOSE_STATUS[m.group(2)], m.group(3) or ""))
        else:
            rows.append(Row(node, "timeout", "running when the part's time limit was reached"))
    return rows


def test_rows(out: Path, rc: int | None) -> list[Row]:
    """One row per gpu test, then one for the pytest part as a whole."""
    xml, log = out / "pytest_gpu.xml", out / "pytest_gpu.txt"
    if xml.exists():
        tests = _from_junit(xml)
    elif log.exists():
        tests = _from_verbose_log(log)
    else:
        tests = []
    counts = {s: sum(r.status == s for r in tests) for s in ("pass", "fail", "skip", "timeout")}
    summary = ", ".join(f"{n} {s}" for s, n in counts.items() if n) or "no test results"
    if rc is not None and rc not in (0, 1, TIMEOUT_RC):
        summary += f"; pytest exit status {rc} (see pytest_gpu.txt)"
    return [Row(f"gpu test {r.part}", r.status, r.detail) for r in tests] + [
        Row("gpu tests (pytest -m gpu)", _rc_status(rc), summary)]


def _target(met: bool | None) -> str:
    return "measured" if met is None else "pass" if met else "miss"


def bench_rows(out: Path, rc: int | None) -> list[Row]:
    path = out / "gpu_check.json"
    result = json.loads(path.read_text()) if path.exists() else {}
    missing = "timeout" if rc == TIMEOUT_RC else "not run" if rc is None else "fail"
    targets = result.get("targets", {})
    rows = []
    r = result.get("rollout")
    if r:
        rows.append(Row("rollout tokens/s: ours vs HF generate", _target(targets.get("sampler_speedup_ge_3x")),
                        f"{r['ours_tokens_per_s']:.0f} vs {r['hf_tokens_per_s']:.0f} "
                        f"({r['speedup_vs_hf']:.2f}x; target >= 3x on a GPU)"))
    else:
        rows.append(Row("rollout tokens/s: ours vs HF generate", missing, "no figure (see bench.txt)"))
    g = result.get("grpo")
    if g:
        mfu = g.get("update_mfu")
        rows.append(Row("update MFU", _target(targets.get("update_mfu_ge_35pct")) if mfu is not None else "measured",
                        (f"{mfu:.1%}" if mfu is not None else "no known peak")
                        + f" ({g['update_tflops']:.2f} TFLOPS; target >= 35% on a GPU)"))
        mem = g.get("peak_gpu_memory_gib")
        rows.append(Row("peak GPU memory", "measured", f"{mem:.2f} GiB (max allocated)") if mem is not None
                    else Row("peak GPU memory", "n/a", "off a GPU"))
        rows.append(Row("step wall / stage sum", _target(targets.get("step_le_1_2x_stage_sum")),
                        f"{g['worst_step_over_stage_sum']:.3f} worst of {g['steps']} steps (target <= 1.2)"))
    else:
        for part in ("update MFU", "peak GPU memory", "step wall / stage sum"):
            rows.append(Row(part, missing, "no GRPO figures (see bench.txt)"))
    rows.append(Row("benchmark (gpu_check.py)", _rc_status(rc), f"exit status {rc}" if rc is not None else ""))
    return rows


def build_rows(out: Path, rcs: dict[str, int | None], elapsed: float | None = None) -> list[Row]:
    rows = env_rows(out, rcs) + test_rows(out, rcs.get("pytest")) + bench_rows(out, rcs.get("bench"))
    if elapsed is not None:
        rows.append(Row("total time", "pass" if elapsed < BUDGET_S else "miss",
                        f"{elapsed:.0f}s (budget {BUDGET_S}s)"))
    return rows


def render(rows: list[Row]) -> str:
    width = max(len(r.part) for r in rows)
    lines = [f"{'part':<{width}}  {'status':<8}  detail", f"{'-' * width}  {'-' * 8}  {'-' * 40}"]
    lines += [f"{r.part:<{width}}  {r.status:<8}  {r.detail}".rstrip() for r in rows]
    return "\n".join(lines)


def _rc(item: str) -> tuple[str, int | None]:
    name, _, value = item.partition("=")
    return name, (int(value) if value.strip() not in ("", "-") else None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--rc", action="append", default=[], type=_rc,
                        help="PART=STATUS for wheels, env, pytest, bench (empty: the part did not run)")
    parser.add_argument("--elapsed", type=float, default=None)
    args = parser.parse_args(argv)
    print(render(build_rows(args.out, dict(args.rc), args.elapsed)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
