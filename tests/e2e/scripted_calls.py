"""`grpo-run` for tests/e2e/test_resume.py, except that a random tiny model, which hardly ever
writes a call, has the first turn of every row of some prompts (those whose text before the
assistant's turn has an even sum of character codes) written as CALL, over as many rounds as it
takes (multi-turn partial rollouts: grpo_runner_gsm8k.samplers.multi_turn_partial). Where a row
is in CALL is read from the tokens it holds, so the script depends on nothing but the rows a
checkpoint saves."""

import sys

import numpy as np

from grpo_runner_gsm8k import cli
from grpo_runner_gsm8k.samplers import multi_turn_partial

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>'
HEADER = "<|im_start|>assistant\n"
ROUND_FIELDS = ("completion_ids", "sampler_logps", "lengths", "finished")


def rest_of_call(tokenizer, call: list[int], prefix: list[int]) -> list[int]:
    """The tokens of CALL this row still has to write ([] for a row not scripted, or past its first turn)."""
    text = tokenizer.decode(prefix, skip_special_tokens=False)
    if text.count(HEADER) != 1 or sum(map(ord, text.split(HEADER)[0])) % 2:
        return []
    held = text.split(HEADER)[1]
    written = (m for m in range(len(call)) if tokenizer.decode(call[:m], skip_special_tokens=False) == held)
    return call[next(written, len(call)):]


def scripted(run, backend, sampling, kv_cache):
    """`round_generator`, with the scripted rows' sampled tokens replaced by the rest of CALL."""
    one_round, tokenizer = ORIGINAL(run, backend, sampling, kv_cache), run.inputs.tokenizer
    call = tokenizer.encode(CALL, add_special_tokens=False)

    def rounds(prefixes, key, budget, cached):
        result = one_round(prefixes, key, budget, cached)
        fields = {name: np.array(getattr(result, name)) for name in ROUND_FIELDS}
        for i, prefix in enumerate(prefixes):
            rest = rest_of_call(tokenizer, call, list(prefix))[:budget]
            if rest:
                fields["completion_ids"][i, :len(rest)], fields["sampler_logps"][i, :len(rest)] = rest, -1.0
                fields["lengths"][i], fields["finished"][i] = len(rest), rest[-1] == call[-1]
        return result.replace(**fields)

    return rounds


ORIGINAL, multi_turn_partial.round_generator = multi_turn_partial.round_generator, scripted

if __name__ == "__main__":
    sys.exit(cli.main(sys.argv[1:]))
