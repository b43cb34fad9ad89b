"""An example user reward function: `reward.functions: [{name: examples/reward_fn.py:concise_and_correct}]`.

verl calls it as fn(prompt, response, ground_truth, **metadata) and accepts a float or a dict with a
`score` key plus extra metrics (logged as reward/concise_and_correct/<key>).
"""

import re


def concise_and_correct(prompt, response, ground_truth, **metadata):
    numbers = re.findall(r"-?\d+(?:\.\d+)?", response.replace(",", ""))
    truth = str(ground_truth).split("####")[-1].strip()
    correct = bool(numbers) and float(numbers[-1]) == float(truth)
    return {"score": (1.0 if correct else 0.0) - 0.001 * len(response.split()), "correct": float(correct)}
