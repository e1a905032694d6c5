"""The `judge` reward: a generative judge grades each completion, either served behind an
OpenAI-compatible endpoint (`url`) or a local HF model (`path`) that the run loads onto its mesh
and decodes greedily with its own rollout backend (`assembly.judge_model`). Its prompt is
`template` over the example's question, the completion (a multi-turn row's final answer), the
whole conversation and the reference; its reply's verdict is the first group of the last match
of `pattern`, mapped to a score by `scores` (or read as a number when `scores` is empty).

A verdict that cannot be read scores 0 and counts as `unparsed`; a request that still fails
after its retries returns None (scores 0, counted in the reward's errors: `training.scoring`).
Requests of a batch run concurrently on `workers` threads; a local judge decodes the batch at
once. docs/rewards.md has the options.
"""

from __future__ import annotations

import json
import os
import re
import string
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal, Optional, Sequence

from grpo_core import RewardSpec
from grpo_core.config import setting
from grpo_core.contracts import RewardFn

from grpo_runner_gsm8k.tasks.rewards import check_pairs

TEMPLATE_FIELDS = ("question", "completion", "conversation", "reference")
DEFAULT_TEMPLATE = ("Question:\n{question}\n\nReference answer:\n{reference}\n\nResponse:\n{completion}\n\n"
                    "Is the response's final answer correct? End with 'Verdict: yes' or 'Verdict: no'.")
RETRIED_STATUS = (408, 429, 500, 502, 503, 504)  # busy or failing servers; other 4xx are our request's fault


@dataclass(frozen=True)
class JudgeOptions:
    """Options of the `judge` reward (`task.reward_options.judge`)."""

    url: str = setting("", "Base URL of an OpenAI-compatible server, e.g. http://judge:8000/v1 "
                       "(requests go to <url>/chat/completions); or set `path`.")
    path: str = setting("", "A local judge: an HF model directory or Hub id of a supported family, loaded onto the "
                        "run's mesh like the teacher and decoded greedily by the run's rollout backend.")
    dtype: Literal["float32", "bfloat16"] = setting("bfloat16", "The local judge's weights and compute dtype.")
    model: str = setting("", "The model name sent with each request (url).")
    template: str = setting(DEFAULT_TEMPLATE, "The judge's user message: a template over {question}, {completion}, "
                            "{conversation} and {reference} ({{ and }} for literal braces).")
    system_prompt: str = setting("", "The judge's system message; empty for none.")
    pattern: str = setting(r"(?i)verdict:\s*(yes|no)", "A regular expression; the verdict is the first group "
                           "(else the whole match) of its last match in the reply.")
    scores: dict = setting({"yes": 1.0, "no": 0.0}, "Verdict (lower-cased) -> score; empty: the verdict is read "
                           "as a number.")
    max_tokens: int = setting(512, "Longest reply asked for.", ge=1)
    temperature: float = setting(0.0, "The judge's sampling temperature (0: greedy).", ge=0)
    timeout_s: float = setting(60.0, "Wall-clock limit of one request.", gt=0)
    retries: int = setting(2, "Further tries of a request that timed out, could not connect or got 408/429/5xx.",
                           ge=0)
    retry_wait_s: float = setting(1.0, "Wait before the first retry; doubled before each next one.", ge=0)
    workers: int = setting(8, "Requests at once.", ge=1)
    api_key_env: str = setting("", "Name of an environment variable holding a bearer token; empty sends none.")


def check_template(template: str) -> None:
    """A template naming a field the judge cannot fill is refused when the reward is built."""
    try:
        names = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as exc:
        raise ValueError(f"template {template[:60]!r} is not a valid template ({exc}); write fields as {{name}} "
                         "and literal braces as {{ and }}") from None
    unknown = [name for name in names if name not in TEMPLATE_FIELDS]
    if unknown:
        raise ValueError(f"template field {{{unknown[0]}}} is unknown; use {', '.join(TEMPLATE_FIELDS)}")


def judge_prompt(template: str, completion: str, reference: str) -> str:
    """The judge's user message for one completion (question and conversation '' where unknown)."""
    return template.format(question=getattr(completion, "question", ""), completion=str(completion),
                           conversation=getattr(completion, "conversation", str(completion)), reference=reference)


def compiled_pattern(pattern: str) -> re.Pattern:
    try:
        return re.compile(pattern)
    except re.error as exc:
        raise ValueError(f"pattern {pattern!r} is not a regular expression ({exc}); fix it, e.g. "
                         r"'(?i)verdict:\s*(yes|no)'") from None


def parse_verdict(reply: str, pattern: re.Pattern, scores: dict[str, float]) -> Optional[float]:
    """The score of the reply's verdict (the first group of the last match), None when there is
    no match, the verdict is not in `scores`, or (no `scores`) it is not a number."""
    matches = list(pattern.finditer(reply))
    if not matches:
        return None
    last = matches[-1]
    verdict = (last.group(1) if pattern.groups else last.group(0)) or ""
    if scores:
        return scores.get(verdict.strip().lower())
    try:
        return float(verdict)
    except ValueError:
        return None


