"""Broadcast method: real processes in a gloo group built by rendezvous, timeouts naming peers."""

from __future__ import annotations

import time

import pytest
import torch
from backstop import BACKSTOP
from weights_helpers import assert_bit_identical, finish, train_step

from tandem.common.errors import PeerDead
from tandem.common.messages.weights import TensorSpec
from tandem.weights import (
    GroupAbandoned,
    WeightBroadcaster,
    WeightReceiver,
    engine_members,
    plan_buckets,
)


@pytest.fixture
def broadcaster():
    made = []

    def make(**kwargs) -> WeightBroadcaster:
        kwargs.setdefault("timeout", BACKSTOP)
        made.append(WeightBroadcaster(**kwargs))
        return made[-1]

    yield make
    for b in made:
        b.close()


def test_model_weights_arrive_bit_identical_version_after_version(
        tmp_path, tiny_model, tiny_model_dir, spawn, broadcaster):
    sender = broadcaster(bucket_bytes=64 * 2**10)
    member = engine_members("explorer-0")[0]
    rendezvous = sender.open_group([member])
    peer = spawn("broadcast", rendezvous.model_dump_json(), member, tmp_path, "1,2", BACKSTOP,
                 tiny_model_dir)

    train_step(tiny_model, seed=1)
    first = sender.broadcast(1, tiny_model.named_parameters())
    sent_v1 = [(n, p.detach().clone()) for n, p in tiny_model.named_parameters()]
    train_step(tiny_model, seed=2)
    second = sender.broadcast(2, tiny_model.named_parameters())
    finish(peer)

    assert (first.backend, first.epoch, second.epoch) == ("gloo", 1, 1)  # one group, reused
    assert first.buckets > 1 and first.bytes == sum(t.numel() * 4 for _, t in sent_v1)
    assert_bit_identical(sent_v1, tmp_path / "v1.safetensors")
    assert_bit_identical(tiny_model, tmp_path / "v2.safetensors")


def test_two_members_receive_mixed_dtypes(tmp_path, spawn, broadcaster):
    sender = broadcaster(bucket_bytes=1000)
    members = engine_members("explorer-0", 2)
    rendezvous = sender.open_group(members)
    outs = [tmp_path / m.replace("/", "-") for m in members]
    peers = []
    for member, out in zip(members, outs):
        out.mkdir()
        peers.append(spawn("broadcast", rendezvous.model_dump_json(), member, out, "5", BACKSTOP))
    g = torch.Generator().manual_seed(0)
    tensors = [("embed", torch.randn(40, 8, generator=g, dtype=torch.float32)),
               ("norm", torch.randn(8, generator=g).to(torch.bfloat16)),
               ("big", torch.randn(600, generator=g).to(torch.bfloat16)),  # larger than a bucket
               ("steps", torch.arange(7, dtype=torch.int64)),
               ("empty", torch.zeros(0, 3)),
               ("proj", torch.randn(3, 5, generator=g).t())]  # not contiguous
    stats = sender.broadcast(5, tensors)
    for peer, out in zip(peers, outs):
        finish(peer)
        assert_bit_identical(tensors, out / "v5.safetensors")
    assert stats.buckets == len(plan_buckets(
        [TensorSpec(name=n, dtype=str(t.dtype)[6:], shape=list(t.shape)) for n, t in tensors],
        1000)[1])


def test_member_that_never_joins_fails_the_sender_in_time_naming_it(broadcaster):
    sender = broadcaster(timeout=1.5)
    sender.open_group(["explorer-0/w0", "explorer-1/w0"])
    start = time.monotonic()
    with pytest.raises(PeerDead) as failure:
        sender.broadcast(3, [("w", torch.ones(4))])
    assert time.monotonic() - start > 1.4
    assert failure.value.peer == "explorer-0/w0"
    assert "['explorer-0/w0', 'explorer-1/w0'] did not join" in str(failure.value)
    assert "sync.timeout" in str(failure.value)
    assert sender.rendezvous is None  # the epoch is abandoned; the next sync opens a new one


