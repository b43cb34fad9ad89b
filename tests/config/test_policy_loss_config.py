"""actor.policy_loss and its options at config load: names from the registry, options checked per loss."""

import pytest

from verl.config import load_config
from verl.errors import ConfigError


def test_default_is_ppo_with_the_old_clip_ranges():
    actor = load_config().actor
    assert actor.policy_loss == "ppo"
    assert actor.loss_kwargs() == {"clip_low": 0.2, "clip_high": 0.2, "dual_clip": None}


def test_unknown_loss_gets_did_you_mean_and_the_registered_names():
    with pytest.raises(ConfigError) as err:
        load_config(overrides=["actor.policy_loss=cipso"])
    msg = str(err.value)
    assert "actor.policy_loss" in msg and "Did you mean 'cispo'" in msg and "ppo, gspo, cispo, gmpo" in msg


def test_options_of_another_loss_are_refused_with_the_losss_own_options():
    with pytest.raises(ConfigError) as err:
        load_config(overrides=["actor.policy_loss=clip_cov", "actor.loss_options={fracton: 1e-3}", "actor.dual_clip=3"])
    msg = str(err.value)
    assert "'fracton' is not an option of policy_loss clip_cov. Did you mean 'fraction'?" in msg
    assert "actor.dual_clip is not an option of policy_loss clip_cov" in msg
    assert "Its options: fraction, cov_low, cov_high" in msg
    with pytest.raises(ConfigError, match="kl_cov option fraction=2 must be a number in"):
        load_config(overrides=["actor.policy_loss=kl_cov", "actor.loss_options={fraction: 2}"])
    with pytest.raises(ConfigError, match="clip_high is set twice"):
        load_config(overrides=["actor.clip_high=0.28", "actor.loss_options={clip_high: 0.3}"])


def test_options_override_the_losss_defaults():
    actor = load_config(overrides=["actor.policy_loss=gspo", "actor.clip_high=5e-4"]).actor
    assert actor.loss_kwargs() == {"clip_low": 3e-4, "clip_high": 5e-4}
    actor = load_config(overrides=["actor.policy_loss=kl_cov", "actor.loss_options={kl_coef: 0.5}"]).actor
    assert actor.loss_kwargs() == {"fraction": 2e-3, "kl_coef": 0.5}
    # YAML 1.1 reads 1e-3 as text: still the number meant
    actor = load_config(overrides=["actor.policy_loss=clip_cov", "actor.loss_options={fraction: 1e-3}"]).actor
    assert actor.loss_kwargs()["fraction"] == 1e-3


def test_importance_sampling_sequence_still_means_gspo_with_a_deprecation_warning():
    with pytest.warns(FutureWarning, match="actor.importance_sampling is deprecated: use actor.policy_loss: gspo"):
        actor = load_config(overrides=["actor.importance_sampling=sequence"]).actor
    assert actor.policy_loss == "gspo"
    assert actor.loss_kwargs() == {"clip_low": 0.2, "clip_high": 0.2}  # what it clipped with before
    with pytest.warns(FutureWarning):
        actor = load_config(overrides=["actor.importance_sampling=sequence", "actor.clip_low=3e-4"]).actor
    assert actor.loss_kwargs() == {"clip_low": 3e-4, "clip_high": 0.2}
    with pytest.raises(ConfigError, match="contradicts policy_loss: cispo"):
        load_config(overrides=["actor.importance_sampling=sequence", "actor.policy_loss=cispo"])


def test_the_covariance_losses_turn_zero_advantage_skipping_off():
    """clip_cov/kl_cov select tokens across the micro-batch, so leaving rows out would change the loss."""
    from verl.trainer.rl.update import skips_zero_advantage

    assert skips_zero_advantage(load_config().actor)
    assert skips_zero_advantage(load_config(overrides=["actor.policy_loss=cispo"]).actor)
    assert not skips_zero_advantage(load_config(overrides=["actor.policy_loss=clip_cov"]).actor)
    assert not skips_zero_advantage(load_config(overrides=["actor.policy_loss=kl_cov"]).actor)


def test_the_docs_table_lists_every_registered_loss_with_its_paper_and_options():
    from pathlib import Path

    from verl.algorithms.policy_losses import POLICY_LOSSES

    text = (Path(__file__).resolve().parents[2] / "docs" / "training.md").read_text(encoding="utf-8")
    rows = {line.split("|")[1].strip().split()[0].strip("`"): line for line in text.splitlines()
            if line.startswith("| `")}
    for name, loss in POLICY_LOSSES.items():
        assert name in rows, f"docs/training.md's policy-loss table lacks {name}"
        arxiv = loss.paper.split()[0].removeprefix("arXiv:")
        assert arxiv in rows[name]
        assert all(f"`{option}`" in rows[name] for option in loss.options)
