"""A GRPO run over two real JAX processes (4 CPU devices each, gloo on 127.0.0.1): each
reads its own data shard, the step batch is both shards in process order on every
process, every process ends with the same parameters and the same advantage statistics
of the step, and process 0 logs."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Callable

import numpy as np
import pytest
from grpo_core.testing import cpu_test_xla_flags
from grpo_runner_gsm8k.operations.checkpoint import checkpoint_dir, complete_steps
from grpo_runner_gsm8k.tasks.arithmetic import ArithmeticOptions, ArithmeticTask

# 8 prompts: 4 per process
RUN = ["train.steps=2", "rollout.prompts_per_step=8", "rollout.n=4", "eval.every_steps=2", "eval.num_questions=8",
       "checkpoint.every_steps=0", "mesh.strategy=full_fsdp"]
HARD_TIMEOUT_S = 300
LEAVE_TIMEOUT_S = 120  # JAX's shutdown barrier alone waits 300 s
TASK_OPTIONS = {"digits": 1, "operations": "+", "max_result": 9}  # as configs/tiny.yaml
# gdpo over two reward functions: its last normalisation is over the whole global step batch
GDPO = ["loss.advantage_estimator=gdpo", "task.rewards={correctness: 1.0, format: 0.5}",
        "task.reward_options={format: {style: number_only}}"]

# Prints the sum of |param| of the params before and after the run, and the advantage metrics of
# the last step, so processes can be compared.
DRIVER = """
import json, sys, jax, numpy as np
from grpo_runner_gsm8k import loop
from grpo_runner_gsm8k.multihost import gather_objects
from grpo_core.config_io import load_config
from grpo_core.registry import default_registry
from grpo_runner_gsm8k.plan.slots import decided_slots
cfg = decided_slots(load_config(sys.argv[1], sys.argv[2:], registry=default_registry()), default_registry())  # as grpo-run
trainer = loop.Trainer(loop.build_run(cfg, default_registry()))
position = trainer.built.inputs.task.state()
print("PROMPTS", json.dumps([ex.id for ex in gather_objects(trainer.built.inputs.task.train_batch(4))]), flush=True)
trainer.built.inputs.task.restore(position)
def params_sum():
    leaves = [np.asarray(jax.experimental.multihost_utils.process_allgather(x, tiled=True))
              for x in jax.tree.leaves(trainer.state.params)]
    return float(sum(np.abs(leaf).sum() for leaf in leaves))
print("INITIAL", params_sum(), flush=True)
metrics = trainer.run()
print("PARAMS", params_sum(), flush=True)
print("ADVANTAGES", json.dumps({k: v for k, v in metrics.items() if k.startswith("train-other/adv")}), flush=True)
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def cpu_env(devices: int) -> dict[str, str]:
    return {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": cpu_test_xla_flags(devices)}


@pytest.fixture(scope="session")
def start(tiny_config_path) -> Callable[[int, list[str]], subprocess.Popen]:
    """`start(devices, args)`: DRIVER on the tiny config with overrides `args`, on `devices` CPU devices."""
    def popen(devices: int, args: list[str]) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", DRIVER, tiny_config_path, *args], env=cpu_env(devices),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    return popen


def finish(procs: list[subprocess.Popen]) -> list[str]:
    """Each process's stdout; the first one to fail fails the test at once (its peers would
    otherwise wait for it until the hard timeout)."""
    with ThreadPoolExecutor(len(procs)) as pool:
        futures = {pool.submit(proc.communicate, timeout=HARD_TIMEOUT_S): proc for proc in procs}
        try:
            for future in as_completed(futures):
                out, err = future.result()
                assert futures[future].returncode == 0, err[-3000:]
        finally:
            for proc in procs:
                proc.kill()
    return [future.result()[0] for future in futures]


def printed(out: str, tag: str) -> str:
    return next(line.split(" ", 1)[1] for line in out.splitlines() if line.startswith(tag + " "))


@pytest.mark.slow
def test_two_process_run_shares_one_global_batch_and_refills_in_step(tmp_path, start):
    """The step batch is both shards in process order. Refill rounds are decided from the
    gathered rewards, so both processes draw, roll out and select alike (a disagreement would
    hang a collective or split the parameters); one run checks both, with corrections on."""
    port = free_port()
    options = ["loss.dynamic_sampling=true", "loss.dynamic_sampling_mode=refill", "loss.max_extra_rollouts=3",
               "loss.mismatch_correction=truncate", "loss.top_entropy_quantile=0.5",
               "loss.advantage_estimator=reinforce_pp_baseline"]
    outs = finish([start(4, [*RUN, *options, f"logging.dir={tmp_path}", *distributed(port, i)]) for i in range(2)])

    prompts = [json.loads(printed(out, "PROMPTS")) for out in outs]
    shards = [[ex.id for ex in ArithmeticTask(ArithmeticOptions(**TASK_OPTIONS), process_index=i,
                                                  process_count=2).train_batch(4)] for i in range(2)]
    assert prompts[0] == prompts[1] == shards[0] + shards[1]
    sums = [float(printed(out, "PARAMS")) for out in outs]
    assert sums[0] == sums[1]  # every process holds the same global parameters

    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "train-other/loss" in r]
    assert [r["step"] for r in train] == [1, 2]  # written once, by process 0
    for r in train:
        assert r["train-other/refill_prompts_consumed"] == 8 * (1 + r["train-other/refill_extra_rollouts"])
        assert np.isfinite(r["train-other/loss"]) and np.isfinite(r["train-other/mismatch_kl"])
    assert any("eval/accuracy" in r for r in records)
    same_step_statistics(outs, train)


