"""Built-in reward rules, registered by name through ``rlcore_register_rewards`` (the ``defaults`` plugin).

Every rule is *batched*: ``rule(prompts, responses, **columns) -> list[float]``, one score per sample.
Dataset columns arrive as keyword arguments holding one value per sample (``ground_truth``, ``data_source`` …);
a rule reads the ones it needs and ignores the rest.

===================  ==========================================================================  ===========
name                 score                                                                       needs
===================  ==========================================================================  ===========
``exact_match``      1 if the normalised response equals the (or one of the) ground truth(s)      ground_truth
``gsm8k``            1 if the answer after the last ``#### `` equals the reference number         ground_truth
``math_equiv``       1 if the final answer (``\\boxed{}``, ``####``, "answer is", last number) is  ground_truth
                     numerically equal to the reference (fractions, LaTeX, commas handled)
``format_penalty``   0 when the response carries a final-answer marker (``####``, ``\\boxed{}``,  —
                     ``<answer>…</answer>``) and closes any ``<think>``; -1 otherwise
``length_penalty``   0 up to ``max_response_length - buffer`` tokens, then falls linearly to -1    —
``demo_alphabet``    the demo task's rule (:func:`rlcore.demo.alphabet_score`)                    —
===================  ==========================================================================  ===========
"""

from __future__ import annotations

import math
import re
from typing import Any, Callable, Optional, Sequence

#: Default longest response of ``length_penalty`` (tokens), overridden by a ``max_response_length`` column.
LENGTH_PENALTY_MAX = 1024
#: Tokens before ``max_response_length`` over which ``length_penalty`` ramps from 0 to -1.
LENGTH_PENALTY_BUFFER = 256

_NUMBER = r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?|[-+]?\.\d+"
_NUMBER_RE = re.compile(_NUMBER)
_FRACTION_RE = re.compile(rf"\(?({_NUMBER})\)?/\(?({_NUMBER})\)?")
_LATEX_FRAC_RE = re.compile(r"\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}")
_GSM8K_RE = re.compile(r"####\s*([^\n]*)")
_ANSWER_IS_RE = re.compile(r"answer is\s*:?\s*([^\n]+)", re.IGNORECASE)
_ANSWER_MARKER_RE = re.compile(r"####\s*\S|\\boxed\{|<answer>.*?</answer>", re.DOTALL)
_LATEX_NOISE = ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\$", "$", "^\\circ", "^{\\circ}")


# ---------------------------------------------------------------------------------------------
# Answer extraction and comparison (pure string functions)
# ---------------------------------------------------------------------------------------------


def normalize_text(text: Any) -> str:
    """Lower-case, collapse white space, drop surrounding quotes and a trailing period."""
    s = " ".join(str(text).split()).lower()
    s = s.strip("\"'`")
    return s[:-1].rstrip() if s.endswith(".") else s


def parse_number(text: Any) -> Optional[float]:
    """The number written in ``text`` (``1,234``, ``-0.5``, ``3/4``, ``\\frac{3}{4}``, ``$12``, ``50%``), else None."""
    if isinstance(text, bool) or text is None:
        return None
    if isinstance(text, (int, float)):
        return float(text)
    s = re.sub(r"\\text\{[^{}]*\}", "", str(text))
    for noise in _LATEX_NOISE:
        s = s.replace(noise, "")
    s = "".join(s.split()).rstrip(".").rstrip("%").replace("\\%", "")
    s = _LATEX_FRAC_RE.sub(r"(\1)/(\2)", s)
    s = s.replace("{", "").replace("}", "")
    if s[:1] in "+-" and s[1:2] == "(":  # a sign before a fraction: -\frac{1}{2}
        inner = parse_number(s[1:])
        return None if inner is None else (-inner if s[0] == "-" else inner)
    m = _FRACTION_RE.fullmatch(s)
    if m:
        den = float(m.group(2).replace(",", ""))
        return float(m.group(1).replace(",", "")) / den if den != 0 else None
    if _NUMBER_RE.fullmatch(s):
        return float(s.replace(",", ""))
    return None


