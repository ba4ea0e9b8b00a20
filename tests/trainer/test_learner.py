"""The learner on the tiny model: real forward/backward, no sockets."""

import json

import pytest
import torch

from tandem.common.errors import ConfigError
from tandem.trainer import checkpoint
from tandem.trainer.algorithms import POLICY_LOSSES
from tandem.trainer.batch import build_batch
from tandem.trainer.forward import token_logprobs
from tandem.trainer.learner import Learner, lr_multiplier

from grads import assert_same_gradient, step_with_grads


def response_logprob(learner, experiences):
    """Mean logprob of each experience's response under the learner's current policy."""
    batch = build_batch(experiences)
    with torch.no_grad():
        out = learner.actor(batch.tokens, batch.attention)
    return ((out.logprobs * batch.mask).sum(-1) / batch.mask.sum(-1)).tolist()


def params(learner):
    return {k: v.detach().clone() for k, v in learner.actor.state_dict().items()}


def test_grpo_step_lowers_the_loss_and_raises_positive_advantage_responses(
        tiny_model_path, make_config, make_group, with_model_logprobs):
    # no character is shared between responses, so pushing one up cannot drag another along
    batch = with_model_logprobs(
        make_group("t1", "1+1=", ["2", "35", "7", "48"], [1.0, 0.0, 0.0, 1.0])
        + make_group("t2", "2*3=", ["6", "9", "ab", "cd"], [1.0, 0.0, 1.0, 0.0]))
    learner = Learner(make_config(tiny_model_path, lr=3e-3, aggregation="seq_mean_token_mean"))
    before = response_logprob(learner, batch)
    losses = [learner.step(batch)["loss/policy"] for _ in range(4)]
    after = response_logprob(learner, batch)
    assert losses[0] == pytest.approx(0.0, abs=1e-5)  # ratio 1 and advantages sum to zero
    assert losses[-1] < losses[0] - 0.05
    for e, b, a in zip(batch, before, after):
        assert (a > b) == (e.reward > 0), (e.tokens, b, a)
    assert learner.version == 4


def test_reference_kl_is_zero_while_the_policy_equals_the_reference(tiny_model_path, fixed_batch,
                                                                      make_config):
    learner = Learner(make_config(tiny_model_path, kl={"coef": 0.1, "estimator": "k3"}))
    first = learner.step(fixed_batch)
    assert first["kl/reference"] == 0.0 and first["loss/kl"] == 0.0
    second = learner.step(fixed_batch)
    assert second["kl/reference"] > 0.0


def test_micro_batch_split_does_not_change_the_update(tiny_model_path, fixed_batch, make_config):
    for aggregation in ("token_mean", "seq_mean_token_mean"):
        results = []
        for budget in (10_000, 16):  # one micro-batch vs several
            learner = Learner(make_config(tiny_model_path, micro_batch_tokens=budget,
                                          aggregation=aggregation, max_grad_norm=1e9))
            m, grads = step_with_grads(learner, fixed_batch)
            results.append((m["batch/micro_batches"], m["loss/policy"], m["optim/grad_norm"],
                            grads))
        (n1, loss1, norm1, p1), (n2, loss2, norm2, p2) = results
        assert n1 == 1 and n2 > 1
        assert loss1 == pytest.approx(loss2, rel=1e-5)
        # Adam hides a wrongly scaled gradient; the gradient norm does not
        assert norm1 == pytest.approx(norm2, rel=1e-5)
        assert_same_gradient(p1, p2)


def test_resume_continues_exactly(tiny_model_path, fixed_batch, tmp_path, make_config, make_group):
    other = make_group("t3", "9-4=", ["5", "4", "55", "3"], [1.0, 0.0, 1.0, 0.0])
    batches = [fixed_batch, other, fixed_batch[:4] + other[:4]]
    cfg = make_config(tiny_model_path, warmup_steps=2, schedule="cosine", total_steps=10,
                      weight_decay=0.01)
    straight = Learner(cfg)
    for b in batches:
        straight.step(b)
    first = Learner(cfg)
    for b in batches[:2]:
        first.step(b)
    saved = first.save_checkpoint(tmp_path / "checkpoints")
    assert checkpoint.latest(tmp_path / "checkpoints") == saved
    resumed = Learner(cfg, resume_from=saved)
    assert resumed.step_count == 2
    assert resumed.scheduler.get_last_lr() == first.scheduler.get_last_lr()
    resumed.step(batches[2])
    expected, got = params(straight), params(resumed)
    for name in expected:
        assert torch.equal(expected[name], got[name]), name


