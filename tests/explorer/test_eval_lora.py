"""`tandem eval --checkpoint` on a LoRA (adapter-only) trainer checkpoint: the adapter is merged
into `model.path` with the trainer's own merge and the merged model is what gets scored."""

from __future__ import annotations

import asyncio
import json
import shutil
import sys

import numpy as np
import pytest
import torch

from backstop import BACKSTOP
from processes import run_group
from tandem.common.config import RunConfig
from tandem.common.messages.experience import Experience, experience_id, group_id

pytest.importorskip("peft")

PROMPTS = ["rev 12=", "rev 345=", "rev 6789=", "1+1=", "2*3="]


def _batch(tokenizer) -> list[Experience]:
    out = []
    for task, prompt, responses, rewards in (
            ("t1", "1+1=", ["2", "3", "22", "11"], [1.0, 0.0, 0.0, 1.0]),
            ("t2", "2*3=", ["6", "5", "66", "six"], [1.0, 0.0, 1.0, 0.0])):
        p = tokenizer(prompt)["input_ids"]
        for i, (text, reward) in enumerate(zip(responses, rewards)):
            r = tokenizer(text)["input_ids"]
            out.append(Experience(
                id=experience_id(task, i, 0, "test"), task_id=task, group_id=group_id(task, 0),
                tokens=np.array(p + r, dtype=np.int32), prompt_len=len(p),
                action_mask=np.ones(len(r), dtype=np.uint8),
                logprobs=np.full(len(r), -3.0, dtype=np.float32), reward=reward,
                policy_version=0))
    return out


def _greedy(path) -> list[str]:
    from tandem.explorer.sampling import SamplingParams
    from tandem.explorer.transformers_engine import TransformersEngine

    engine = TransformersEngine.from_pretrained(path, max_batch=8)
    try:
        done = asyncio.run(engine.generate(PROMPTS, 1, SamplingParams(temperature=0,
                                                                      max_tokens=4)))
    finally:
        engine.close()
    return [d[0].text.strip() for d in done]


def test_tandem_eval_merges_a_lora_checkpoint_into_the_base(tmp_path, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from tandem.trainer.learner import Learner
    from tandem.weights.hf import load_tokenizer

    lora = {"r": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj", "up_proj", "down_proj"]}
    learner = Learner(RunConfig.model_validate({
        "model": {"path": str(tiny_model_dir), "lora": lora}, "run_dir": str(tmp_path / "t"),
        "trainer": {"micro_batch_tokens": 64, "lr": 0.3, "tensorboard": False}}))
    batch = _batch(load_tokenizer(tiny_model_dir))
    for _ in range(2):
        learner.step(batch)
    step = learner.save_checkpoint(tmp_path / "checkpoints")
    assert (step / "adapter").is_dir() and not (step / "model").exists()

    # the merged model, built directly from the trainer's merged weights
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype="auto")
    merged = {k: v.clone() for k, v in learner.policy_state_dict().items()}
    changed = [k for k, v in base.state_dict().items() if not torch.equal(v, merged[k])]
    assert changed, "the adapters left every weight as it was"
    base.load_state_dict(merged)
    direct = tmp_path / "merged"
    shutil.copytree(tiny_model_dir, direct)
    base.save_pretrained(str(direct), safe_serialization=True)
    merged_says, base_says = _greedy(direct), _greedy(tiny_model_dir)
    assert all(merged_says), merged_says
    assert merged_says != base_says  # an evaluation that ignored the adapter would score less

    heldout = tmp_path / "heldout.jsonl"
    heldout.write_text("".join(json.dumps({"prompt": p, "truth": {"type": "short", "answer": a}})
                               + "\n" for p, a in zip(PROMPTS, merged_says)))
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        f"run_dir: {tmp_path / 'run'}\nmodel: {{path: {tiny_model_dir}}}\n"
        "explorers: [{name: e0, workflow_args: {reward_fn: k12, answer_key: truth}, "
        "sampling: {max_tokens: 4}}]\n"
        "reward: {functions: {k12: 1.0}}\n"
        f"eval: {{tasksets: [{{name: heldout, path: {heldout}}}], modes: [greedy]}}\n")

    # `tandem eval` runs the explorer's eval CLI as its child: a hang's bound stops both
    done = run_group(
        [sys.executable, "-m", "tandem.master.cli", "eval", str(cfg), "--checkpoint", str(step),
         "--json"], BACKSTOP)
    assert done.returncode == 0, done.stderr
    row = json.loads(done.stdout.strip().splitlines()[-1])
    # the answers are the merged model's own greedy ones: evaluated directly it scores 1.0,
    # while the base (the adapter ignored) would miss every prompt where it says otherwise
    assert row["metrics"] == {"greedy/reward_mean": 1.0, "greedy/accuracy": 1.0}
    assert row["version"] == 2 and row["checkpoint"] == str(step / "adapter")
    written = json.loads((tmp_path / "run" / "eval.jsonl").read_text())
    assert written["checkpoint"] == str(step / "adapter")
