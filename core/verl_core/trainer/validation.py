"""Validation metrics: mean@k and the unbiased pass@k estimator, per data source and overall.

A validation generates ``k`` samples per prompt (sampled; greedy decoding gives one answer, so
``k = 1``) and scores each with the run's reward function; ``summarize`` turns the scores into the
step's validation metrics:

- ``val/<data_source>/mean@k``: the mean score of a prompt's samples, averaged over the prompts of
  that data source;
- ``val/<data_source>/pass@k``: the chance that at least one of ``k`` samples is correct, averaged
  likewise (a sample is correct when its score reaches ``correct_threshold``);
- ``val/score/mean`` and ``val/pass@k``: the same over every prompt, each prompt counting once.

With ``n >= k`` samples of a prompt of which ``c`` are correct, Chen et al. 2021 (*Evaluating Large
Language Models Trained on Code*, section 2.1) estimate pass@k without bias as
``1 - C(n - c, k) / C(n, k)``: one minus the chance that ``k`` of the ``n`` samples drawn without
replacement are all wrong. ``pass_at_k`` computes it as a product, exact where it must be (0 with no
correct sample, 1 when fewer than ``k`` are wrong) and without the binomials' huge intermediates.
mean@k uses every one of the ``n`` samples, which is likewise the unbiased estimate of the mean
score of ``k`` of them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from verl_core.trainer.metrics import VAL_SCORE_KEY

#: A validation sample is correct (for pass@k) when its score is at least this: the built-in reward
#: functions score a right answer 1.0 and anything else less.
CORRECT_THRESHOLD = 1.0


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate of pass@k from ``n`` samples of which ``c`` are correct:
    ``1 - C(n - c, k) / C(n, k)``, as ``1 - prod(1 - k / i for i in n - c + 1 .. n)``."""
    if not 1 <= k <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n (the samples per prompt), got k={k}, n={n}")
    if not 0 <= c <= n:
        raise ValueError(f"the correct samples c must be between 0 and n={n}, got c={c}")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def summarize(
    scores_by_prompt: Sequence[Sequence[float]],
    data_sources: Sequence[str],
    k: int,
    correct_threshold: float = CORRECT_THRESHOLD,
) -> dict[str, float]:
    """The validation metrics of one validation (see the module docstring for the keys).

    ``scores_by_prompt[i]`` holds the scores of prompt ``i``'s samples (at least ``k``), and
    ``data_sources[i]`` its dataset's ``data_source``. Data sources are listed in sorted order, then
    the overall metrics.
    """
    if len(scores_by_prompt) != len(data_sources):
        raise ValueError(
            f"{len(scores_by_prompt)} prompts' scores but {len(data_sources)} data sources: give one per prompt"
        )
    if not scores_by_prompt:
        raise ValueError("no validation prompts to summarize")
    by_source: dict[str, list[tuple[float, float]]] = {}
    for index, (scores, source) in enumerate(zip(scores_by_prompt, data_sources, strict=True)):
        if len(scores) < k:
            raise ValueError(
                f"validation prompt {index} ({source}) has {len(scores)} sample(s); pass@{k} and "
                f"mean@{k} need at least k={k} per prompt"
            )
        if not all(math.isfinite(score) for score in scores):
            raise ValueError(f"validation prompt {index} ({source}) has a score that is not finite: {scores}")
        correct = sum(score >= correct_threshold for score in scores)
        prompt = (math.fsum(scores) / len(scores), pass_at_k(len(scores), correct, k))
        by_source.setdefault(source, []).append(prompt)
    metrics = {}
    for source in sorted(by_source):
        means, passes = zip(*by_source[source], strict=True)
        metrics[f"val/{source}/mean@{k}"] = math.fsum(means) / len(means)
        metrics[f"val/{source}/pass@{k}"] = math.fsum(passes) / len(passes)
    every = [prompt for prompts in by_source.values() for prompt in prompts]
    metrics[VAL_SCORE_KEY] = math.fsum(mean for mean, _ in every) / len(every)
    metrics[f"val/pass@{k}"] = math.fsum(passed for _, passed in every) / len(every)
    return metrics