@pytest.mark.slow
def test_two_process_lora_run_ends_with_the_same_adapters_on_both(tmp_path, start):
    """The train state of a LoRA run is the adapters alone (the base is frozen and held by
    every process); both processes update them from the one global batch."""
    port = free_port()
    lora = ["model.lora.rank=4", "model.lora.alpha=8", "loss.beta=0.05", "train.micro_batch_size_per_device=2",
            "rollout.n=16", "eval.every_steps=0", *GDPO]
    outs = finish([start(4, [*RUN, *lora, f"logging.dir={tmp_path}", *distributed(port, i)]) for i in range(2)])
    assert all("lora: rollout" in out for out in outs)
    initial = [float(printed(out, "INITIAL")) for out in outs]
    final = [float(printed(out, "PARAMS")) for out in outs]
    assert initial[0] == initial[1] and final[0] == final[1]
    assert final[0] != initial[0]  # the adapters trained
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert all(np.isfinite(r["train-other/loss"]) for r in records)
    same_step_statistics(outs, records)


@pytest.mark.slow
def test_two_process_run_of_each_model_family_ends_with_the_same_params_on_both(tmp_path, start, family_run):
    """Llama, Gemma 3 and Qwen3-MoE (tests/conftest.py's FAMILY_RUNS) over two processes of 4 devices:
    one global batch, the same parameters on both, trained, in bfloat16 compute."""
    port = free_port()
    options = [*family_run, "model.dtype=bfloat16", "eval.every_steps=0", f"logging.dir={tmp_path}"]
    outs = finish([start(4, [*RUN, *options, *distributed(port, i)]) for i in range(2)])
    initial = [float(printed(out, "INITIAL")) for out in outs]
    final = [float(printed(out, "PARAMS")) for out in outs]
    assert initial[0] == initial[1] and final[0] == final[1] and final[0] != initial[0]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2] and all(r["train-other/grad_norm"] > 0 for r in records)
    same_step_statistics(outs, records)


def same_step_statistics(outs: list[str], records: list[dict]) -> None:
    """Both processes computed the step's advantage statistics over the one global batch: the
    same values on each, as logged."""
    computed = [json.loads(printed(out, "ADVANTAGES")) for out in outs]
    assert computed[0] == computed[1] and computed[0], computed
    assert all(records[-1][key] == value for key, value in computed[0].items())


def distributed(port: int, process_id: int) -> list[str]:
    return ["mesh.distributed=on", f"mesh.coordinator_address=127.0.0.1:{port}", "mesh.num_processes=2",
            f"mesh.process_id={process_id}", "mesh.require_process_count=2"]


@pytest.mark.slow
def test_two_process_partial_run_holds_one_pool_and_counts_every_prompt_once(tmp_path, start):
    """Each process draws one prompt per new group from its own shard and the draws are
    gathered, so both hold the same carried rows and end with the same parameters. `auto` slots
    are decided as `grpo-run` does, after the processes join (here a step's rows: no TPU chip)."""
    port = free_port()
    partial = ["rollout.max_new_tokens=4", "rollout.partial.enabled=true", "rollout.partial.budget=1",
               "loss.mismatch_correction=truncate", "eval.every_steps=0", "loss.advantage_estimator=rloo",
               "loss.dynamic_sampling=true", "rollout.partial.slots=auto"]
    outs = finish([start(4, [*RUN, *partial, f"logging.dir={tmp_path}", *distributed(port, i)]) for i in range(2)])
    sums = [float(printed(out, "PARAMS")) for out in outs]
    assert sums[0] == sums[1]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2] and all(r["train-rollout/groups"] == 8 for r in records)
    same_step_statistics(outs, records)
    saved = json.loads((checkpoint_dir(tmp_path) / "2" / "meta" / "metadata").read_text())
    waiting = len(saved["carried"]["groups"])
    assert saved["data"]["position"] * 2 == 2 * 8 + waiting  # each process drew its half of every group
    assert all("rollout.partial.slots=auto: 32 slots (a step's rows)" in out for out in outs)


