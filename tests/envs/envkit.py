"""Helpers of the environment tests: a word tokenizer stub and letter-prompt episodes."""

from rlcore.demo import LETTERS
from rlcore.envs.runner import EpisodePrompt
from rlcore.rollout.base import SamplingParams


class WordTok:
    """A tokenizer stub for the episode runner: one token (id 7) per word of an observation; 1 is EOS."""

    eos_token_id = 1
    chat_template = None

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [7] * len(text.split())}


def letter_episodes(runner, tok, env: str, n: int):
    """``n`` episodes of ``env`` and their prompts: three letters of the demo alphabet each."""
    episodes = runner.start([env] * n, [{}] * n)
    prompts = [EpisodePrompt(tok.convert_tokens_to_ids(list(LETTERS[i % 8:i % 8 + 3])), e)
               for i, e in enumerate(episodes)]
    return episodes, prompts


def sampled(tok, max_new_tokens: int, seed: int) -> SamplingParams:
    """Temperature-1 sampling that ends a turn at the tokenizer's EOS."""
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0, seed=seed,
                          eos_token_ids=(tok.eos_token_id,), pad_token_id=tok.pad_token_id)
