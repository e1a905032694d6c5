"""The gsm8k and arithmetic tasks: loading, epochs, resuming, sharding, prompts, plugin registration."""

import json
from collections import Counter
from pathlib import Path

import pytest

from grpo_core.errors import UserError
from grpo_core.config_io import plugin_options
from grpo_runner_gsm8k import plugin
from grpo_runner_gsm8k.tasks.answers import is_correct
from grpo_runner_gsm8k.tasks import (
    ArithmeticOptions, ArithmeticTask, EpochOrder, Example, Gsm8kOptions, Gsm8kTask, Task,
    final_answer, render_prompt)

DATA = Path(__file__).resolve().parents[3] / "shared/data/gsm8k"


def _write_jsonl(path: Path, count: int, offset: int = 0) -> None:
    rows = [{"question": f"What is {i} plus 1?", "answer": f"{i} + 1 = {i + 1}\n#### {i + 1:,}"}
            for i in range(offset, offset + count)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    _write_jsonl(tmp_path / "train.jsonl", 10)
    _write_jsonl(tmp_path / "test.jsonl", 5, offset=5000)
    return tmp_path


def _gsm8k(path: Path, **kwargs) -> Gsm8kTask:
    return Gsm8kTask(Gsm8kOptions(path=str(path), instruction=""), **kwargs)


# ---------------------------------------------------------------- gsm8k


def test_final_answer_is_the_text_after_the_marker():
    assert final_answer("2 * 600 = 1200\n#### 1,200") == "1200"
    with pytest.raises(ValueError, match="no '####' marker"):
        final_answer("The answer is 5")


def test_gsm8k_from_a_local_directory(data_dir):
    task = _gsm8k(data_dir)
    assert isinstance(task, Task)
    batch = task.train_batch(3)
    assert all(e.question.startswith("What is ") and e.id.startswith("gsm8k/train/") for e in batch)
    assert all(int(e.answer) == int(e.question.split()[2]) + 1 for e in batch)
    assert [e.answer for e in task.test_examples()] == ["5001", "5002", "5003", "5004", "5005"]
    assert len(task.test_examples(limit=2)) == 2


def test_gsm8k_file_pattern_and_parquet(tmp_path, data_dir):
    datasets = pytest.importorskip("datasets")
    for split in ("train", "test"):
        rows = [json.loads(line) for line in (data_dir / f"{split}.jsonl").read_text().splitlines()]
        datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / f"{split}-00000-of-00001.parquet"))
    from_parquet = Gsm8kTask(Gsm8kOptions(path=str(tmp_path)))
    from_pattern = Gsm8kTask(Gsm8kOptions(path=str(data_dir / "{split}.jsonl")))
    assert from_parquet.train == from_pattern.train
    assert from_parquet.test_examples() == from_pattern.test_examples()


def test_gsm8k_instruction_is_appended(data_dir):
    task = Gsm8kTask(Gsm8kOptions(path=str(data_dir), instruction="End with #### <number>."))
    assert task.train_batch(1)[0].question.endswith("plus 1?\n\nEnd with #### <number>.")


def test_gsm8k_errors_name_the_problem(tmp_path, data_dir):
    with pytest.raises(ValueError, match="missing' is not a directory"):
        _gsm8k(tmp_path / "missing")
    with pytest.raises(ValueError, match="train file .*nope/train.jsonl does not exist"):
        _gsm8k(tmp_path / "nope/{split}.jsonl")
    (tmp_path / "other").mkdir()
    with pytest.raises(ValueError, match=r"no train\.jsonl.*found: \[\]"):
        _gsm8k(tmp_path / "other")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "train.jsonl").write_text('{"question": "q"}\n')
    with pytest.raises(ValueError, match="row 0 lacks 'question' or 'answer'"):
        _gsm8k(tmp_path / "bad")


def test_epochs_are_permutations_and_differ(data_dir):
    task = _gsm8k(data_dir, seed=3)
    first, second = task.train_batch(10), task.train_batch(10)
    assert sorted(e.id for e in first) == sorted(e.id for e in second) == sorted(e.id for e in task.train)
    assert [e.id for e in first] != [e.id for e in second]
    assert task.state()["epoch"] == 2 and task.state()["offset"] == 0


def test_batches_cross_epoch_boundaries(data_dir):
    task = _gsm8k(data_dir)
    ids = [e.id for _ in range(5) for e in task.train_batch(4)]  # 20 rows = exactly two epochs
    assert Counter(ids[:10]) == Counter(ids[10:]) and len(set(ids[:10])) == 10


def test_order_depends_only_on_the_seed(data_dir):
    same = [[e.id for e in _gsm8k(data_dir, seed=1).train_batch(10)] for _ in range(2)]
    other = [e.id for e in _gsm8k(data_dir, seed=2).train_batch(10)]
    assert same[0] == same[1] != other


