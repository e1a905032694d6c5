"""A `grpo_graders` plugin: right when the completion's last number is within `tolerance` of the
reference's (`task.options: {grader: near, grader_options: {tolerance: 1}}` of the `dataset`
task); a `grpo_core.contracts.Grader`."""

import re
from dataclasses import dataclass
from grpo_core import GraderSpec, hookimpl

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")

@dataclass(frozen=True)
class Options:
    tolerance: float = 0.0

def build(options: Options):
    def near(completions, references):
        verdicts = []
        for completion, reference in zip(completions, references):
            numbers = NUMBER.findall(completion)
            answer = numbers[-1] if numbers else None
            verdicts.append((answer, answer is not None and abs(float(answer) - float(reference)) <= options.tolerance))
        return verdicts
    return near

@hookimpl
def grpo_graders():
    return [GraderSpec("near", build, Options, "the last number is within `tolerance` of the reference")]
