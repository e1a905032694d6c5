"""The `judge` reward against a small OpenAI-compatible server in this process (no network):
its prompt template, the verdict pattern, retries, and what an unreadable verdict or a failed
request scores."""

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
from grpo_core.contracts import CompletionText, ConversationText
from grpo_core.errors import UserError
from grpo_core.registry import default_registry

from grpo_runner_gsm8k.assembly.build import from_plugin
from grpo_runner_gsm8k.cli import main
from grpo_runner_gsm8k.tasks.judge import JudgeOptions, check_template, judge_prompt, parse_verdict
from grpo_runner_gsm8k.training.scoring import reward_details, score


class JudgeServer:
    """Replies by the response text in the prompt: 'right' -> Verdict: yes, 'wrong' -> Verdict: no,
    'mumble' -> no verdict, 'busy' -> 503 the first `busy_times` times, 'broken' -> 400; records every body."""

    def __init__(self, busy_times=1):
        self.bodies, self.busy_left = [], busy_times
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.bodies.append((self.path, body))
                self._answer(*server.reply(body["messages"][-1]["content"]))

            def _answer(self, status, text):
                payload = json.dumps({"choices": [{"message": {"role": "assistant", "content": text}}]}).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def reply(self, prompt):
        response = prompt.split("Response:\n", 1)[-1]
        if "busy" in response and self.busy_left > 0:
            self.busy_left -= 1
            return 503, ""
        if "broken" in response:
            return 400, ""
        verdict = {"right": "Verdict: yes", "wrong": "Verdict: maybe no... Verdict: no", "busy": "Verdict: yes"}
        return 200, next((v for k, v in verdict.items() if k in response), "I cannot tell.")


@pytest.fixture
def server():
    judge = JudgeServer()
    yield judge
    judge.httpd.shutdown()


def _judge(server, **options):
    options = {"url": server.url, "model": "judge-1", "retry_wait_s": 0.0, **options}
    return from_plugin(default_registry(), "reward", "judge", options, "task.reward_options.judge")


def test_the_prompt_fills_question_completion_conversation_and_reference():
    completion = ConversationText("It is 4.", 3, 8, True, conversation="<call>2+2</call> It is 4.")
    completion.question = "2+2?"
    text = judge_prompt("Q={question} A={completion} C={conversation} R={reference}", completion, "4")
    assert text == "Q=2+2? A=It is 4. C=<call>2+2</call> It is 4. R=4"
    assert judge_prompt("{question}|{conversation}", "plain", "4") == "|plain"
    with pytest.raises(ValueError, match=r"template field \{answer\} is unknown; use question, completion"):
        check_template("{answer}")


def test_the_verdict_is_the_last_match_mapped_or_read_as_a_number():
    yes_no = re.compile(r"(?i)verdict:\s*(yes|no)")
    assert parse_verdict("Verdict: yes. On reflection, verdict: NO", yes_no, {"yes": 1.0, "no": 0.0}) == 0.0
    assert parse_verdict("no verdict here", yes_no, {"yes": 1.0}) is None
    assert parse_verdict("Verdict: no", yes_no, {"yes": 1.0}) is None  # a verdict the map lacks
    number = re.compile(r"Score: (\S+)")
    assert parse_verdict("Score: 7 ... Score: 0.25", number, {}) == 0.25
    assert parse_verdict("Score: high", number, {}) is None


def test_the_judge_grades_over_http_and_counts_unparsed_verdicts(server):
    judge = _judge(server, system_prompt="Be strict.", workers=3)
    completions = [CompletionText(t, 2, 8, True) for t in ("right", "wrong", "mumble", "busy")]
    for c in completions:
        c.question = "What is 2+2?"
    scores = score({"judge": (judge, 1.0)}, completions, ["4"] * 4)
    np.testing.assert_array_equal(scores.per_fn["judge"], [1.0, 0.0, 0.0, 1.0])
    assert scores.errors == {"judge": 0}
    metrics = reward_details({"judge": (judge, 1.0)})
    assert metrics["train-reward/func/judge/unparsed"] == 1 and metrics["train-reward/func/judge/judged"] == 4
    assert metrics["train-reward/func/judge/failed_requests"] == 0
    assert len(server.bodies) == 5  # the busy one was retried once
    path, body = server.bodies[0]
    assert path == "/v1/chat/completions" and body["model"] == "judge-1" and body["temperature"] == 0.0
    assert body["messages"][0] == {"role": "system", "content": "Be strict."}
    assert "What is 2+2?" in body["messages"][1]["content"] and "Reference answer:\n4" in body["messages"][1]["content"]


def test_a_request_that_fails_after_its_retries_scores_zero_as_an_error(server):
    server.busy_left = 10
    judge = _judge(server, retries=2)
    scores = score({"judge": (judge, 1.0)}, ["busy", "broken", "right"], ["4"] * 3)
    np.testing.assert_array_equal(scores.per_fn["judge"], [0.0, 0.0, 1.0])
    assert scores.errors == {"judge": 2}
    assert reward_details({"judge": (judge, 1.0)})["train-reward/func/judge/failed_requests"] == 2
    busy = [b for _, b in server.bodies if "busy" in b["messages"][-1]["content"]]
    broken = [b for _, b in server.bodies if "broken" in b["messages"][-1]["content"]]
    assert len(busy) == 3 and len(broken) == 1  # 503 is retried; 400 is our request's fault and is not


