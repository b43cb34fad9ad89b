"""The RL step's stages after sampling: rewards, advantages, correction and drift, distillation, the policy/critic
update, evaluation and step metrics."""