@pytest.fixture(scope="session")
def start_command(grpo_cli) -> Callable[[list[str], list[str]], subprocess.Popen]:
    """`start_command(program, args)`: `python <program> --config tiny.yaml <args>` on 4 CPU
    devices; stderr kept for the checks."""
    def popen(program: list[str], args: list[str]) -> subprocess.Popen:
        return grpo_cli.start([sys.executable, *program, "--config", grpo_cli.config, *args], env=cpu_env(4),
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    return popen


@pytest.mark.slow
def test_sigterm_to_one_process_stops_both_after_the_same_step_with_one_checkpoint(tmp_path, start_command):
    """Schedulers signal the hosts of a job at slightly different times; here only process 1
    is signalled. Both must finish the same step, save it together and exit 143."""
    steps, port = 200, free_port()
    overrides = [*RUN, f"train.steps={steps}", "eval.every_steps=0", f"logging.dir={tmp_path}"]
    procs = [start_command(["-m", "grpo_runner_gsm8k.cli"], [*overrides, *distributed(port, i)]) for i in range(2)]
    try:
        metrics, deadline = tmp_path / "metrics.jsonl", time.monotonic() + HARD_TIMEOUT_S
        while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 2):
            assert all(p.poll() is None for p in procs) and time.monotonic() < deadline, "step 2 never logged"
            time.sleep(0.05)
        procs[1].send_signal(signal.SIGTERM)
        errs = [p.communicate(timeout=HARD_TIMEOUT_S)[1] for p in procs]
    finally:
        for proc in procs:
            proc.kill()
    assert [p.returncode for p in procs] == [143, 143], errs
    saved = complete_steps(tmp_path)
    assert len(saved) == 1 and 2 <= saved[0] < steps, saved
    tail = (f"after step {saved[0]} of {steps}; saved checkpoint {checkpoint_dir(tmp_path) / str(saved[0])}; "
            "run the same command again to continue")
    assert errs[1].strip().splitlines()[-1] == f"grpo-run: stopped by SIGTERM {tail}"
    assert errs[0].strip().splitlines()[-1] == f"grpo-run: stopped by a signal to another process {tail}"


# Process 1 alone fails after both have joined (a host-local problem, e.g. its own disk).
FAIL_ON_ONE = """
import sys, jax
from grpo_core.errors import UserError
from grpo_runner_gsm8k import cli
from grpo_runner_gsm8k import loop
def run(self):
    if jax.process_index() == 1:
        raise UserError("process 1 fails alone")
    return original(self)
original, loop.Trainer.run = loop.Trainer.run, run
sys.exit(cli.main(sys.argv[1:]))
"""


def two_processes_to_the_end(start_command, program: list[str], overrides) -> tuple[list, list[str]]:
    """Processes 0 and 1 of one distributed run (`overrides(i)` each), waited for; their stderr."""
    port = free_port()
    procs = [start_command(program, [*overrides(i), *distributed(port, i)]) for i in range(2)]
    try:
        errs = [p.communicate(timeout=LEAVE_TIMEOUT_S)[1] for p in procs]
    finally:
        for proc in procs:
            proc.kill()
    return procs, errs


@pytest.mark.slow
def test_a_process_failing_alone_ends_the_run_on_every_process(tmp_path, start_command):
    """Neither the failed process (at JAX's shutdown barrier) nor its peer (in a collective)
    may wait for the other: both exit, the failed one with its own one-line error."""
    procs, errs = two_processes_to_the_end(start_command, ["-c", FAIL_ON_ONE],
                                           lambda i: [*RUN, f"logging.dir={tmp_path}"])
    assert procs[1].returncode == 2, errs[1][-3000:]
    assert errs[1].strip().splitlines()[-1] == "grpo-run: error: process 1 fails alone"
    assert procs[0].returncode == 1, errs[0][-3000:]
    assert errs[0].strip().splitlines()[-1].startswith("grpo-run: process 0 of 2 failed")