def test_resume_continues_exactly(data_dir):
    reference = _gsm8k(data_dir, seed=5)
    expected = [e.id for _ in range(6) for e in reference.train_batch(3)]
    first = _gsm8k(data_dir, seed=5)
    seen = [e.id for _ in range(2) for e in first.train_batch(3)]
    state = json.loads(json.dumps(first.state()))  # what a checkpoint stores
    resumed = _gsm8k(data_dir, seed=5)
    resumed.restore(state)
    assert seen + [e.id for _ in range(4) for e in resumed.train_batch(3)] == expected


def test_resume_refuses_a_different_order(data_dir):
    state = _gsm8k(data_dir, seed=5).state()
    with pytest.raises(ValueError, match="seed was 5, now 6"):
        _gsm8k(data_dir, seed=6).restore(state)
    with pytest.raises(ValueError, match="process_count was 1, now 2"):
        _gsm8k(data_dir, seed=5, process_count=2).restore(state)


@pytest.mark.parametrize("size, processes", [(12, 3), (10, 3), (7, 7)])
def test_shards_are_disjoint_and_cover_the_epoch(size, processes):
    orders = [EpochOrder(size, seed=0, process_index=p, process_count=processes) for p in range(processes)]
    for _ in range(3):  # epochs
        shards = [set(order.take(size // processes)) for order in orders]
        union = set().union(*shards)
        assert sum(len(s) for s in shards) == len(union)  # disjoint
        assert len(union) == size - size % processes  # covering, less the remainder
        assert all(order.state() == orders[0].state() for order in orders)


def test_sharded_task_splits_train_and_test(data_dir):
    tasks = [_gsm8k(data_dir, process_index=p, process_count=2) for p in range(2)]
    train = [{e.id for e in t.train_batch(5)} for t in tasks]
    test = [{e.id for e in t.test_examples()} for t in tasks]
    assert not train[0] & train[1] and len(train[0] | train[1]) == 10
    assert not test[0] & test[1] and len(test[0]) == len(test[1]) == 2  # 5 test rows: one left out


def test_process_arguments_are_checked(data_dir):
    with pytest.raises(ValueError, match="process_index=2 with process_count=2"):
        _gsm8k(data_dir, process_index=2, process_count=2)
    with pytest.raises(ValueError, match="10 rows cannot be split over 11 processes"):
        _gsm8k(data_dir, process_index=0, process_count=11)


@pytest.mark.skipif(not (DATA / "train.jsonl").is_file(), reason=f"GSM8K data not found at {DATA}")
def test_gsm8k_real_files():
    task = Gsm8kTask(Gsm8kOptions(path=str(DATA)), seed=0, process_index=1, process_count=4)
    assert task.order.shard_size == 7473 // 4
    batch = task.train_batch(8)
    assert all("#### <number>" in e.question and e.answer.lstrip("-").replace(".", "").isdigit() for e in batch)
    assert len(task.test_examples(limit=100)) == 25


# ---------------------------------------------------------------- arithmetic


def test_arithmetic_default_is_single_digit_addition():
    examples = ArithmeticTask(ArithmeticOptions()).train_batch(500)
    for example in examples:
        left, right = example.question.removesuffix("=").split("+")
        assert example.question.endswith("=") and len(example.question) == 4
        assert int(example.answer) == int(left) + int(right)
    assert len({e.question for e in examples}) > 80  # most of the 100 problems appear


def test_arithmetic_is_deterministic_by_seed_and_resumable():
    options = ArithmeticOptions(digits=2, operations="+-*", operands=3)
    first = [e.question for e in ArithmeticTask(options, seed=7).train_batch(20)]
    again = ArithmeticTask(options, seed=7)
    assert [e.question for e in again.train_batch(20)] == first
    assert first != [e.question for e in ArithmeticTask(options, seed=8).train_batch(20)]
    continued = again.train_batch(5)
    resumed = ArithmeticTask(options, seed=7)
    resumed.restore(json.loads(json.dumps(again.state())) | {"position": 20})
    assert resumed.train_batch(5) == continued


@pytest.mark.parametrize("options", [
    ArithmeticOptions(digits=3, operations="+-*", operands=4),
    ArithmeticOptions(digits=2, operations="-", operands=3, allow_negative=True, spaces=True),
    ArithmeticOptions(operations="*", template="What is {expression}?"),
])
def test_arithmetic_answers_are_right(options):
    for example in ArithmeticTask(options).train_batch(200):
        expression = example.question.removeprefix("What is ").rstrip("=?")
        assert int(example.answer) == eval(expression)  # our own generated digits and operators only


def test_arithmetic_difficulty_options():
    easy = ArithmeticTask(ArithmeticOptions(max_result=9)).train_batch(300)
    assert {len(e.answer) for e in easy} == {1}
    hard = ArithmeticTask(ArithmeticOptions(digits=3, operands=4)).train_batch(300)
    assert max(len(e.question) for e in hard) == 16 and max(int(e.answer) for e in hard) > 999
    positive = ArithmeticTask(ArithmeticOptions(operations="-", digits=2)).train_batch(300)
    assert min(int(e.answer) for e in positive) >= 0


def test_arithmetic_sharding_and_test_split():
    options = ArithmeticOptions(digits=3, test_size=50)
    shards = [ArithmeticTask(options, process_index=p, process_count=3) for p in range(3)]
    train_ids = [{e.id for e in s.train_batch(10)} for s in shards]
    assert len(set().union(*train_ids)) == 30
    test_ids = [[e.id for e in s.test_examples()] for s in shards]
    assert sorted(sum(test_ids, [])) == sorted(f"arithmetic/test/{i}" for i in range(48))
    single = ArithmeticTask(options)
    assert single.test_examples(10) == ArithmeticTask(options).test_examples(10)
    assert not {e.question for e in single.test_examples()} <= {e.question for e in single.train_batch(50)}


def test_arithmetic_completions_score_with_the_rewards():
    example = ArithmeticTask(ArithmeticOptions(instruction="Answer as #### <number>.")).train_batch(1)[0]
    assert example.question.endswith("= Answer as #### <number>.")
    assert is_correct(f"#### {example.answer}", example.answer)
    assert is_correct(example.answer, example.answer)


@pytest.mark.parametrize("fields, message", [
    (dict(operations="/"), "unknown: \\['/'\\]"),
    (dict(template="{a}+{b}"), "names the unknown field {a}"),
    (dict(template="What is it?"), "lacks {expression}"),
])
def test_arithmetic_bad_options_are_refused_when_validated(fields, message):
    with pytest.raises(ValueError, match=message):
        ArithmeticOptions(**fields)


def test_arithmetic_options_without_a_problem_in_range_are_a_user_error():
    options = ArithmeticOptions(operations="-", operands=8, digits=1, max_result=0)
    with pytest.raises(UserError, match="no problem with a result in range.*raise task.options.max_result"):
        ArithmeticTask(options).train_batch(50)


# ---------------------------------------------------------------- prompts and plugin


class FakeChatTokenizer:
    chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        assert add_generation_prompt is True and tokenize is False
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


def test_render_prompt_with_and_without_a_chat_template():
    example = Example("3+5=", "8")
    assert render_prompt(FakeChatTokenizer(), example, "Be brief.") == "<system>Be brief.<user>3+5=<assistant>"
    assert render_prompt(FakeChatTokenizer(), example) == "<user>3+5=<assistant>"
    assert render_prompt(None, example, use_chat_template=False) == "3+5="
    assert render_prompt(None, example, "Be brief.", use_chat_template=False) == "Be brief.\n3+5="
    with pytest.raises(ValueError, match="use_chat_template: false"):
        render_prompt(object(), example)


def test_render_prompt_with_the_character_tokenizer():
    pytest.importorskip("transformers")
    from grpo_core.tokenizer import UNK, build_char_tokenizer

    tokenizer = build_char_tokenizer()
    example = ArithmeticTask(ArithmeticOptions()).train_batch(1)[0]
    prompt = render_prompt(tokenizer, example, "Add.")
    assert prompt == (f"<|im_start|>system\nAdd.<|im_end|>\n<|im_start|>user\n{example.question}<|im_end|>\n"
                      "<|im_start|>assistant\n")
    raw_ids = tokenizer(render_prompt(tokenizer, example, use_chat_template=False))["input_ids"]
    assert len(raw_ids) == 4 and tokenizer.convert_tokens_to_ids(UNK) not in raw_ids


def test_plugin_registers_tasks_and_rewards_with_valid_options():
    tasks = {spec.name: spec for spec in plugin.grpo_tasks()}
    rewards = {spec.name: spec for spec in plugin.grpo_rewards()}
    assert set(tasks) == {"gsm8k", "gsm8k_tools", "arithmetic", "boxed_math", "math500", "aime", "amc", "countdown",
                          "code_functions", "humaneval", "dataset"}
    assert set(rewards) == {"correctness", "format", "overlong", "boxed_answer", "countdown", "calculator_call",
                            "environment", "code", "exact", "choice", "judge", "reward_model"}
    options = plugin_options(tasks["arithmetic"].options, {"digits": 2, "max_result": 50}, "task.options")
    task = tasks["arithmetic"].factory(options, seed=1, process_index=0, process_count=1)
    assert len(task.train_batch(2)) == 2
    fmt = rewards["format"].factory(plugin_options(rewards["format"].options, {"style": "boxed"}, "f"))
    assert fmt(["\\boxed{1}"], ["1"]) == [1.0]