class ChatClient:
    """POST <url>/chat/completions with retries; `complete(user)` -> the reply text, or None
    when every try failed."""

    def __init__(self, options: JudgeOptions):
        if not re.match(r"https?://", options.url):
            raise ValueError(f"url {options.url!r} is not an http(s) URL; set it to the judge server's base URL, "
                             "e.g. http://localhost:8000/v1")
        self.options, self.endpoint = options, options.url.rstrip("/") + "/chat/completions"
        self.failures = 0
        self._lock = threading.Lock()

    def _request(self, user: str) -> urllib.request.Request:
        o = self.options
        messages = ([{"role": "system", "content": o.system_prompt}] if o.system_prompt else []) + [
            {"role": "user", "content": user}]
        body = {"model": o.model, "messages": messages, "max_tokens": o.max_tokens, "temperature": o.temperature}
        headers = {"Content-Type": "application/json"}
        if o.api_key_env and os.environ.get(o.api_key_env):
            headers["Authorization"] = f"Bearer {os.environ[o.api_key_env]}"
        return urllib.request.Request(self.endpoint, json.dumps(body).encode(), headers, method="POST")

    def _once(self, user: str) -> str:
        with urllib.request.urlopen(self._request(user), timeout=self.options.timeout_s) as response:
            return json.loads(response.read())["choices"][0]["message"]["content"] or ""

    def complete(self, user: str) -> Optional[str]:
        for attempt in range(self.options.retries + 1):
            try:
                return self._once(user)
            except urllib.error.HTTPError as exc:
                if exc.code not in RETRIED_STATUS:
                    break
            except (urllib.error.URLError, TimeoutError, OSError):
                pass
            except (ValueError, KeyError, IndexError, TypeError):  # not a chat-completions reply
                break
            if attempt < self.options.retries:
                time.sleep(self.options.retry_wait_s * 2 ** attempt)
        with self._lock:
            self.failures += 1
        return None

    def complete_many(self, users: Sequence[str]) -> list[Optional[str]]:
        with ThreadPoolExecutor(self.options.workers) as pool:
            return list(pool.map(self.complete, users))


class LocalClient:
    """A local judge model's replies: `decode(users) -> replies` is set by the run once it has
    loaded the model (`assembly.judge_model.attach_local_judges`)."""

    def __init__(self, options: JudgeOptions):
        self.options, self.decode, self.failures = options, None, 0

    def complete_many(self, users: Sequence[str]) -> list[Optional[str]]:
        if self.decode is None:
            raise RuntimeError("the local judge has no model: the run loads it (assembly.judge_model); "
                               "outside a run, give the reward a url")
        replies = self.decode(list(users))
        self.failures += sum(reply is None for reply in replies)  # prompts too long for the judge's context
        return replies


def judge_client(options: JudgeOptions) -> ChatClient | LocalClient:
    if bool(options.url) == bool(options.path):
        raise ValueError(f"url {options.url!r} and path {options.path!r}: set exactly one (url: a served judge, "
                         "path: a local model)")
    if options.url and not options.model:
        raise ValueError("model is empty; set task.reward_options.judge.model to the model name the server serves")
    return ChatClient(options) if options.url else LocalClient(options)


class JudgeReward:
    """`judge(completions, answers)` -> each completion's verdict score (see the module doc);
    `take_metrics()` gives the judged and unparsed verdicts, failed requests and judging
    seconds since it was last called."""

    def __init__(self, options: JudgeOptions):
        check_template(options.template)
        self.options, self.pattern, self.client = options, compiled_pattern(options.pattern), judge_client(options)
        self.scores = {str(key).strip().lower(): float(value) for key, value in options.scores.items()}
        self.totals: Counter = Counter()

    def __call__(self, completions: list[str], answers: list[str]) -> list[Optional[float]]:
        check_pairs(completions, answers)
        start, failed_before = time.monotonic(), self.client.failures
        replies = self.client.complete_many([judge_prompt(self.options.template, c, a)
                                             for c, a in zip(completions, answers)])
        values = [None if text is None else parse_verdict(text, self.pattern, self.scores) for text in replies]
        unparsed = [text is not None and value is None for text, value in zip(replies, values)]
        self.totals.update({"judged": len(values), "unparsed": sum(unparsed), "judging_seconds":
                            time.monotonic() - start, "failed_requests": self.client.failures - failed_before})
        # an unreadable verdict scores 0 (counted as unparsed); a failed request is None (a reward error)
        return [0.0 if bad else value for bad, value in zip(unparsed, values)]

    def take_metrics(self) -> dict[str, float]:
        return _taken(self.totals)


def judge_reward(options: JudgeOptions) -> RewardFn:
    return JudgeReward(options)


def _taken(totals: Counter) -> dict[str, float]:
    taken = {key: float(value) for key, value in totals.items()}
    totals.clear()
    return taken


JUDGE_REWARD_SPECS = [
    RewardSpec("judge", judge_reward, JudgeOptions,
               "a generative judge's verdict (an OpenAI-compatible endpoint or a local model), parsed by a "
               "pattern and mapped to a score"),
]