@pytest.mark.slow
@pytest.mark.parametrize("estimator", ["sampled", "full"])
def test_two_process_distillation_of_a_lora_student_ends_with_the_same_adapters(tmp_path, start, estimator):
    """Both processes load the teacher onto the one mesh and score the one global batch with it;
    the token-level advantages (sampled) or the teacher's hidden states and head (full) are global
    arrays, so both apply the same update."""
    from grpo_core.models import QwenConfig, init_from_config
    from grpo_core.models.hf_io import export_pretrained
    from grpo_core.tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    qcfg = QwenConfig.from_hf_dict({"model_type": "qwen2", "hidden_size": 32, "intermediate_size": 64,
                                    "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
                                    "max_position_embeddings": 64, "vocab_size": len(tokenizer)})
    export_pretrained(init_from_config(qcfg, seed=1, dtype="float32"), tmp_path / "teacher", tokenizer)
    port = free_port()
    options = ["model.lora.rank=4", "model.lora.alpha=8", f"teacher.path={tmp_path / 'teacher'}",
               "teacher.use_task_reward=true", "eval.every_steps=0", f"teacher.estimator={estimator}"]
    outs = finish([start(4, [*RUN, *options, f"logging.dir={tmp_path / 'run'}", *distributed(port, i)])
                   for i in range(2)])
    initial = [float(printed(out, "INITIAL")) for out in outs]
    final = [float(printed(out, "PARAMS")) for out in outs]
    assert initial[0] == initial[1] and final[0] == final[1] and final[0] != initial[0]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    # sampled: a one-sample estimate per token, of either sign; full: the exact KL, > 0. Two different
    # models never agree exactly
    metric = "train-other/distill_reverse_kl" if estimator == "sampled" else "train-other/distill_full_kl"
    assert all(abs(r[metric]) > 1e-3 and np.isfinite(r["train-other/loss"]) for r in records)


# Two steps of a tiny multi-turn run with the calculator (the kept-cache loop) in which every row
# plays an environment (`hint`), then a multi-turn eval. A random model hardly ever writes a call or
# a stop token, so in each step's first round row 0 writes CALL instead of sampling (admitted into
# its kept cache, so the cache holds what the row holds) and every other row ends its turn there, so
# its environment is stepped. The calculator's response and the environment's hint name the process
# that produced them: were calls run or environments stepped on each process, the processes would
# append different turns and end with different parameters.
TOOLS_DRIVER = """
import dataclasses, json, sys, jax, numpy as np
from grpo_core import EnvironmentSpec, hookimpl
from grpo_core.config_io import load_config
from grpo_core.contracts import EnvironmentStep
from grpo_core.testing import registry_with
from grpo_runner_gsm8k import loop
from grpo_runner_gsm8k.multihost import host_array
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>'
class FirstRoundCalls:
    def __init__(self, backend, tokenizer):
        self.backend, self.call, self.rounds = backend, tokenizer.encode(CALL, add_special_tokens=False), 0
    def generate_round(self, prefixes, cached, key, sampling, *, live, **kwargs):
        self.rounds += 1
        if self.rounds > 1:
            return self.backend.generate_round(prefixes, cached, key, sampling, live=live, **kwargs)
        prefixes, live = [list(prefixes[0]) + self.call, *prefixes[1:]], [False, *live[1:]]
        result = self.backend.generate_round(prefixes, cached, key, sampling, live=live, **kwargs)
        fields = {name: host_array(getattr(result, name)).copy()
                  for name in ("completion_ids", "sampler_logps", "lengths", "finished")}
        fields["completion_ids"][0, :len(self.call)], fields["sampler_logps"][0, :len(self.call)] = self.call, -1.0
        fields["lengths"][0], fields["finished"][:] = len(self.call), True
        return result.replace(**fields)
    def release_kept_cache(self):
        self.rounds = 0
        self.backend.release_kept_cache()
class PerProcess:
    def __init__(self, tool):
        self.tool, self.name, self.description, self.parameters = tool, tool.name, tool.description, tool.parameters
        self.runs = 0
    def __call__(self, arguments):
        self.runs += 1
        return f"{self.tool(arguments)} from process {jax.process_index()}"
COUNTS = {"built": 0, "steps": 0}
@dataclasses.dataclass(frozen=True)
class HintOptions:
    pass
class Hint:
    def __init__(self, options):
        COUNTS["built"] += 1
        self.steps = 0
    def reset(self, example):
        return [{"role": "user", "content": example.question}]
    def step(self, text):
        COUNTS["steps"] += 1
        self.steps += 1
        if self.done:
            return EnvironmentStep(done=True, reward=self.reward_info())
        return EnvironmentStep(messages=({"role": "user", "content": f"hint {jax.process_index()}"},))
    @property
    def done(self):
        return self.steps >= 2
    def reward_info(self):
        return {"answered": float(self.steps > 0)}
class HintPlugin:
    @hookimpl
    def grpo_environments(self):
        return [EnvironmentSpec("hint", Hint, HintOptions, "a hint naming the process that stepped it")]
registry = registry_with(HintPlugin())
cfg = load_config(sys.argv[1], sys.argv[2:], registry=registry)
trainer = loop.Trainer(loop.build_run(cfg, registry))
turns, runner = trainer.sampler.turns, trainer.sampler.runner
turns.backend = FirstRoundCalls(turns.backend, trainer.built.inputs.tokenizer)
tool = runner.tools["calculator"] = PerProcess(runner.tools["calculator"])
metrics = trainer.run()
params = [np.asarray(jax.experimental.multihost_utils.process_allgather(x, tiled=True))
          for x in jax.tree.leaves(trainer.state.params)]
print("PARAMS", float(sum(np.abs(leaf).sum() for leaf in params)), flush=True)
print("TOOLS", json.dumps({k: v for k, v in metrics.items() if k.startswith(("train-tools/", "train-reward/func/"))}))
print("EVAL", json.dumps({k: v for k, v in metrics.items() if k.startswith("eval/")}), flush=True)
print("RUNS", tool.runs, flush=True)
print("ENVIRONMENTS", json.dumps(COUNTS), flush=True)
"""
MULTI_TURN = ["model.tokenizer=char-calculator", "task.options={digits: 1, operations: '+', use_chat_template: true}",
              "rollout.max_prompt_length=32", "rollout.max_new_tokens=16", "rollout.multi_turn.enabled=true",
              "rollout.multi_turn.tools=[calculator]", "rollout.multi_turn.max_turns=2",
              "rollout.multi_turn.max_total_tokens=64", "model.architecture.max_position_embeddings=128",
              "rollout.multi_turn.environment=hint", "task.rewards={correctness: 1.0, environment: 1.0}",
              "task.reward_options={environment: {key: answered}}"]