def test_member_that_joins_then_stalls_fails_the_sender_in_time_naming_it(
        tmp_path, spawn, broadcaster):
    sender = broadcaster(timeout=2.0)
    sender.open_group(["explorer-0/w0", "explorer-1/w0"])
    rendezvous = sender.rendezvous.model_dump_json()
    healthy = spawn("broadcast", rendezvous, "explorer-0/w0", tmp_path, "7,8", BACKSTOP)
    stalled = spawn("stall", rendezvous, "explorer-1/w0", BACKSTOP)
    deadline = time.monotonic() + BACKSTOP
    while len(sender.joined()) < 2:  # both processes up before the 2 s clock starts
        assert time.monotonic() < deadline and stalled.poll() is None and healthy.poll() is None
        time.sleep(0.05)
    with pytest.raises(PeerDead) as failure:
        sender.broadcast(7, [("w", torch.ones(16 * 2**20))])  # 64 MiB: more than sockets buffer
    assert failure.value.peer == "explorer-1/w0"
    assert "sync.timeout" in str(failure.value)
    # the member that was fine hears that the trainer gave the epoch up (during version 7 or
    # while waiting for version 8) and says so, instead of waiting for its own timeout
    _, err = healthy.communicate(timeout=BACKSTOP)
    assert healthy.returncode == 3 and "GroupAbandoned" in err and "abandoned weight group" in err


def test_trainer_that_never_starts_fails_the_member_in_time(broadcaster):
    sender = broadcaster()
    rendezvous = sender.open_group(["explorer-0/w0"])
    receiver = WeightReceiver(rendezvous, "explorer-0/w0", timeout=1.0)
    with pytest.raises(PeerDead, match=r"trainer \(rank 0.*did not start.*sync.timeout") as failure:
        receiver.join()
    assert failure.value.peer == "trainer"
    receiver.close()
    with pytest.raises(Exception, match="not a member"):
        WeightReceiver(rendezvous, "explorer-9/w0")


def test_restarted_member_gets_a_fresh_group(tmp_path, spawn, broadcaster):
    sender = broadcaster()
    member = "explorer-0/w0"
    old = sender.open_group([member])
    first = spawn("broadcast", old.model_dump_json(), member, tmp_path, "1", BACKSTOP)
    sender.broadcast(1, [("w", torch.full((64,), 1.0))])
    finish(first)  # the member exits: its side of the group is gone

    with pytest.raises(PeerDead, match="explorer-0/w0") as failure:
        sender.broadcast(2, [("w", torch.full((64,), 2.0))])
    # noticed at once, by its closed connection, not by sync.timeout
    assert failure.value.peer == member and "Connection closed" in str(failure.value)

    new = sender.open_group([member])
    assert new.epoch == old.epoch + 1
    restarted = spawn("broadcast", new.model_dump_json(), member, tmp_path, "2", BACKSTOP)
    tensors = [("w", torch.full((64,), 2.0))]
    sender.broadcast(2, tensors)
    finish(restarted)
    assert_bit_identical(tensors, tmp_path / "v2.safetensors")


def test_a_late_joiner_with_an_old_rendezvous_is_told_to_take_the_new_one(broadcaster):
    sender = broadcaster()
    old = sender.open_group(["a/w0"])
    sender.open_group(["a/w0"])
    with pytest.raises(GroupAbandoned, match="epoch 1 was replaced by epoch 2.*announced last"):
        WeightReceiver(old, "a/w0", timeout=BACKSTOP).join()
    restarted = broadcaster().open_group(["a/w0"])  # a new trainer counts from 1
    assert restarted.epoch == old.epoch
    receiver = WeightReceiver(old, "a/w0")
    assert receiver.matches(old.model_dump()) and not receiver.matches(restarted)


def test_bucket_plan_groups_dtypes_and_respects_the_size():
    specs = [TensorSpec(name="a", dtype="float32", shape=[10]),     # 40 bytes
             TensorSpec(name="b", dtype="bfloat16", shape=[10]),    # 20 bytes
             TensorSpec(name="c", dtype="float32", shape=[20]),     # 80 bytes
             TensorSpec(name="d", dtype="float32", shape=[100]),    # 400 bytes: alone
             TensorSpec(name="e", dtype="float32", shape=[5]),
             TensorSpec(name="f", dtype="bfloat16", shape=[2, 3])]
    order, buckets = plan_buckets(specs, 128)
    assert [specs[i].name for i in order] == ["a", "c", "d", "e", "b", "f"]
    assert [(b.dtype, b.numel, b.first, b.count) for b in buckets] == [
        ("float32", 30, 0, 2), ("float32", 100, 2, 1), ("float32", 5, 3, 1),
        ("bfloat16", 16, 4, 2)]


