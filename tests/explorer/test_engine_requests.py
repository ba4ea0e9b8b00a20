"""What every engine's `generate` does before and after its own requests (`engine.py`): prompts
checked and tokenized once, and a call split into requests and put back together per prompt."""

from __future__ import annotations

import numpy as np
import pytest

from tandem.explorer.engine import Completion, encode_prompts, in_requests
from tandem.explorer.sampling import SamplingParams


class CharTokenizer:
    """One id per character: enough to tell text from ids."""

    def __call__(self, text: str):
        return type("Encoded", (), {"input_ids": [ord(c) for c in text]})()


def test_text_is_tokenized_and_ids_are_taken_as_given():
    assert encode_prompts(CharTokenizer(), ["ab", (7, np.int64(8))], 2) == [[97, 98], [7, 8]]


@pytest.mark.parametrize("prompts,n,message", [
    (["ab"], 0, "n must be >= 1, got 0"),
    (["ab", ""], 1, "prompt 1 is empty"),
    ([[1], []], 1, "prompt 1 is empty"),
])
def test_bad_calls_name_what_was_wrong(prompts, n, message):
    with pytest.raises(ValueError, match=message):
        encode_prompts(CharTokenizer(), prompts, n)


def test_a_prompt_without_room_raises_the_engines_own_error():
    class TooLong(Exception):
        pass

    assert encode_prompts(CharTokenizer(), ["abc"], 1, max_model_len=4) == [[97, 98, 99]]
    with pytest.raises(TooLong, match="prompt 1: 4 tokens"):
        encode_prompts(CharTokenizer(), ["a", "abcd"], 1, max_model_len=4,
                       too_long=lambda index, length: TooLong(f"prompt {index}: {length} tokens"))
    with pytest.raises(ValueError, match="prompt 0 has 4 tokens, max_model_len is 4"):
        encode_prompts(CharTokenizer(), ["abcd"], 1, max_model_len=4)


def completion(label: float) -> Completion:
    return Completion(prompt_ids=np.zeros(1), token_ids=np.zeros(1), logprobs=np.array([label]),
                      text=str(label), finish_reason="length")


@pytest.mark.parametrize("sampling,calls", [
    (SamplingParams(temperature=1.0), [(0, 0, 3), (1, 0, 3)]),  # one request of n per prompt
    (SamplingParams(temperature=0.0),  # greedy: n requests of one sample
     [(0, 0, 1), (0, 1, 1), (0, 2, 1), (1, 0, 1), (1, 1, 1), (1, 2, 1)]),
])
async def test_requests_are_put_back_together_per_prompt_in_order(sampling, calls):
    made = []

    async def request(index, ids, part, samples):
        made.append((index, part, samples))
        return [completion(index * 100 + part * 10 + k) for k in range(samples)]

    out = await in_requests([[1], [2]], 3, sampling, request)
    assert made == calls
    labels = [[c.text for c in prompt] for prompt in out]
    if sampling.greedy:
        assert labels == [["0", "10", "20"], ["100", "110", "120"]]
    else:
        assert labels == [["0", "1", "2"], ["100", "101", "102"]]
