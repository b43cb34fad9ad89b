"""vLLM on an asynchronous rollout rank (devices.rollout): every weight delivery ends with the engine holding
the actor's weights, under the names vLLM loaded from the model's files (a LoRA policy's adapters merged on
the rollout rank). The engine is the real `VLLMEngine` over the stand-in `vllm.LLM` of test_vllm_sync.py,
which keeps its own copy of the weights."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from verl.models.tiny import build_tiny_model
from verl.rollout import HFKVCacheEngine
from verl.rollout.async_rollout import buckets, trainable
from verl.rollout.weight_sync import DeliveryReceiver, policy_weights, synced

from .test_vllm_sync import W, read_metrics, rl_config, stand_in_vllm  # noqa: F401 - the fixture


class _Engine:
    """What a delivery uses of VLLMEngine: `holds_own_weights` and `load_policy_weights`."""

    holds_own_weights, fed_by_deliveries = True, True

    def __init__(self) -> None:
        self.loads: list[dict[str, torch.Tensor]] = []

    def load_policy_weights(self, weights) -> None:
        self.loads.append({name: tensor.clone() for name, tensor in weights})


def _deliver(model: torch.nn.Module, engine, source: torch.nn.Module, limit: int = 2048) -> None:
    """What `AsyncRollout.deliver` does on a rollout rank, the broadcast replaced by `source`'s values."""
    receiver, params, sent = DeliveryReceiver(engine, model), trainable(model), trainable(source)
    for index in buckets(params, limit=limit):
        flat = torch.cat([sent[i][1].detach().reshape(-1) for i in index])
        receiver.bucket([params[i] for i in index], flat)
    receiver.done()


def _tiny(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_pretrained(build_tiny_model(), dtype=torch.float32)


def test_a_full_policy_is_loaded_bucket_by_bucket_under_the_hf_names():
    copy, trained = _tiny(), _tiny()
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(torch.randn_like(p))
    before = {k: v.clone() for k, v in copy.state_dict().items()}
    engine = _Engine()
    _deliver(copy, engine, trained)
    assert len(engine.loads) > 1  # one load per bucket, straight from the received buffer
    loaded = {k: v for load in engine.loads for k, v in load.items()}
    assert set(loaded) == {n for n, _ in policy_weights(trained) if n in dict(trained.named_parameters())}
    for name, tensor in trained.named_parameters():
        assert torch.equal(loaded[name], tensor)
    for name, tensor in copy.state_dict().items():  # the (CPU) copy is the layout only: not written
        assert torch.equal(tensor, before[name])


def test_our_sampler_gets_the_delivery_in_its_copy():
    copy, trained = _tiny(), _tiny()
    with torch.no_grad():
        for p in trained.parameters():
            p.mul_(2)
    _deliver(copy, HFKVCacheEngine(copy), trained)
    for (name, a), (_, b) in zip(copy.named_parameters(), trained.named_parameters(), strict=True):
        assert torch.equal(a, b), name


def _lora(seed: int):
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(_tiny(), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    torch.manual_seed(seed)
    for name, p in model.named_parameters():
        if "lora_" in name:
            torch.nn.init.normal_(p, std=0.1)
    return model


def test_lora_adapters_are_merged_on_the_rollout_rank_and_only_the_adapted_layers_loaded():
    copy, trained = _lora(1), _lora(2)
    base_names = {n for n, _ in _tiny().named_parameters()}
    engine = _Engine()
    _deliver(copy, engine, trained, limit=256)
    [loaded] = engine.loads  # the adapters need each other and the base: one load once all have arrived
    assert loaded and set(loaded) <= base_names  # vLLM's names: the base model's
    assert {n.rsplit(".", 2)[-2] for n in loaded} == {"q_proj", "v_proj"}  # the frozen rest is left out
    merged = trained.merge_and_unload().state_dict()
    for name, tensor in loaded.items():
        torch.testing.assert_close(tensor, merged[name], rtol=1e-6, atol=1e-6)


def test_a_delivered_engine_is_not_pushed_or_put_to_sleep_around_a_rollout():
    engine = _Engine()
    engine.sleep = lambda: pytest.fail("a rollout rank's engine must not sleep")
    with synced(engine, _tiny()):
        pass
    assert engine.loads == []


# ------------------------------------------------------------------------------ two processes, gloo
def _checksum(named: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for name in sorted(named):
        digest.update(name.encode())
        digest.update(named[name].detach().float().contiguous().numpy().tobytes())
    return digest.hexdigest()


def _async_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    """Rank 0 trains, rank 1 samples with vLLM: per delivered version, the checksum of what each side holds."""
    from verl.rollout import async_rollout
    from verl.trainer.rl_trainer import RLTrainer

    W.setup(rank, world, port)
    out = Path(out_dir)
    lora = ["model.lora.rank=4"] if (out / "lora").exists() else []
    config = rl_config(out, "rollout.engine=vllm", "devices.actor=[0]", "devices.rollout=[1]",
                       "rollout.max_staleness=0", "trainer.total_steps=3", "actor.lr=0.05", "actor.grad_clip=null",
                       "rollout.temperature=0.7", *lora)
    trainer = RLTrainer(config)
    engine, sums = trainer.engine, {}
    names = [n for n, _ in engine.llm.weights.named_parameters()]
    deliver = async_rollout.AsyncRollout.deliver

    def recorded(self, model, version):
        result = deliver(self, model, version)
        if self.generates:  # what vLLM holds now
            sums[version] = _checksum(dict(engine.llm.weights.named_parameters()))
        else:  # the actor's weights of this version, as vLLM names them
            held = dict(policy_weights(model))
            sums[version] = _checksum({n: held[n] for n in names})
        return result

    async_rollout.AsyncRollout.deliver = recorded
    trainer.fit()
    report = {"sums": sums, "log": engine.llm.log, "fed": engine.fed_by_deliveries,
              "sleep_mode": engine.sleep_mode, "partial": trainer.async_rollout.partial,
              "copy_device": str(next(trainer.model.parameters()).device)}
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


@pytest.mark.dist
@pytest.mark.slow  # two forked gloo ranks building the trainer
@pytest.mark.usefixtures("stand_in_vllm")
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_every_delivery_reaches_the_rollout_ranks_vllm_with_the_actors_weights(tmp_path, lora):
    if lora:
        pytest.importorskip("peft")
        (tmp_path / "lora").touch()
    W.launch(_async_worker, 2, str(tmp_path))
    actor, rollout = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert list(rollout["sums"]) == ["0", "1", "2", "3"]  # the first step's delivery, then one per update
    assert rollout["sums"] == actor["sums"]  # vLLM held the actor's exact weights after every delivery
    assert len(set(actor["sums"].values())) == 4  # ... and they changed every update
    assert rollout["fed"] and not rollout["sleep_mode"] and not rollout["partial"]
    assert rollout["copy_device"] == "cpu"
    log = rollout["log"]
    assert log.count("generate") == 3 and not any(e.startswith(("sleep", "wake")) for e in log)
    assert log.count("load_weights") >= 4
    assert not actor["fed"] and actor["sleep_mode"]  # the actor rank's engine (validation) sleeps as colocated
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:  # k = 0: behaviour log-probs are vLLM's, from the actor's weights of this step
        assert row["rollout/logprob_diff_max"] < 1e-4 and row["async/staleness"] == 0.0
