"""`verl doctor` on vLLM: whether the installed vllm is in verl's supported range, and whether the installed
torch and transformers satisfy that vllm's own requirements. vllm is not installed here: its distribution
metadata is faked (importlib.metadata.version / requires)."""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from verl.cli import doctor
from verl.rollout.vllm_engine import VLLM_SUPPORTED

# vLLM 0.34's own requirements, as its wheel's metadata lists them (the pins of the issue: torch 2.14,
# transformers < 5.23), with an extra's and another platform's requirement that must not count.
VLLM_REQUIRES = ["regex", "torch==2.14.0", "transformers<5.23,>=4.56.0", "tokenizers>=0.21.1",
                 "numpy", "torchaudio==2.14.0; extra == \"audio\"", "torch==2.13.0; platform_system == \"Plan9\""]


def _fake(monkeypatch, versions: dict[str, str], requires: list[str] | None = VLLM_REQUIRES) -> None:
    real_version, real_requires = importlib.metadata.version, importlib.metadata.requires

    def version(name: str) -> str:
        if name in versions:
            if versions[name] is None:
                raise importlib.metadata.PackageNotFoundError(name)
            return versions[name]
        return real_version(name)

    def requires_(name: str):
        return requires if name == "vllm" else real_requires(name)

    monkeypatch.setattr(importlib.metadata, "version", version)
    monkeypatch.setattr(importlib.metadata, "requires", requires_)


def _rows(monkeypatch, **versions) -> dict[str, tuple[str, str]]:
    _fake(monkeypatch, versions)
    return {name: (status, note) for name, status, note in doctor.vllm_rows()}


def test_no_vllm_no_rows(monkeypatch):
    assert _rows(monkeypatch, vllm=None) == {}


def test_a_matching_environment_is_ok(monkeypatch):
    rows = _rows(monkeypatch, vllm="0.34.1", torch="2.14.0+cu130", transformers="5.20.0")
    assert rows["vllm version"][0] == "ok"
    assert rows["vllm needs torch"] == ("ok", "torch 2.14.0+cu130 satisfies vllm 0.34.1's torch==2.14.0")
    assert rows["vllm needs transformers"][0] == "ok"
    assert len(rows) == 3  # the extra's and the other platform's requirements do not count


def test_transformers_too_new_for_the_installed_vllm(monkeypatch):
    rows = _rows(monkeypatch, vllm="0.34.1", torch="2.14.0", transformers="5.23.0")
    status, note = rows["vllm needs transformers"]
    assert status == "warn"
    assert "vllm 0.34.1 requires transformers<5.23,>=4.56.0, but transformers 5.23.0 is installed" in note
    assert "Fix: pip install 'transformers<5.23,>=4.56.0'" in note
    assert rows["vllm needs torch"][0] == "ok"


def test_torch_other_than_the_one_vllm_was_built_for(monkeypatch):
    rows = _rows(monkeypatch, vllm="0.34.1", torch="2.15.0", transformers="5.0.0")
    status, note = rows["vllm needs torch"]
    assert status == "warn" and "requires torch==2.14.0, but torch 2.15.0 is installed" in note
    assert "install the vllm release built for torch 2.15.0" in note


@pytest.mark.parametrize("version", ["0.6.3", "0.10.1", "0.35.0", "1.0.0"])
def test_vllm_outside_verls_range(monkeypatch, version):
    rows = _rows(monkeypatch, vllm=version, torch="2.14.0", transformers="5.0.0")
    status, note = rows["vllm version"]
    assert status == "warn"
    assert f"vllm {version} is outside the range verl's vLLM engine is written and tested against" in note
    assert f"pip install 'vllm{VLLM_SUPPORTED}'" in note and "rollout.engine=hf" in note


@pytest.mark.parametrize("version", ["0.10.2", "0.11.0", "0.34.0rc1", "0.34.9+cu130"])
def test_vllm_inside_verls_range(monkeypatch, version):
    assert _rows(monkeypatch, vllm=version, torch="2.14.0", transformers="5.0.0")["vllm version"][0] == "ok"


def test_a_requirement_vllm_needs_but_is_missing(monkeypatch):
    rows = _rows(monkeypatch, vllm="0.34.1", torch="2.14.0", transformers=None)
    status, note = rows["vllm needs transformers"]
    assert status == "warn" and "which is not installed" in note


def test_doctor_prints_the_mismatch_and_still_exits_0(monkeypatch, capsys):
    from verl.cli.main import main

    _fake(monkeypatch, {"vllm": "0.34.1", "transformers": "5.30.0"})
    monkeypatch.setattr(doctor, "_cpu_matmul_row", lambda: ("cpu matmul", "ok", "skipped in this test"))
    assert main(["doctor"]) == 0  # a warning, not a broken install of verl itself
    out = capsys.readouterr().out
    assert re.search(r"vllm needs transformers\s*\W\s*warn\s*\W\s*vllm 0\.34\.1 requires", out), out


def test_the_pyproject_extra_is_the_engines_range():
    text = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    (line,) = re.findall(r'^vllm = \["([^"]+)"\]', text, re.M)  # [project.optional-dependencies] vllm
    req = Requirement(line)
    assert req.name == "vllm" and req.specifier == SpecifierSet(VLLM_SUPPORTED)
