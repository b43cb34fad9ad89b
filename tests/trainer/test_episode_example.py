"""A scripted episode for the warm start is tokenised as the rollout sees one, and learns model turns only."""

from __future__ import annotations

from verl.config import load_config
from verl.trainer.rl_trainer import RLTrainer


def test_calculator_episode_masks_the_observation_and_matches_the_rollout(tmp_path):
    config = load_config("examples/tool_calculator.yaml", [
        f"trainer.run_dir={tmp_path}", "trainer.resume=never", "env.kwargs.num_train=40", "env.kwargs.num_val=4",
        "logging.backends=[jsonl]"])
    trainer = RLTrainer(config)
    tok = trainer.tokenizer
    row, segments = trainer.env.formatted_episode((347, 29))
    assert row["prompt"] == "347*29=" and row["ground_truth"] == "10063"
    assert segments == [("<calc>347*29</calc>", True), (" <result>10063</result>", False), (" 10063", True)]
    ids, labels = trainer.multiturn.example(row, segments, trainer.sampling.eos_token_ids[0])
    prompt_ids, prompt_mask = trainer.encode_prompts([row])
    prompt = prompt_ids[0][prompt_mask[0].bool()].tolist()
    assert ids[: len(prompt)] == prompt and set(labels[: len(prompt)]) == {-100}
    learned = [t for t, lab in zip(ids, labels, strict=True) if lab != -100]
    assert learned == [lab for lab in labels if lab != -100]
    assert learned[-1] in trainer.sampling.eos_token_ids
    assert tok.decode(learned[:-1]) == "<calc>347*29</calc> 10063"
    # The observation is exactly what the rollout appends after the call, and none of it is learned.
    observed = [t for t, lab in zip(ids[len(prompt):], labels[len(prompt):], strict=True) if lab == -100]
    assert observed == trainer.multiturn.encode(" <result>10063</result>")
    call = trainer.multiturn.encode("<calc>347*29</calc>")
    assert ids[len(prompt): len(prompt) + len(call)] == call