@pytest.mark.slow
def test_two_process_multi_turn_run_runs_each_call_and_environment_once_and_shares_the_outcome(
        tmp_path, tiny_config_path):
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", TOOLS_DRIVER, tiny_config_path, *RUN, *MULTI_TURN,
                               f"logging.dir={tmp_path}", *distributed(port, i)], env=cpu_env(4),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    outs = finish(procs)
    assert [int(printed(out, "RUNS")) for out in outs] == [2, 0]  # one call per step, run by process 0 only
    environments = [json.loads(printed(out, "ENVIRONMENTS")) for out in outs]
    # 2 steps x 32 rows and 8 eval rows, each with its environment built, reset and stepped on process 0 only
    assert environments[0]["built"] == 2 * 32 + 8 and environments[0]["steps"] > 0
    assert environments[1] == {"built": 0, "steps": 0}
    sums = [float(printed(out, "PARAMS")) for out in outs]
    assert sums[0] == sums[1]
    tools = [json.loads(printed(out, "TOOLS")) for out in outs]
    assert tools[0] == tools[1] and tools[0]["train-tools/calls"] == 1 and tools[0]["train-tools/errors"] == 0
    assert tools[0]["train-tools/turns_max"] == 2 and tools[0]["train-tools/masked_tokens"] > 0
    assert tools[0]["train-reward/func/environment/mean"] > 0  # process 0's reward information, on both
    evals = [json.loads(printed(out, "EVAL")) for out in outs]
    assert evals[0] == evals[1] and evals[0]["eval/tools/turns_mean"] >= 1  # the eval went turn by turn alike
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2] and all(r["train-tools/calls"] == 1 for r in records)


@pytest.mark.slow
def test_processes_started_with_different_configs_stop_before_loading_the_model(tmp_path, start_command):
    """Process 1 was given another seed: both processes compare their config hashes right after
    joining and exit 2 with one line naming the process and host that differ."""
    procs, errs = two_processes_to_the_end(start_command, ["-m", "grpo_runner_gsm8k.cli"],
                                           lambda i: [*RUN, f"logging.dir={tmp_path}", f"train.seed={1 + i}"])
    host = socket.gethostname()
    expected = (f"grpo-run: error: the resolved config of process 1 ({host}) differs from that of process 0 "
                f"({host}); start every host with the same --config and overrides; no step was run")
    for proc, err in zip(procs, errs):
        assert proc.returncode == 2, err[-3000:]
        assert err.strip().splitlines()[-1] == expected
    assert not (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "checkpoints").exists()
