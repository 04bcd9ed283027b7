"""A custom reward function: `custom_reward_function.path=examples/my_reward.py custom_reward_function.name=compute_score`.

Batched form: lists in, a list of floats out. Extra dataset columns arrive as keyword arguments.
"""


def compute_score(prompts, responses, ground_truth=None, **kwargs):
    truths = ground_truth or [None] * len(responses)
    return [1.0 if t is not None and str(t).strip() in r else 0.0 for r, t in zip(responses, truths)]
