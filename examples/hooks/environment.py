"""A `grpo_environments` plugin: guess the task's answer, told "higher" or "lower" after
each try (`guess_number`); a `grpo_core.contracts.Environment`, one per rollout row, and a
`SavedEnvironment`, so multi-turn partial rollouts can carry its rows across steps."""

import re
from dataclasses import dataclass
from grpo_core import EnvironmentSpec, hookimpl
from grpo_core.contracts import EnvironmentStep

@dataclass(frozen=True)
class Options:
    max_guesses: int = 4

class GuessNumber:
    def __init__(self, options):
        self.options = options
        self.secret, self.guesses, self.solved = 0, 0, False

    def reset(self, example):
        self.secret, self.guesses, self.solved = int(example.answer), 0, False
        return [{"role": "user", "content": f"{example.question}\nGuess the number; answer with one integer."}]

    def step(self, assistant_text):
        numbers = re.findall(r"-?\d+", assistant_text)
        self.guesses += 1
        self.solved = bool(numbers) and int(numbers[-1]) == self.secret
        if self.done:
            return EnvironmentStep(done=True, reward=self.reward_info())
        hint = "No number found." if not numbers else ("Higher." if int(numbers[-1]) < self.secret else "Lower.")
        return EnvironmentStep(messages=({"role": "user", "content": hint},), reward={"solved": 0.0})

    @property
    def done(self):
        return self.solved or self.guesses >= self.options.max_guesses

    def reward_info(self):
        return {"solved": float(self.solved), "guesses": float(self.guesses)}

    # SavedEnvironment: rows carried across steps (partial rollouts) save the episode with the checkpoint
    def state(self):
        return {"secret": self.secret, "guesses": self.guesses, "solved": self.solved}

    def restore(self, state):
        self.secret, self.guesses, self.solved = int(state["secret"]), int(state["guesses"]), bool(state["solved"])

@hookimpl
def grpo_environments():
    return [EnvironmentSpec("guess_number", GuessNumber, Options, "Guess a number with higher/lower hints")]
