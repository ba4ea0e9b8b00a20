"""Shared-memory transport: versions in /dev/shm arrive bit-identical in another process, are
freed once no explorer holds them, and no SIGKILLed trainer or explorer leaves a segment."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from backstop import BACKSTOP
from weights_helpers import assert_bit_identical, finish, train_step

from tandem.weights import WeightsError, load_into
from tandem.weights.shm import (
    SHM_ROOT, SharedMemoryPublisher, SharedMemorySubscriber, list_segments, run_key)

pytestmark = pytest.mark.skipif(not SHM_ROOT.is_dir(), reason="no /dev/shm on this host")


@pytest.fixture
def run_dir(tmp_path):
    """A run dir whose segments are all gone after the test (asserted, then cleaned). An
    in-process publisher starts this process's resource tracker, which would outlive the test:
    it is stopped here (a trainer's ends with the trainer)."""
    from multiprocessing import resource_tracker

    yield tmp_path
    resource_tracker._resource_tracker._stop()
    left = segments(tmp_path)
    for path in left:
        path.unlink(missing_ok=True)
    assert not left, f"segments left behind: {left}"


def segments(run_dir) -> list[Path]:
    return sorted(p for p in SHM_ROOT.iterdir() if p.name.startswith(f"tandem-{run_key(run_dir)}-"))


def mapped_by(path: Path) -> list[int]:
    """Every process that maps `path` (the kernel's own record, /proc/PID/maps)."""
    found = []
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            if str(path) in maps.read_text():
                found.append(int(maps.parent.name))
        except OSError:
            continue
    return found


def small_tensors():
    return [("a", torch.arange(6, dtype=torch.float32).reshape(2, 3)),
            ("b", torch.ones(4, dtype=torch.bfloat16)),
            ("c", torch.zeros(0, dtype=torch.int64)),
            ("d", torch.tensor(7, dtype=torch.int32)),
            ("e", torch.arange(12.0).reshape(3, 4).t())]  # not contiguous


def test_published_weights_arrive_bit_identical_in_another_process(
        run_dir, tiny_model, tiny_model_dir, spawn):
    announced = []
    publisher = SharedMemoryPublisher(run_dir, announce=announced.append)
    train_step(tiny_model, seed=3)
    published = publisher.publish(1, tiny_model.named_parameters())
    assert [p.version for p in announced] == [1]
    assert published.path == SHM_ROOT / f"tandem-{run_key(run_dir)}-v1"
    assert segments(run_dir) == [published.path]  # no temporary segment left
    out = run_dir / "out"
    out.mkdir()
    finish(spawn("shm", run_dir, out, 1, tiny_model_dir))
    assert_bit_identical(tiny_model, out / "v1.safetensors")
    publisher.close()


def test_dtypes_shapes_and_views(run_dir):
    publisher = SharedMemoryPublisher(run_dir)
    publisher.publish(0, small_tensors())
    got = dict(SharedMemorySubscriber(run_dir).load(0))
    for name, want in small_tensors():
        assert got[name].dtype == want.dtype and got[name].shape == want.shape, name
        assert torch.equal(got[name], want), name
    publisher.close()


def test_load_into_a_module_in_process(run_dir, tiny_model, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    train_step(tiny_model, seed=4)
    publisher = SharedMemoryPublisher(run_dir)
    publisher.publish(0, tiny_model.named_parameters())
    fresh = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    load_into(fresh, SharedMemorySubscriber(run_dir).load(0))
    for (name, a), (_, b) in zip(tiny_model.named_parameters(), fresh.named_parameters()):
        assert torch.equal(a, b), name
    publisher.close()


def test_versions_are_immutable_and_errors_name_the_segment(run_dir):
    publisher = SharedMemoryPublisher(run_dir)
    published = publisher.publish(0, small_tensors())
    with pytest.raises(WeightsError, match="already exists.*immutable"):
        publisher.publish(0, small_tensors())
    with pytest.raises(WeightsError, match=r"version 5 not found: no shared-memory segment "
                                           r".*-v5 \(versions in shared memory: \[0\]\)"):
        SharedMemorySubscriber(run_dir).load(5)
    with pytest.raises(WeightsError, match="share memory"):
        t = torch.ones(3)
        publisher.publish(1, [("x", t), ("y", t)])
    with pytest.raises(WeightsError, match="no tensors"):
        publisher.publish(1, [])
    data = bytearray(published.path.read_bytes())
    data[:8] = b"garbage!"
    published.path.write_bytes(bytes(data))
    with pytest.raises(WeightsError, match=f"{published.path} is not a tandem weights segment"):
        SharedMemorySubscriber(run_dir).load(0)
    published.path.write_bytes(bytes(data[:100]))
    with pytest.raises(WeightsError, match=f"{published.path}"):
        SharedMemorySubscriber(run_dir).load(0)
    publisher.close()


def test_a_version_larger_than_the_free_room_is_refused_naming_it(run_dir):
    stat = os.statvfs(SHM_ROOT)
    free = stat.f_bavail * stat.f_frsize
    publisher = SharedMemoryPublisher(run_dir)
    # a meta tensor has a size and no storage: nothing is allocated to describe it
    huge = torch.empty(free // 2 + 2**20, dtype=torch.int16, device="meta")
    with pytest.raises(WeightsError, match=r"weights version 3 needs .* MiB in /dev/shm, which "
                                           r"has .* MiB free .*--shm-size.*keep_versions"):
        publisher.publish(3, [("huge", huge)])
    assert segments(run_dir) == []
    publisher.close()


def test_retention_keeps_the_newest_and_those_in_use(run_dir):
    in_use = {1}
    publisher = SharedMemoryPublisher(run_dir, keep=2, in_use=lambda: in_use)
    for version in range(5):
        publisher.publish(version, small_tensors())
    assert list_segments(run_dir) == [1, 3, 4]
    in_use.clear()
    assert publisher.prune() == [1]
    assert publisher.remove_after(3) == [4]
    publisher.close()
    assert segments(run_dir) == []


def test_a_new_publisher_removes_the_runs_old_segments(run_dir):
    SharedMemoryPublisher(run_dir).publish(3, small_tensors())
    (SHM_ROOT / f"tandem-{run_key(run_dir)}-tmp-v4-1-abcdef").write_bytes(b"half")
    publisher = SharedMemoryPublisher(run_dir)  # a restarted trainer: it owns the run now
    assert segments(run_dir) == []
    publisher.close()


def test_a_version_mapped_before_its_unlink_stays_readable(run_dir):
    publisher = SharedMemoryPublisher(run_dir, keep=1)
    publisher.publish(0, small_tensors())
    loading = SharedMemorySubscriber(run_dir).load(0)
    publisher.publish(1, small_tensors())  # retention unlinks v0 while it is mapped
    assert list_segments(run_dir) == [1]
    assert torch.equal(dict(loading)["a"], small_tensors()[0][1])
    publisher.close()


def test_a_killed_explorer_holds_nothing_once_its_version_is_unlinked(run_dir, spawn):
    publisher = SharedMemoryPublisher(run_dir, keep=1)
    v0 = publisher.publish(0, small_tensors()).path
    explorer = spawn("shm-hold", run_dir, 0)
    said(explorer, "holding")
    publisher.publish(1, small_tensors())  # nobody says v0 is in use: its name goes at once
    assert not v0.exists()
    assert mapped_by(v0) == [explorer.pid]  # the explorer's mapping keeps the pages
    explorer.send_signal(signal.SIGKILL)
    explorer.wait(BACKSTOP)
    assert mapped_by(v0) == []  # the kernel freed them with the explorer
    publisher.close()


def test_a_killed_trainer_leaves_no_segment(run_dir, spawn):
    trainer = spawn("shm-publish", run_dir, "1,2")
    tracker = said(trainer, "published")[0]
    said(trainer, "writing")  # v99 whole but not renamed yet
    names = [p.name for p in segments(run_dir)]
    assert len(names) == 3 and any("-tmp-v99-" in n for n in names), names
    trainer.send_signal(signal.SIGKILL)
    trainer.wait(BACKSTOP)
    # its resource tracker outlives it, sees the pipe close and unlinks what it registered
    deadline = time.monotonic() + BACKSTOP
    while _alive(int(tracker)):
        assert time.monotonic() < deadline, f"resource tracker {tracker} still running"
        time.sleep(0.05)
    assert segments(run_dir) == []


def said(peer, word: str) -> list[str]:
    """The rest of the peer's next line that starts with `word` (its log lines go between)."""
    for line in peer.stdout:
        if line.split()[:1] == [word]:
            return line.split()[1:]
    raise AssertionError(f"the peer ended without saying {word!r}: {peer.wait(BACKSTOP)}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split(")")[-1].split()[0] != "Z"


def test_explorer_loader_maps_the_segment_into_its_engine(run_dir, tiny_model, tiny_model_dir):
    from tandem.explorer.transformers_engine import TransformersEngine
    from tandem.explorer.weights import WeightLoader

    train_step(tiny_model, seed=5)
    publisher = SharedMemoryPublisher(run_dir)
    publisher.publish(2, tiny_model.named_parameters())
    engine = TransformersEngine.from_pretrained(str(tiny_model_dir))
    try:
        loader = WeightLoader(engine, run_dir=run_dir, explorer="explorer-0", timeout=BACKSTOP,
                              shared_memory=True)
        stats = asyncio.run(loader.load(2, "checkpoint"))
        assert engine.version == 2 and stats["tensors"] > 0
        for (name, a), (_, b) in zip(tiny_model.named_parameters(),
                                     engine.model.named_parameters()):
            assert torch.equal(a, b), name
        loader.timeout = 0.3
        with pytest.raises(WeightsError, match=r"version 3 has no shared-memory segment .* "
                                               r"after 0.3s .*raise sync.timeout"):
            asyncio.run(loader.load(3, "checkpoint"))
        assert engine.version == 2
    finally:
        engine.close()
        publisher.close()


def test_config_admits_shared_memory_with_checkpoint_and_a_tensor_engine(tiny_model_dir):
    from pydantic import ValidationError

    from tandem.common.config import RunConfig

    base = {"model": {"path": str(tiny_model_dir)},
            "weights": {"transport": "shared_memory"}}
    assert RunConfig.model_validate(
        {**base, "sync": {"preset": "fully_async"}}).weights.transport == "shared_memory"
    with pytest.raises(ValidationError, match="shared_memory moves the versions of sync.method: "
                                              "checkpoint; sync.method: nccl"):
        RunConfig.model_validate({**base, "sync": {"preset": "synchronous"}})
    with pytest.raises(ValidationError, match="weights.transport: shared_memory hands "
                                              r"explorers\[explorer-0\].engine.kind: vllm"):
        RunConfig.model_validate({**base, "sync": {"preset": "fully_async"},
                                  "explorers": [{"name": "explorer-0",
                                                 "engine": {"kind": "vllm"}}]})
