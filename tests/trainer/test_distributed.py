"""Two gloo processes under torchrun train exactly what one process trains (DDP and FSDP2),
with rank 0 driving the other through the trainer's command channel."""

import json
import os
import signal
import subprocess
import sys

import pytest
import torch
from backstop import BACKSTOP
from safetensors.torch import load_file

from tandem.trainer.learner import Learner

from batch_json import write_batch

WORKER = os.path.join(os.path.dirname(__file__), "dist_worker.py")
EXIT_WORKER = os.path.join(os.path.dirname(__file__), "exit_worker.py")


def torchrun(worker: str, *args, timeout: float = BACKSTOP) -> str:
    """Run `worker` on two gloo ranks; kill the whole session and fail when it overruns."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           worker, *map(str, args)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the ranks too: a hung rank ignores SIGTERM
        output, _ = proc.communicate()
        pytest.fail(f"torchrun did not finish in {timeout:g} s:\n{output.decode()[-3000:]}")
    assert proc.returncode == 0, output.decode()[-3000:]
    return output.decode()


@pytest.mark.slow
def test_two_ranks_match_one(tiny_model_path, fixed_batch, make_config, tmp_path):
    torchrun(WORKER, tiny_model_path, write_batch(fixed_batch, tmp_path), tmp_path)

    single = Learner(make_config(tiny_model_path, micro_batch_tokens=24,
                                 off_policy={"proximal": True}))
    expected = [single.step(fixed_batch) for _ in range(2)]
    reference = {k: v.clone() for k, v in single.policy_state_dict().items()}  # live tensors
    for mode in ("ddp", "fsdp"):
        got = torch.load(tmp_path / f"{mode}.pt", weights_only=True)
        assert set(got) == set(reference) - {"lm_head.weight"}  # tied: published once
        for name, tensor in got.items():
            torch.testing.assert_close(tensor, reference[name], rtol=1e-4, atol=1e-5)
        result = json.loads((tmp_path / f"{mode}.json").read_text())
        metrics = result["metrics"]
        if mode == "ddp":  # the tiny model's gradients fit one bucket
            assert metrics[0]["batch/micro_batches"] >= 2
            assert result["reduces"] == 2, "gradients were all-reduced per micro-batch"
        for key in ("loss/policy", "optim/grad_norm", "policy/clip_frac", "policy/ratio_max"):
            assert metrics[1][key] == pytest.approx(expected[1][key], rel=1e-3, abs=1e-6), \
                (mode, key)
    # a trainer resumed from the FSDP2 checkpoint takes the third step the single process takes
    single.step(fixed_batch)
    resumed = torch.load(tmp_path / "fsdp-resumed.pt", weights_only=True)
    third = single.policy_state_dict()
    for name, tensor in resumed.items():
        torch.testing.assert_close(tensor, third[name], rtol=1e-4, atol=1e-5)
    saved = load_file(str(tmp_path / "fsdp" / "checkpoints" / "step_00000002" / "model" /
                          "model.safetensors"))
    for name, tensor in saved.items():
        torch.testing.assert_close(tensor, reference[name], rtol=1e-4, atol=1e-5)
    assert (tmp_path / "fsdp" / "checkpoints" / "step_00000003").exists()

    # PPO epochs and mini-batches: both ranks shuffle and split each epoch alike (seeded by the
    # step), so two ranks take the four updates of each step that one process takes
    ppo = Learner(make_config(tiny_model_path, micro_batch_tokens=24, ppo_epochs=2,
                              mini_batches=2, off_policy={"proximal": True}))
    expected = [ppo.step(fixed_batch) for _ in range(2)]
    got = torch.load(tmp_path / "ddp-ppo.pt", weights_only=True)
    reference = ppo.policy_state_dict()
    for name, tensor in got.items():
        torch.testing.assert_close(tensor, reference[name], rtol=1e-4, atol=1e-5)
    metrics = json.loads((tmp_path / "ddp-ppo.json").read_text())["metrics"]
    assert metrics[1]["train/updates"] == 4.0
    for key in ("policy/clip_frac", "policy/clip_frac/last", "optim/grad_norm/last"):
        assert metrics[1][key] == pytest.approx(expected[1][key], rel=1e-3, abs=1e-6), key


@pytest.mark.slow
def test_torchrun_ranks_exit_after_ddp_training_with_the_group_freed_in_shutdown(
        tiny_model_path, fixed_batch, tmp_path):
    """Issue 14 item 8: DDP's reducer used to free the gloo group after `shutdown`, from a
    finaliser, with the GIL held, while a gloo worker waited for the GIL: the rank never exited.
    Now the group goes inside `shutdown`, in order, on every rank."""
    torchrun(EXIT_WORKER, tiny_model_path, write_batch(fixed_batch, tmp_path), tmp_path)
    for rank in (0, 1):
        threads = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert threads["group_threads"] >= 1
        assert threads["left"] == 0, f"rank {rank}: the group outlived shutdown: {threads}"