def extract_boxed(text: str) -> Optional[str]:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces balanced; None if absent."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth = 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j].strip()
    return None


def extract_gsm8k(text: str) -> Optional[str]:
    """The answer after the last ``####`` (``"... #### 1,234"`` -> ``"1,234"``); None if there is none."""
    found = _GSM8K_RE.findall(str(text))
    if not found:
        return None
    answer = found[-1].strip().rstrip(".").strip()
    return answer or None


def extract_final_answer(text: str) -> Optional[str]:
    """The final answer of a worked solution: ``\\boxed{}``, then ``####``, then "answer is …", then the last number."""
    text = str(text)
    for extract in (extract_boxed, extract_gsm8k):
        answer = extract(text)
        if answer is not None:
            return answer
    m = _ANSWER_IS_RE.findall(text)
    if m:
        return m[-1].strip().rstrip(".").strip()
    numbers = _NUMBER_RE.findall(text)
    return numbers[-1] if numbers else None


def answers_equal(predicted: Optional[str], reference: Any, rel_tol: float = 1e-6) -> bool:
    """Numeric equality when both sides parse as numbers, else equality of normalised LaTeX-free text."""
    if predicted is None or reference is None:
        return False
    a, b = parse_number(predicted), parse_number(reference)
    if a is not None and b is not None:
        return math.isclose(a, b, rel_tol=rel_tol, abs_tol=1e-9)

    def canon(s: Any) -> str:
        s = str(s)
        for noise in _LATEX_NOISE:
            s = s.replace(noise, "")
        return normalize_text(s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")).replace(" ", "")

    return canon(predicted) == canon(reference)


def format_ok(response: str, pattern: Optional[str] = None) -> bool:
    """Whether ``response`` is well formed: ``pattern`` matches, or by default it has a final-answer marker
    and every ``<think>`` is closed."""
    if pattern:
        return re.search(pattern, response, re.DOTALL) is not None
    if not response.strip():
        return False
    if "<think>" in response and "</think>" not in response.rsplit("<think>", 1)[1]:
        return False
    return _ANSWER_MARKER_RE.search(response) is not None


def overlong_penalty(length: int, max_length: int, buffer: int) -> float:
    """0 while ``length <= max_length - buffer``, then linear down to -1 at ``max_length`` (-1 beyond)."""
    start = max_length - buffer
    if length <= start:
        return 0.0
    return -min(1.0, (length - start) / max(1, buffer))


# ---------------------------------------------------------------------------------------------
# The rules (batched)
# ---------------------------------------------------------------------------------------------


def _references(ground_truth: Optional[Sequence[Any]], n: int, rule: str) -> Sequence[Any]:
    if ground_truth is None:
        from rlcore.errors import RewardError

        raise RewardError(f"reward '{rule}' needs a 'ground_truth' column in the dataset; the rows have none")
    if len(ground_truth) != n:
        from rlcore.errors import RewardError

        raise RewardError(f"reward '{rule}': {len(ground_truth)} ground_truth values for {n} responses")
    return ground_truth


def _options(reference: Any) -> list[Any]:
    """A reference may list several accepted answers."""
    return list(reference) if isinstance(reference, (list, tuple)) else [reference]


def _column(values: Optional[Sequence[Any]], i: int) -> Any:
    return None if values is None else values[i]


def exact_match(prompts: Sequence[str], responses: Sequence[str],
                ground_truth: Optional[Sequence[Any]] = None, **_: Any) -> list[float]:
    """1.0 where the normalised response equals a normalised reference, else 0.0."""
    refs = _references(ground_truth, len(responses), "exact_match")
    return [float(any(normalize_text(r) == normalize_text(o) for o in _options(ref) if o is not None))
            for r, ref in zip(responses, refs)]


def gsm8k(prompts: Sequence[str], responses: Sequence[str],
          ground_truth: Optional[Sequence[Any]] = None, **_: Any) -> list[float]:
    """1.0 where the answer after the response's last ``####`` equals the reference (strict: no ``####`` -> 0)."""
    refs = _references(ground_truth, len(responses), "gsm8k")
    out = []
    for response, ref in zip(responses, refs):
        predicted = extract_gsm8k(response)
        wanted = [extract_gsm8k(o) or o for o in _options(ref) if o is not None]
        out.append(float(any(answers_equal(predicted, str(w)) for w in wanted)))
    return out


def math_equiv(prompts: Sequence[str], responses: Sequence[str],
               ground_truth: Optional[Sequence[Any]] = None, **_: Any) -> list[float]:
    """1.0 where the response's final answer equals the reference numerically (or as normalised text)."""
    refs = _references(ground_truth, len(responses), "math_equiv")
    out = []
    for response, ref in zip(responses, refs):
        predicted = extract_final_answer(response)
        wanted = []
        for o in _options(ref):
            if o is None:
                continue
            s = str(o)
            wanted.append(extract_final_answer(s) if ("\\boxed" in s or "####" in s) else s)
        out.append(float(any(answers_equal(predicted, w) for w in wanted)))
    return out


def format_penalty(prompts: Sequence[str], responses: Sequence[str],
                   format_pattern: Optional[Sequence[Optional[str]]] = None, **_: Any) -> list[float]:
    """0.0 for a well-formed response (see :func:`format_ok`; a ``format_pattern`` column overrides), else -1.0."""
    return [0.0 if format_ok(r, _column(format_pattern, i)) else -1.0 for i, r in enumerate(responses)]


def length_penalty(prompts: Sequence[str], responses: Sequence[str],
                   response_ids: Optional[Sequence[Sequence[int]]] = None,
                   max_response_length: Optional[Sequence[Optional[int]]] = None, **_: Any) -> list[float]:
    """Soft over-length penalty in [-1, 0] on the response length in tokens (words when ids are absent).

    Limit: a ``max_response_length`` column, else :data:`LENGTH_PENALTY_MAX`; ramp: :data:`LENGTH_PENALTY_BUFFER`
    tokens (at most half the limit).
    """
    out = []
    for i, response in enumerate(responses):
        length = len(response_ids[i]) if response_ids is not None else len(response.split())
        limit = int(_column(max_response_length, i) or LENGTH_PENALTY_MAX)
        out.append(overlong_penalty(length, limit, min(LENGTH_PENALTY_BUFFER, limit // 2)))
    return out


def env_reward(prompts: Sequence[str], responses: Sequence[str], env_reward: Sequence[Any] = (),
               **_: Any) -> list[float]:
    """The reward the episode's environment gave (the sum of its turns' rewards; 0 when it gave
    none, or for a row without an environment). Multi-turn runs (``data.env_key``) score with it
    when no other reward is configured."""
    values = list(env_reward) or [None] * len(responses)
    return [float(v) if v is not None else 0.0 for v in values]


#: Rules of the demo task: registered name -> function name in :mod:`rlcore.demo`.
DEMO_RULES = {"demo_alphabet": "alphabet_score"}


def _lazy_demo_rule(attr: str) -> Callable[..., list[float]]:
    def rule(prompts: Sequence[str], responses: Sequence[str], **extras: Any) -> list[float]:
        import rlcore.demo

        return getattr(rlcore.demo, attr)(prompts, responses, **extras)

    rule.__name__ = rule.__qualname__ = attr
    rule.__doc__ = f"The demo task's rule (:func:`rlcore.demo.{attr}`), imported on first use."
    return rule


def _demo_rules() -> dict[str, Callable[..., list[float]]]:
    """The demo's rules that exist; each registered rule *is* the demo's function (the module is light)."""
    try:
        import rlcore.demo as demo
    except ImportError:  # pragma: no cover - only before the demo module exists
        return {name: _lazy_demo_rule(attr) for name, attr in DEMO_RULES.items()}
    return {name: getattr(demo, attr) for name, attr in DEMO_RULES.items()}


#: The built-in rules by name.
BUILTIN_REWARDS: dict[str, Callable[..., list[float]]] = {
    "exact_match": exact_match,
    "gsm8k": gsm8k,
    "math_equiv": math_equiv,
    "format_penalty": format_penalty,
    "length_penalty": length_penalty,
    "env_reward": env_reward,
    **_demo_rules(),
}