@pytest.mark.parametrize("options, refusal", [
    ({"url": "judge:8000"}, "url 'judge:8000' is not an http(s) URL"),
    ({"model": ""}, "model is empty"),
    ({"path": "/models/judge"}, "and path '/models/judge': set exactly one"),
    ({"url": ""}, "url '' and path '': set exactly one"),
    ({"pattern": "verdict: (yes"}, "pattern 'verdict: (yes' is not a regular expression"),
    ({"template": "{response}"}, "template field {response} is unknown"),
])
def test_bad_options_are_refused_in_one_line(server, options, refusal):
    with pytest.raises(UserError) as refused:
        _judge(server, **options)
    message = str(refused.value)
    assert refusal in message and "\n" not in message and message.startswith("task.reward_options.judge")


def test_grpo_run_refuses_a_bad_judge_pattern_before_the_model_loads(tmp_path, tiny_config_path, capsys):
    assert main(["--config", tiny_config_path, f"logging.dir={tmp_path / 'run'}",
                 "task.rewards={correctness: 1.0, judge: 1.0}",
                 "task.reward_options={judge: {url: 'http://127.0.0.1:9/v1', model: m, pattern: '(yes'}}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pattern '(yes' is not a regular expression" in err[0], err
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_options_defaults_ask_for_a_yes_no_verdict():
    defaults = JudgeOptions()
    assert "{question}" in defaults.template and "{reference}" in defaults.template
    assert parse_verdict("Verdict: yes", re.compile(defaults.pattern), defaults.scores) == 1.0


JUDGE_ARCH = {"model_type": "qwen2", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
              "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 96,
              "tie_word_embeddings": True}


def _greedy(model, prompt, steps, width=64):
    """The model's greedy continuation by full forwards (no cache, no rollout code), `steps` tokens. The row
    is right-padded to `width`, so one compiled forward serves every step: causal attention keeps the
    padding after a position out of its output."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    graphdef, state = nnx.split(model)
    forward = jax.jit(lambda ids: (lambda m: m(ids) @ m.lm_head_weight())(nnx.merge(graphdef, state)))
    ids = list(prompt)
    for _ in range(steps):
        logits = forward(jnp.asarray([ids + [0] * (width - len(ids))]))
        ids.append(int(jnp.argmax(logits[0, len(ids) - 1])))
    return ids[len(prompt):]


def test_a_local_judge_decodes_greedily_with_the_runs_rollout_backend(tmp_path):
    """A random tiny judge on the run's mesh (as build_run attaches it): its prompts go through the rollout
    backend once per batch, greedy and bounded by max_tokens, with the judge's weights; its replies are the
    model's own greedy continuation, and a prompt with no room for them in its context gets no reply."""
    from grpo_core.config import MeshConfig, ModelConfig, RolloutConfig
    from grpo_core.models import QwenConfig, init_from_config, load_pretrained
    from grpo_core.models.hf_io import export_pretrained
    from grpo_core.tokenizer import build_char_tokenizer
    from grpo_meshes import build_mesh_from_config
    from grpo_rollout.backend import JaxRollout
    from grpo_runner_gsm8k.assembly.judge_model import attach_local_judges

    tokenizer = build_char_tokenizer()
    qcfg = QwenConfig.from_hf_dict({**JUDGE_ARCH, "vocab_size": len(tokenizer), "torch_dtype": "float32"})
    export_pretrained(init_from_config(qcfg, seed=3, dtype="float32"), tmp_path / "judge", tokenizer)
    judge = from_plugin(default_registry(), "reward", "judge", {
        "path": str(tmp_path / "judge"), "dtype": "float32", "template": "{completion}={reference}",
        "pattern": "(\\d)", "scores": {}, "max_tokens": 5}, "task.reward_options.judge")
    backend, calls = JaxRollout(), []
    generate, load_weights = backend.generate, backend.load_weights
    backend.load_weights = lambda policy: calls.append(policy.config.hidden_size) or load_weights(policy)
    backend.generate = lambda prompts, key, sampling, **kw: calls.append((len(prompts), sampling, kw)) or generate(
        prompts, key, sampling, **kw)
    resolved = build_mesh_from_config(MeshConfig(), default_registry().mesh)
    attach_local_judges({"judge": (judge, 0.0)}, ModelConfig(), RolloutConfig(), resolved.mesh, resolved.strategy,
                        backend)
    replies = judge.client.decode(["1+2", "4", "9" * 80])
    (hidden, (rows, sampling, kw)) = calls
    assert hidden == 32 and rows == 8 and kw["batch_sharding"].mesh is resolved.mesh  # padded to the 8 devices
    assert sampling.greedy and sampling.max_new_tokens == 5 and judge.client.decode.policy.config.hidden_size == 32
    model = load_pretrained(tmp_path / "judge", dtype="float32")
    for user, reply in zip(["1+2", "4"], replies):
        expected = _greedy(model, judge.client.decode.prompt_ids(user), 5)
        stop = next((i + 1 for i, t in enumerate(expected) if t in sampling.stop_token_ids), 5)
        assert reply == tokenizer.decode(expected[:stop], skip_special_tokens=True)
    assert replies[2] is None  # 80+ prompt tokens and 5 new ones exceed the judge's 96 positions
    assert judge.client.failures == 0  # counted by the client's complete_many, not by the decoder
    assert judge.client.complete_many(["9" * 80]) == [None] and judge.client.failures == 1