def test_checkpoint_is_a_hugging_face_folder_and_old_ones_are_pruned(
        tiny_model_path, fixed_batch, tmp_path, make_config):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    learner = Learner(make_config(tiny_model_path, keep_checkpoints=2))
    for _ in range(3):
        learner.step(fixed_batch)
        path = learner.save_checkpoint(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000002", "step_00000003"]
    assert (path / "model" / "model.safetensors").exists()
    assert json.loads((path / "trainer_state.json").read_text())["step"] == 3
    model = AutoModelForCausalLM.from_pretrained(str(path / "model"))
    AutoTokenizer.from_pretrained(str(path / "model"))
    state = learner.policy_state_dict()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, state[name]), name


ALGORITHMS = [
    dict(advantage="dr_grpo", loss="pg"),
    dict(advantage="rloo", clip_high=0.28, dual_clip=3.0),
    dict(advantage="reinforce_pp", kl={"coef": 0.05, "placement": "reward", "estimator": "k1"}),
    dict(advantage="gae", gamma=0.99, lam=0.95),
    dict(loss="gspo", aggregation="seq_mean_token_mean", clip_low=3e-4, clip_high=4e-4),
    dict(loss="sft", aggregation="seq_mean_token_sum"),
    dict(loss={"name": "dpo", "beta": 0.2}),
    dict(off_policy={"proximal": True, "behaviour_weight": True, "is_cap": 2.0},
         entropy_coef=0.01, kl={"coef": 0.01, "estimator": "k2"}),
]


@pytest.mark.parametrize("algorithm", ALGORITHMS, ids=lambda a: ",".join(f"{k}" for k in a))
def test_every_algorithm_trains_a_step(tiny_model_path, fixed_batch, algorithm, make_config):
    learner = Learner(make_config(tiny_model_path, **algorithm))
    before = params(learner)
    if algorithm.get("off_policy"):  # behaviour logprobs (-6) well below the model's (~ -4.6)
        fixed_batch = [e.model_copy(update={"logprobs": e.logprobs - 3.0}) for e in fixed_batch]
    m = learner.step(fixed_batch)
    assert all(torch.isfinite(torch.tensor(v)) for v in m.values()), m
    assert any(not torch.equal(before[k], v) for k, v in params(learner).items())
    if algorithm.get("off_policy"):
        # behaviour logprobs are a constant -3: the proximal/behaviour weights are reported, capped
        assert m["mismatch/ratio_max"] > 2.0
        assert 0 < m["mismatch/truncated_frac"] <= 1
    if algorithm.get("advantage") == "gae":
        assert m["loss/value"] > 0


def test_dynamic_sampling_drops_uninformative_groups(tiny_model_path, fixed_batch, make_config,
                                                     make_group):
    flat = make_group("t9", "3+3=", ["6", "7"], [1.0, 1.0])
    learner = Learner(make_config(tiny_model_path, dynamic_sampling=True))
    m = learner.step(fixed_batch + flat)
    assert m["dynamic_sampling/dropped_groups"] == 1.0 and m["batch/groups"] == 3.0
    before = params(learner)
    m = learner.step(flat)
    assert m["train/skipped"] == 1.0 and learner.version == 2  # counted, without an update
    assert all(torch.equal(before[k], v) for k, v in params(learner).items())


