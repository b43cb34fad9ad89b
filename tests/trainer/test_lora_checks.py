"""LoRA start-up checks (before any weights load): each problem's message, the parameter counts and the memory
estimate `verl check` prints, and the same problems stopping a trainer."""

from __future__ import annotations

import sys

import pytest
import yaml

from verl.config.loader import build_config
from verl.distributed.mapping import validate_device_mapping
from verl.distributed.memory import estimate_memory
from verl.errors import ConfigError
from verl.trainer.build.models import resolve_model_path
from verl.trainer.checks.startup import check_startup

peft = pytest.importorskip("peft")


def config(**sections):
    tree = {"model": {"path": "tiny", "dtype": "float32", "lora": {"rank": 8}},
            "env": {"name": "arithmetic"}, "trainer": {"device": "cpu"}, "actor": {"kl_loss_coef": 0.1}}
    for key, value in sections.items():
        tree.setdefault(key, {}).update(value)
    return build_config(tree)


def problems(cfg, world_size=1, kind=None):
    report = check_startup(cfg, world_size=world_size, model_path=resolve_model_path(cfg.model.path),
                           device_type="cpu", kind=kind)
    return report, [str(p) for p in report.problems]


def one(messages):
    assert len(messages) == 1, messages
    return messages[0]


def test_a_valid_lora_config_passes_and_counts_parameters():
    report, found = problems(config())
    assert found == []
    counts = report.parameters
    assert counts.total == 195_136 and counts.trainable == 22_528  # 172,608 base + the rank-8 adapters
    assert counts.describe() == ("parameters: 195,136 total, 22,528 trainable (11.54%); LoRA: rank 8, alpha 16, "
                                 "target_modules=all-linear\nreference: the policy with its adapters off "
                                 "(no second copy of the weights)")
    # the memory estimate: gradients and AdamW moments for the adapters only, and no reference copy
    (params, grads, opt), = report.memory.per_rank[0].values()
    assert list(report.memory.per_rank[0]) == ["actor"]
    assert params == 195_136 * 4 and grads == 22_528 * 4 and opt == 2 * 22_528 * 4


def test_full_fine_tune_counts_every_parameter_and_pays_for_the_reference():
    report, found = problems(config(model={"lora": {"rank": 0}}))
    assert found == [] and report.parameters.total == report.parameters.trainable == 172_608
    assert report.parameters.describe() == "parameters: 172,608 total, 172,608 trainable (100.00%)"
    assert set(report.memory.per_rank[0]) == {"actor", "ref"}


def test_target_modules_that_name_no_module_list_what_exists():
    message = one(problems(config(model={"lora": {"rank": 8, "target_modules": ["q_proj", "query", "value"]}}))[1])
    assert message == ("model.lora.target_modules names ['query', 'value'], which match no module of "
                       "Qwen2ForCausalLM; its linear layers are ['down_proj', 'gate_proj', 'k_proj', 'lm_head', "
                       "'o_proj', 'q_proj', 'up_proj', 'v_proj']. Fix: list some of those, or use 'all-linear'")


def test_target_modules_as_a_comma_string_and_modules_to_save():
    report, found = problems(config(model={"lora": {"rank": 4, "target_modules": "q_proj,v_proj",
                                                    "modules_to_save": ["lm_head"]}}))
    assert found == []
    assert report.parameters.trainable == 2 * (4 * (64 + 64) + 4 * (64 + 32)) + 768 * 64  # + a trained lm_head copy
    message = one(problems(config(model={"lora": {"rank": 4, "modules_to_save": ["head"]}}))[1])
    assert message.startswith("model.lora.modules_to_save names ['head'], which match no module of Qwen2ForCausalLM")
    assert "Fix: name existing modules (e.g. lm_head, embed_tokens) or remove the key" in message


