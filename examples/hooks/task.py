"""A `grpo_tasks` plugin: repeat a number (`task.name: echo`); a `grpo_core.contracts.Task`."""

from dataclasses import dataclass
from grpo_core import TaskSpec, hookimpl
from grpo_core.contracts import Example

@dataclass(frozen=True)
class Options:
    size: int = 100

class Echo:
    use_chat_template = False

    def __init__(self, options, *, seed=0, process_index=0, process_count=1):
        numbers = range(process_index, options.size, process_count)  # this process's share
        self.examples = [Example(f"Repeat {i}", str(i), id=f"echo/{i}") for i in numbers]
        self.position = 0

    def train_batch(self, n):
        start, self.position = self.position, self.position + n
        return [self.examples[i % len(self.examples)] for i in range(start, start + n)]

    def test_examples(self, limit=None):
        return self.examples[:limit]

    def state(self):
        return {"position": self.position}

    def restore(self, state):
        self.position = state["position"]

@hookimpl
def grpo_tasks():
    return [TaskSpec("echo", Echo, Options, "Repeat a number")]