def test_logprobs_follow_the_sampling_temperature():
    logits = torch.tensor([[[2.0, 0.0, -1.0]]])
    target = torch.tensor([[0]])
    logp, ent = token_logprobs(logits, target, temperature=0.5, entropy="metric")
    expected = torch.log_softmax(logits / 0.5, -1)
    assert logp.item() == pytest.approx(expected[0, 0, 0].item(), rel=1e-5)
    assert ent.item() == pytest.approx(-(expected.exp() * expected).sum().item(), rel=1e-5)


def test_lr_schedule_warms_up_then_decays():
    mult = [lr_multiplier(s, 2, "cosine", 6, 0.1) for s in range(7)]
    assert mult[:3] == pytest.approx([0.5, 1.0, 1.0])
    assert mult[4] == pytest.approx(0.1 + 0.9 * 0.5) and mult[6] == pytest.approx(0.1)


def test_bad_inputs_are_clear_errors(tiny_model_path, make_config, make_group, monkeypatch):
    with pytest.raises(ValueError, match="unknown policy loss 'ppo2'; registered: cispo_clip, dpo, "):
        make_config(tiny_model_path, loss="ppo2")
    # validated where no loss is registered (the trainer not installed there), the config
    # passes; the learner checks the name and the parameters again when it starts
    with monkeypatch.context() as m:
        m.setattr(POLICY_LOSSES, "_entries", {})
        unknown = make_config(tiny_model_path, loss="ppo2")
        misspelt = make_config(tiny_model_path, loss={"name": "dpo", "betta": 0.2})
    with pytest.raises(ConfigError, match="trainer.loss: unknown policy loss 'ppo2'"):
        Learner(unknown)
    with pytest.raises(ConfigError, match="trainer.loss.betta: not a parameter of policy loss "
                                          "dpo; its parameters: beta"):
        Learner(misspelt)
    bad = make_group("t", "", ["1"], [1.0])
    with pytest.raises(ValueError, match="prompt_len is 0"):
        build_batch(bad)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_step_uses_bf16_autocast_and_keeps_fp32_weights(tiny_model_path, fixed_batch,
                                                            make_config):
    learner = Learner(make_config(tiny_model_path, device="cuda", kl={"coef": 0.1}))
    assert learner.device.type == "cuda"
    with learner._autocast():
        out = learner.actor(torch.tensor([[1, 2, 3]], device="cuda"),
                            torch.ones(1, 3, dtype=torch.long, device="cuda"))
    assert out.logprobs.dtype == torch.float32  # logprobs in fp32 from bf16 logits
    m = learner.step(fixed_batch)
    assert all(torch.isfinite(torch.tensor(v)) for v in m.values()), m
    assert all(p.dtype == torch.float32 for p in learner.actor.parameters())
    assert abs(m["kl/reference"]) < 1e-2  # bf16 reference vs fp32-master policy: close


def test_fsdp_in_one_process_shards_over_a_one_rank_group_and_trains_as_one_process(
        tiny_model_path, fixed_batch, make_config, tmp_path):
    """`trainer.parallel: fsdp` without torchrun: FSDP2 on one device (the GPU script's trainer
    check), the same sharded state-dict and checkpoint path as on many devices."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from tandem.trainer import distributed

    plain = Learner(make_config(tiny_model_path))
    expected = [plain.step(fixed_batch)["loss/policy"] for _ in range(2)]
    sharded = Learner(make_config(tiny_model_path, parallel="fsdp"))
    try:
        assert sharded.mode == "fsdp"
        assert dist.get_world_size() == 1
        assert all(isinstance(p, DTensor) for p in sharded.actor.parameters())
        got = [sharded.step(fixed_batch)["loss/policy"] for _ in range(2)]
        assert got == pytest.approx(expected, rel=1e-4, abs=1e-6)
        reference = plain.policy_state_dict()
        for name, tensor in sharded.policy_state_dict().items():
            torch.testing.assert_close(tensor, reference[name], rtol=1e-4, atol=1e-5)
        saved = sharded.save_checkpoint(tmp_path / "checkpoints")
        assert (saved / "model" / "model.safetensors").exists()
    finally:
        sharded.release()
        distributed.shutdown()
    assert not dist.is_initialized()