def test_rank_and_alpha_must_be_positive():
    message = one(problems(config(model={"lora": {"rank": -4}}))[1])
    assert message == ("model.lora.rank=-4: a LoRA rank must be > 0 (0 turns LoRA off). Fix: set model.lora.rank "
                       "to e.g. 8 or 16, or 0 to train every weight")
    message = one(problems(config(model={"lora": {"rank": 8, "alpha": 0}}))[1])
    assert message == ("model.lora.alpha=0: must be > 0 (the adapters are scaled by alpha / rank). Fix: set "
                       "model.lora.alpha to e.g. 2 x rank, or remove it (default 2 x rank)")
    message = one(problems(config(algorithm={"adv_estimator": "gae"}, critic={"lora": {"rank": 4, "alpha": -1}}))[1])
    assert message.startswith("critic.lora.alpha=-1: must be > 0")


def test_lora_needs_use_orig_params():
    message = one(problems(config(fsdp={"use_orig_params": False}), world_size=1)[1])
    assert ("fsdp.use_orig_params=False with LoRA: LoRA trains a few adapter parameters next to frozen base weights"
            in message)
    assert "Fix: set fsdp.use_orig_params=true." in message
    assert problems(config(model={"lora": {"rank": 0}}, fsdp={"use_orig_params": False}))[1] == []


def test_the_vllm_engine_with_lora_gets_no_lora_refusal():
    # the weight sync pushes the merged adapters into vLLM (verl.rollout.weight_sync): only the engine's own
    # requirements (CUDA, the vllm package) remain
    found = problems(config(rollout={"engine": "vllm"}))[1]
    assert found and not [m for m in found if "model.lora" in m]


def test_a_reference_on_some_of_the_actor_ranks_is_refused():
    cfg = config(devices={"actor": [0, 1], "ref": [1]})
    message = one(problems(cfg, world_size=2)[1])
    assert message.startswith("model.lora with devices.ref=[1] overlapping devices.actor=[0, 1]")
    assert "Fix: set devices.ref=[0, 1] (or remove it), put the reference on ranks apart from the actor's" in message
    assert problems(config(devices={"actor": [0], "ref": [1]}), world_size=2)[1] == []  # ranks of its own
    with_path = config(devices={"actor": [0, 1], "ref": [1]}, ref={"path": "tiny"})
    assert not [m for m in problems(with_path, world_size=2)[1] if "model.lora" in m]


@pytest.fixture(scope="module")
def other_adapter(tmp_path_factory):
    """A rank-4 adapter trained on another base model (the tiny model at hidden size 128)."""
    from transformers import AutoModelForCausalLM

    base = resolve_model_path("tiny:qwen2:128:2")
    model = AutoModelForCausalLM.from_pretrained(base)
    out = tmp_path_factory.mktemp("adapter") / "other"
    peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"])).save_pretrained(str(out))
    return out, base


def test_an_adapter_of_another_base_model_is_refused(other_adapter):
    path, base = other_adapter
    found = problems(config(model={"lora": {"rank": 0, "path": str(path)}}))[1]
    assert len(found) == 2, found
    assert found[0] == (f"model.lora.path={path} was trained on base model {base!r}, but this run's model is "
                        f"'tiny'; an adapter only fits the model it was trained on. Fix: set the model path to "
                        f"{base!r}, or use an adapter trained on 'tiny'")
    assert found[1].startswith(f"model.lora.path={path}: the adapter's shapes do not fit this run's model 'tiny' "
                               "(8 tensor(s), e.g. base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight "
                               "[4, 128]")
    assert found[1].endswith("Fix: use the base model the adapter was trained on, or another adapter")
    # on its own base model it passes, and its own rank applies
    report, ok = problems(config(model={"path": "tiny:qwen2:128:2", "lora": {"rank": 0, "path": str(path)}}))
    assert ok == [] and report.parameters.trainable == 2 * (4 * (128 + 128) + 4 * (128 + 64))  # q_proj, v_proj


