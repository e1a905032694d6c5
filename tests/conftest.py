"""Every test process sees 8 fake CPU devices, so sharding tests need no subprocess; the
fixtures below are shared by the tests that start from configs/tiny.yaml."""

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import pytest

from grpo_core.testing import cpu_test_xla_flags, kernel_map_limit, release_compiled_programs

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("XLA_FLAGS", cpu_test_xla_flags(8))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One XLA compilation cache for the `grpo-run` runs the tests start (pytest_configure keeps the
# test processes themselves off it): the tiny model's
# programs are compiled once per clone instead of once per `grpo-run` subprocess (a tiny run's
# 19 s drop to 8). Cached programs are the same executables, so results stay bitwise equal.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(REPO / ".cache" / "xla-tests"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")


def pytest_configure(config):
    """The test processes themselves compile without that cache (the runs they start keep it): its
    writes crashed two test workers inside XLA:CPU's executable serialization, and a worker started
    after them hung; most of what the cache saves is the subprocess runs' start-up compiles."""
    import jax

    jax.config.update("jax_enable_compilation_cache", False)


# Half the kernel's cap on a process's memory mappings: one test adds at most a few thousand.
MAPPINGS_BEFORE_RELEASE = kernel_map_limit() // 2


def pytest_runtest_logfinish(nodeid, location):
    """Between tests, a process near the kernel's mapping cap drops its compiled programs: a
    long-lived xdist worker otherwise reaches `vm.max_map_count` (65,530) after 25-40 minutes of
    compiles and segfaults in the next one (see release_compiled_programs)."""
    release_compiled_programs(MAPPINGS_BEFORE_RELEASE)


pytest_plugins = ["grpo_core.testing"]


def pytest_xdist_make_scheduler(config, log):
    """Under `-n` (default `--dist load`), each module of tests/e2e is handed to one worker whole:
    its module-scoped fixtures (trained runs, exports) are then built once, not once per worker,
    and xdist hands out these multi-test units before the single tests, so the long ones start
    first. Every other test is scheduled on its own."""
    if config.getoption("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class EndToEndModulesWhole(LoadScopeScheduling):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.retried: set[str] = set()

        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return module if module.startswith("tests/e2e/") else nodeid

        def _reschedule(self, node) -> None:
            """Keep a worker at three or more pending tests, or tell it no more work comes. xdist 3.8
            adds one unit per call: a replacement worker handed a one-test unit waited forever (a
            worker runs a test only once it knows the next one, or that none comes). A replacement
            that has not finished collecting gets nothing yet (its collectionfinish schedules it):
            xdist would pop a unit for it and then fail on its missing collection, in remove_node
            (where the KeyError is swallowed and the unit lost) or in schedule (an internal error)."""
            if node not in self.registered_collections or node.shutting_down:
                return
            while self.workqueue and self._pending_of(self.assigned_work[node]) <= 2:
                self._assign_work_unit(node)
            if not self.workqueue:
                node.shutdown()

        def remove_node(self, node) -> Optional[str]:
            """A crashed worker's unfinished tests go back on the queue. The test it died in runs
            once more, in a fresh worker, and fails if that worker dies too: XLA:CPU's compiler
            has crashed long-lived workers (30+ minutes of compiles, GBs resident) inside the train
            step's compile, a crash a fresh process does not meet. Its finished units stay off
            the queue: xdist 3.8's LoadScope re-queues them as empty units that a replacement
            worker waits on forever, so a run with one crash never ended."""
            workload = self.assigned_work.pop(node)
            unfinished = [nodeid for unit in workload.values() for nodeid, done in unit.items() if not done]
            if not unfinished:
                return None
            crashed = unfinished[0]  # a worker runs its units in order: the first unfinished was running
            retry = crashed not in self.retried
            self.retried.add(crashed)
            workload[self._split_scope(crashed)][crashed] = not retry
            self.workqueue.update({scope: unit for scope, unit in workload.items() if not all(unit.values())})
            for other in self.assigned_work:
                self._reschedule(other)
            if not retry:
                return crashed
            terminal = config.pluginmanager.get_plugin("terminalreporter")
            if terminal is not None:
                terminal.write_line(f"\nworker {node.gateway.id} crashed in {crashed}: running it once more "
                                    "in a new worker", red=True)
            return None

    return EndToEndModulesWhole(config, log)


# 8 devices hold 64 rows: 8 per device, so the micro-batch sizes 1, 2, 4, 8 are valid.
PLAN_SHAPE = ("rollout.prompts_per_step=8", "rollout.n=8", "rollout.max_new_tokens=8")


@dataclass(frozen=True)
class Cli:
    """`grpo-run` in a subprocess with this process's environment (8 fake CPU devices),
    started from the repository root as the README's commands are."""

    config: str  # configs/tiny.yaml
    cwd: Path = REPO

    def argv(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "grpo_runner_gsm8k.cli", *args]

    def train_argv(self, *args: str) -> list[str]:
        """The argv of a run of the tiny config with `args` (overrides and flags) after it."""
        return self.argv("--config", self.config, *args)

    def run(self, argv: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(argv, capture_output=True, text=True, cwd=self.cwd, timeout=timeout, **kwargs)

    def start(self, argv: list[str], **kwargs) -> subprocess.Popen:
        return subprocess.Popen(argv, cwd=self.cwd, **kwargs)


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


@pytest.fixture(scope="session")
def grpo_cli(tiny_config_path) -> Cli:
    return Cli(tiny_config_path)


@pytest.fixture(scope="session")
def small_run() -> Callable[..., list[str]]:
    """`small_run(steps=1, eval_every=0)`: overrides of a short tiny run, 4 prompts x 4 samples
    per step (a step takes seconds on CPU), evaluated every `eval_every` steps (0: never;
    None: as the config says)."""
    def overrides(steps: int = 1, eval_every: Optional[int] = 0) -> list[str]:
        evals = [] if eval_every is None else [f"eval.every_steps={eval_every}"]
        return [f"train.steps={steps}", "rollout.prompts_per_step=4", "rollout.n=4", *evals]

    return overrides


# The other model families on the tiny task (docs/models.md, "Learning on CPU"), each with one of the
# three loss implementations: Gemma 3 with a sliding and a global layer, Qwen3-MoE with 4 experts of
# which each token takes 2.
FAMILY_RUNS = {
    "llama": ("model.architecture.model_type=llama", "loss.impl=jax"),
    "gemma3_text": ("model.architecture.model_type=gemma3_text", "model.architecture.sliding_window=4",
                    "model.architecture.layer_types=[sliding_attention,full_attention]", "loss.impl=pallas"),
    "qwen3_moe": ("model.architecture.model_type=qwen3_moe", "model.architecture.num_experts=4",
                  "model.architecture.num_experts_per_tok=2", "model.architecture.moe_intermediate_size=32",
                  "model.architecture.norm_topk_prob=true", "loss.impl=fused"),
}


# A format reward beside correctness: an untrained model's groups then differ (on correctness alone
# every reward may be 0, every advantage 0, and nothing would train).
GRADED_FORMAT = ("task.rewards={correctness: 1.0, format: 0.5}", "task.reward_options={format: {style: number_only}}")


@pytest.fixture(scope="session", params=sorted(FAMILY_RUNS))
def family_run(request) -> tuple[str, ...]:
    """The overrides of one other model family's tiny run (FAMILY_RUNS, GRADED_FORMAT), one test per family."""
    return (*FAMILY_RUNS[request.param], *GRADED_FORMAT)


@pytest.fixture(scope="session")
def one_step(tiny_config_path, small_run) -> Callable[..., list[str]]:
    """`one_step(run_dir, *args, config=None, eval_every=0)`: grpo-run's arguments for one
    small step of the tiny config (or the file `config`) into `run_dir`, `args` last."""
    def argv(run_dir: Path, *args: str, config: Optional[str] = None, eval_every: Optional[int] = 0) -> list[str]:
        return ["--config", config or tiny_config_path, *small_run(1, eval_every), f"logging.dir={run_dir}", *args]

    return argv


@pytest.fixture(scope="session")
def tiny_config_path() -> str:
    """configs/tiny.yaml: the tiny CPU run every runner test starts from."""
    return str(REPO / "configs" / "tiny.yaml")


@pytest.fixture
def tiny_config(tiny_config_path, tmp_path):
    """`tiny_config(*overrides, registry=None)`: the tiny config with `overrides`, its run
    directory under the test's tmp_path, checked against `registry` (default: the installed one)."""
    from grpo_core.config_io import load_config
    from grpo_core.registry import default_registry

    def load(*overrides: str, registry=None):
        return load_config(tiny_config_path, [f"logging.dir={tmp_path / 'run'}", *overrides],
                           registry=registry or default_registry())

    return load


@pytest.fixture(scope="session")
def plan_overrides() -> list[str]:
    """The plan tests' shape (PLAN_SHAPE) as command-line overrides."""
    return list(PLAN_SHAPE)


@pytest.fixture
def plan_config(tiny_config, plan_overrides):
    """`plan_config(*overrides)`: the tiny config at the plan tests' shape."""
    return lambda *overrides: tiny_config(*plan_overrides, *overrides)
