"""The explorer's behaviour logprobs and the trainer's recomputed ones are the same numbers.

Samples from the explorer's TransformersEngine at temperature 0.7, then one trainer step with
proximal recomputation: the behaviour/proximal importance weights must be 1 and their KL 0.
At the wrong temperature they are not, so the check can fail.
"""

import numpy as np
import pytest

from tandem.common.messages.experience import Experience, experience_id, group_id
from tandem.explorer.sampling import SamplingParams
from tandem.explorer.transformers_engine import TransformersEngine
from tandem.trainer.learner import Learner


@pytest.fixture(scope="module")
def sampled(tiny_model_dir):
    engine = TransformersEngine.from_pretrained(tiny_model_dir)
    try:
        groups = engine.generate_sync(["1+1=", "2*3=", "7-5="], n=4, sampling=SamplingParams(
            temperature=0.7, max_tokens=8, seed=0))
    finally:
        engine.close()
    out = []
    for g, completions in enumerate(groups):
        for i, c in enumerate(completions):
            out.append(Experience(
                id=experience_id(f"t{g}", i, 0, "x"), task_id=f"t{g}",
                group_id=group_id(f"t{g}", 0),
                tokens=np.concatenate([c.prompt_ids, c.token_ids]).astype(np.int32),
                prompt_len=len(c.prompt_ids), action_mask=np.ones(len(c), dtype=np.uint8),
                logprobs=c.logprobs.astype(np.float32), reward=float(i % 2), policy_version=0))
    return out


@pytest.mark.parametrize("temperature,agree", [(0.7, True), (1.0, False)])
def test_behaviour_and_proximal_logprobs_agree_at_the_sampling_temperature(
        tiny_model_path, make_config, sampled, temperature, agree):
    learner = Learner(make_config(tiny_model_path, temperature=temperature,
                                  off_policy={"proximal": True, "behaviour_weight": True}))
    m = learner.step(sampled)
    spread = max(m["mismatch/ratio_max"] - 1, 1 - m["mismatch/ratio_min"])
    if agree:
        assert spread < 1e-3 and m["mismatch/kl"] < 1e-6, m
    else:
        assert spread > 1e-2 and m["mismatch/kl"] > 1e-4, m