def test_adapter_rank_mismatch_and_missing_folder(other_adapter, tmp_path):
    path, _ = other_adapter
    message = one(problems(config(model={"path": "tiny:qwen2:128:2", "lora": {"rank": 8, "path": str(path)}}))[1])
    assert message == (f"model.lora.rank=8 but the adapter at model.lora.path={path} has rank 4 (its own rank, "
                       "alpha and target modules apply). Fix: set model.lora.rank=4 or model.lora.rank=0")
    message = one(problems(config(model={"lora": {"rank": 8, "path": str(tmp_path / "none")}}))[1])
    assert message == (f"model.lora.path={tmp_path / 'none'}: no such folder; point it at a peft adapter folder "
                       "(adapter_config.json + adapter_model.safetensors), or remove the key to start new adapters")
    (tmp_path / "empty").mkdir()
    message = one(problems(config(model={"lora": {"rank": 8, "path": str(tmp_path / "empty")}}))[1])
    assert message.startswith(f"model.lora.path={tmp_path / 'empty'}: "
                              f"cannot read {tmp_path / 'empty' / 'adapter_config.json'}")
    assert ("Fix: point it at a folder written by PeftModel.save_pretrained or `verl ckpt export STEP --adapter`"
            in message)


def test_missing_peft_is_a_start_up_problem(monkeypatch):
    monkeypatch.setitem(sys.modules, "peft", None)
    message = one(problems(config())[1])
    assert message == ("model.lora: LoRA is on, but the `peft` package is not installed. Fix: pip install peft "
                       "(or, in a verl checkout: pip install -e '.[peft]'), or set model.lora.rank=0 to train "
                       "every weight")


def test_the_trainer_stops_on_the_same_problem(tmp_path):
    from verl.trainer.rl_trainer import RLTrainer

    cfg = config(model={"lora": {"rank": 8, "target_modules": ["nope"]}}, trainer={"run_dir": str(tmp_path)})
    with pytest.raises(ConfigError) as info:
        RLTrainer(cfg)
    assert "model.lora.target_modules names ['nope'], which match no module" in str(info.value)
    assert "(nothing was loaded)" in str(info.value)


def test_memory_estimate_with_trainable_counts():
    mapping = validate_device_mapping(config().devices, world_size=1, algorithm_needs_critic=False, needs_ref=False,
                                      needs_reward_model=False, role_dtypes={"actor": "bfloat16"},
                                      visible_devices=None, cuda_visible_devices=None)
    est = estimate_memory({"actor": 1000}, {"actor": "bfloat16"}, mapping=mapping, sharding="NO_SHARD",
                          trainable_counts={"actor": 10})
    assert est.per_rank[0]["actor"] == (2000, 20, 40)


def test_verl_check_prints_parameters_and_memory_with_lora(tmp_path, capsys):
    from verl.cli.main import main

    path = tmp_path / "lora.yaml"
    path.write_text(yaml.safe_dump({"model": {"path": "tiny", "dtype": "float32", "lora": {"rank": 8}},
                                    "env": {"name": "arithmetic"}, "trainer": {"device": "cpu"},
                                    "actor": {"kl_loss_coef": 0.1}}))
    code, out = main(["check", str(path)]), capsys.readouterr().out
    assert code == 0, out
    assert "parameters: 195,136 total, 22,528 trainable (11.54%); LoRA: rank 8, alpha 16" in out
    assert "reference: the policy with its adapters off (no second copy of the weights)" in out
    assert "rank  roles  params  grads  optimizer  total" in out
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"model": {"path": "tiny", "lora": {"rank": 8, "alpha": -2}},
                                   "env": {"name": "arithmetic"}, "trainer": {"device": "cpu"}}))
    assert main(["check", str(bad)]) == 1
    assert "model.lora.alpha=-2: must be > 0" in capsys.readouterr().out


def test_lora_keys_are_known_to_the_config():
    cfg = config(model={"lora": {"rank": 16, "dropout": 0.05, "target_modules": ["q_proj"],
                                 "modules_to_save": "lm_head"}})
    assert cfg.model.lora.scale_alpha == 32.0 and cfg.model.lora.modules_to_save == ["lm_head"]
    assert cfg.critic.lora.enabled is False
    with pytest.raises(ConfigError) as info:
        build_config({"model": {"lora_rank": 8}})
    assert "lora_rank" in str(info.value)