def test_a_member_expecting_another_version_refuses_and_the_sender_names_it(broadcaster):
    # Both ends in this process (threads, real gloo sockets): a disagreement about the sync
    # plan must surface on both sides, not hang either.
    import threading

    sender = broadcaster()
    rendezvous = sender.open_group(["explorer-0/w0"])
    receiver = WeightReceiver(rendezvous, "explorer-0/w0", timeout=BACKSTOP)
    joined = threading.Thread(target=receiver.join)
    joined.start()
    outcome: dict[str, BaseException] = {}

    def send() -> None:
        try:
            sender.broadcast(5, [("w", torch.ones(2**20))])
        except BaseException as exc:
            outcome["error"] = exc

    sending = threading.Thread(target=send)
    sending.start()
    joined.join(BACKSTOP)
    with pytest.raises(Exception, match="expects version 4, the trainer broadcasts 5"):
        receiver.receive(4)
    sending.join(BACKSTOP)
    assert not sending.is_alive()
    assert isinstance(outcome.get("error"), PeerDead)
    assert outcome["error"].peer == "explorer-0/w0"
    assert not receiver.healthy
    with pytest.raises(GroupAbandoned, match="unusable"):
        receiver.receive(5)


def test_close_releases_a_blocked_join_and_a_blocked_broadcast_at_once(broadcaster):
    # An explorer or trainer shutting down must not wait out sync.timeout in a helper thread.
    import threading

    sender = broadcaster()
    rendezvous = sender.open_group(["explorer-0/w0", "explorer-1/w0"])
    receiver = WeightReceiver(rendezvous, "explorer-0/w0", timeout=BACKSTOP)
    errors: dict[str, BaseException] = {}

    def run(name, fn) -> threading.Thread:
        def target() -> None:
            try:
                fn()
            except BaseException as exc:
                errors[name] = exc
        thread = threading.Thread(target=target)
        thread.start()
        return thread

    joining = run("join", receiver.join)  # waits for the trainer to choose a backend
    # waits for explorer-1, which never comes
    sending = run("broadcast", lambda: sender.broadcast(1, [("w", torch.ones(4))]))
    deadline = time.monotonic() + BACKSTOP
    while sender.joined() != ["explorer-0/w0"]:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    receiver.close()
    sender.close()
    joining.join(BACKSTOP)
    sending.join(BACKSTOP)
    assert not joining.is_alive() and not sending.is_alive()
    assert isinstance(errors["join"], GroupAbandoned) and "was closed" in str(errors["join"])
    assert isinstance(errors["broadcast"], GroupAbandoned)
    assert "closed its broadcaster" in str(errors["broadcast"])


def _member_in_thread(receiver: WeightReceiver, version: int, got: dict):
    """Join and receive one version on a thread, as an explorer's engine thread would."""
    import threading

    def run() -> None:
        receiver.join()
        got.update((n, t.clone()) for n, t in receiver.receive(version))

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_a_member_that_restarts_into_a_formed_group_gets_a_new_epoch(broadcaster):
    # Both ends in this process (threads, real gloo sockets).
    sender = broadcaster()
    first = sender.open_group(["explorer-0/w0"])
    before, got = WeightReceiver(first, "explorer-0/w0", timeout=BACKSTOP), {}
    member = _member_in_thread(before, 1, got)
    sender.broadcast(1, [("w", torch.full((8,), 1.0))])
    member.join(BACKSTOP)
    assert torch.equal(got["w"], torch.full((8,), 1.0)) and sender.rendezvous == first

    after = WeightReceiver(first, "explorer-0/w0", timeout=BACKSTOP)  # the restarted process
    with pytest.raises(GroupAbandoned, match="already has a explorer-0/w0"):
        after.join()
    assert sender.rendezvous is None  # the trainer's cue to open a new epoch
    with pytest.raises(PeerDead, match="restarted after group epoch 1") as failure:
        sender.broadcast(2, [("w", torch.full((8,), 2.0))])
    assert failure.value.peer == "explorer-0/w0"
    before.close()

    second = sender.open_group(["explorer-0/w0"])
    again, got = WeightReceiver(second, "explorer-0/w0", timeout=BACKSTOP), {}
    member = _member_in_thread(again, 2, got)
    sender.broadcast(2, [("w", torch.full((8,), 2.0))])
    member.join(BACKSTOP)
    assert torch.equal(got["w"], torch.full((8,), 2.0))
    again.close()
