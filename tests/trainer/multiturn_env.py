"""A multi-turn environment for the trainer tests (loaded through env.name: multiturn_env.py:ToolEnv).

The random tiny model never writes a real tool call, so every first turn gets an observation; the second
turn is scored by its (smoothed) share of digits (dense and varied within a group, so every step has a gradient)."""

from verl.env import Done, MultiTurnEnv, Observation


class ToolEnv(MultiTurnEnv):
    def __init__(self, seed=0, shuffle=True, max_turns=3, max_episode_tokens=24, num_rows=24):
        rows = [{"prompt": f"{i}+{i % 7}=", "ground_truth": str(i + i % 7), "data_source": "tool", "metadata": {}}
                for i in range(num_rows)]
        super().__init__(rows[4:], val_rows=rows[:4], max_turns=max_turns, max_episode_tokens=max_episode_tokens,
                         seed=seed, shuffle=shuffle)

    def start(self, row):
        return row["prompt"], {"turn": 0}

    def step(self, state, model_text):
        state["turn"] += 1
        if state["turn"] == 1:
            return Observation(f" <result>{len(model_text)}</result>", tool_call=True,
                               tool_error=len(model_text) % 2 == 1)
        # Smoothed share of digits: nonzero and different for turns of different lengths, so that no seed
        # leaves a whole group (or a whole batch) without an advantage.
        return Done(reward=(1 + sum(c.isdigit() for c in model_text)) / (2 + len(model_text)))
