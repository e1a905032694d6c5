"""Evaluation metrics as papers report them, pure functions of per-sample verdicts.

Inputs are per question: `verdicts[q]` the correctness of its n samples in sampling
order, `answers[q]` their extracted, normalised final answers (None: no answer).

- mean@n: the mean verdict over all n samples of a question, averaged over questions
  (verl's `mean@N`; the expected accuracy of one sample).
- pass@k: the unbiased estimator of Chen et al. 2021 ("Evaluating Large Language Models
  Trained on Code", eq. 1): with c correct of n samples, 1 - C(n-c, k) / C(n, k), computed
  as 1 - prod_{i=n-c+1}^{n} (1 - k/i), which never forms a large binomial.
- maj@k: the majority answer among the first k samples (None never votes) is graded;
  a tie goes to the tied answer that appears first in sampling order, and a question
  whose first k samples have no answer counts as wrong.
- greedy accuracy: the mean verdict of one greedy sample per question.
k runs over 1, 2, 4, ... (powers of two) up to n, plus n itself (`ks_up_to`).
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from typing import Hashable, Mapping, Sequence

from grpo_core.errors import UserError


def ks_up_to(n: int) -> list[int]:
    """1, 2, 4, ... while <= n, then n itself if it is not a power of two."""
    if n < 1:
        raise UserError(f"eval.n = {n}: need at least one sample per question; set eval.n >= 1")
    ks, k = [], 1
    while k <= n:
        ks.append(k)
        k *= 2
    return ks if ks[-1] == n else ks + [n]


def check_k(k: int, n: int) -> None:
    if not 1 <= k <= n:
        raise UserError(f"k = {k} is outside 1..n with n = {n} samples per question; "
                        f"ask for k <= n or raise eval.n to at least {k}")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples drawn without replacement from n (c of
    them correct) is correct: 1 - C(n-c, k) / C(n, k)."""
    check_k(k, n)
    if not 0 <= c <= n:
        raise ValueError(f"c = {c} correct samples is outside 0..n = {n}")
    if n - c < k:  # every draw of k samples holds a correct one
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def mean_pass_at_k(verdicts: Sequence[Sequence[bool]], k: int) -> float:
    """pass@k averaged over questions."""
    return _mean([pass_at_k(len(v), sum(map(bool, v)), k) for v in verdicts])


def mean_at_n(verdicts: Sequence[Sequence[bool]]) -> float:
    """The mean verdict of each question's samples, averaged over questions."""
    return _mean([sum(map(bool, v)) / len(v) for v in verdicts])


def greedy_accuracy(verdicts: Sequence[Sequence[bool]]) -> float:
    """The fraction of questions whose first (greedy) sample is correct."""
    return _mean([float(bool(v[0])) for v in verdicts])


def majority_index(answers: Sequence[Hashable | None]) -> int | None:
    """Position of the sample whose answer wins the vote (first occurrence of the most
    frequent non-None answer, ties to the earliest first occurrence); None if no answer."""
    counts = Counter(a for a in answers if a is not None)
    if not counts:
        return None
    best = max(counts.values())
    return next(i for i, a in enumerate(answers) if a is not None and counts[a] == best)


def maj_at_k(answers: Sequence[Sequence[Hashable | None]], verdicts: Sequence[Sequence[bool]], k: int) -> float:
    """The fraction of questions whose majority answer among the first k samples is correct."""
    hits = []
    for question_answers, question_verdicts in zip(answers, verdicts, strict=True):
        check_k(k, len(question_verdicts))
        winner = majority_index(question_answers[:k])
        hits.append(float(winner is not None and bool(question_verdicts[winner])))
    return _mean(hits)


def summarize(verdicts: Sequence[Sequence[bool]], answers: Sequence[Sequence[Hashable | None]],
              greedy: bool = False, ks: Sequence[int] | None = None) -> dict[str, float]:
    """Every metric of one set of questions with n samples each (n equal for all); pass@k and
    maj@k for each of `ks` (default `ks_up_to(n)`). Greedy samples give greedy accuracy alone."""
    n = _common_n(verdicts)
    if greedy:
        return {"greedy_accuracy": greedy_accuracy(verdicts), "questions": len(verdicts)}
    out: dict[str, float] = {f"mean@{n}": mean_at_n(verdicts)}
    ks = ks_up_to(n) if ks is None else ks
    for k in ks:
        out[f"pass@{k}"] = mean_pass_at_k(verdicts, k)
    for k in ks:
        out[f"maj@{k}"] = maj_at_k(answers, verdicts, k)
    out["questions"] = len(verdicts)
    return out


def breakdown(verdicts: Sequence[Sequence[bool]], answers: Sequence[Sequence[Hashable | None]],
              fields: Sequence[Mapping[str, object]], greedy: bool = False,
              ks: Sequence[int] | None = None) -> dict[str, dict[str, dict]]:
    """`summarize` per value of each field the questions carry: {field: {value: metrics}}
    (e.g. MATH's subject and level)."""
    groups: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(list))
    for question, question_fields in enumerate(fields):
        for name, value in question_fields.items():
            groups[name][str(value)].append(question)
    return {name: {value: summarize([verdicts[q] for q in members], [answers[q] for q in members], greedy, ks)
                   for value, members in sorted(values.items())}
            for name, values in sorted(groups.items())}


def _common_n(verdicts: Sequence[Sequence[bool]]) -> int:
    sizes = {len(v) for v in verdicts}
    if len(sizes) != 1 or 0 in sizes:
        raise ValueError(f"every question needs the same number (>= 1) of samples, got sizes {sorted(sizes)}")
    return sizes.pop()


def _mean(values: list[float]) -> float:
    if not values:
        raise ValueError("no questions to average over")
    return math.fsum(values) / len(values)  # exact sum: the same mean in any question order (a regrade's)
