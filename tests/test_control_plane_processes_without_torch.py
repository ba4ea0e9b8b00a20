"""The master, the buffer and the reward service never load torch, transformers or their native
libraries, even in an environment that has them all (issue 27 item 1: keep torch and models out
of every process that does not need them; docs/design.md §1).

tests/test_control_plane_without_torch.py proves that the control plane installs and runs where
torch is absent. This is the other half: where it is installed, every plugin of every package is
registered (the master loads `tandem.plugins`) and the reward service has resolved its
functions, yet none of these processes maps a library of torch, tokenizers or safetensors. Each
is checked once it says it serves, in its own /proc/PID/maps and its children's (the reward
service's worker pool).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import psutil
import yaml
from component_process import ComponentProcess

BIN = Path(sys.executable).parent
FORBIDDEN = ("/torch/", "/tokenizers/", "/safetensors/", "/transformers/")


def mapped(pid: int) -> set[str]:
    """The files `pid` and its descendants have mapped."""
    files = set()
    procs = [psutil.Process(pid)]
    procs += procs[0].children(recursive=True)
    for proc in procs:
        for line in Path(f"/proc/{proc.pid}/maps").read_text().splitlines():
            parts = line.split(maxsplit=5)
            if len(parts) == 6:
                files.add(parts[5])
    return files


def test_master_buffer_and_reward_service_serve_without_mapping_torch(tmp_path, tiny_model_dir):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"id": f"t{i}", "prompt": f"{i}+1=", "answer": i + 1})
                             + "\n" for i in range(8)))
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({
        "run_dir": str(tmp_path / "run"), "model": {"path": str(tiny_model_dir)},
        "master": {"address": "tcp://127.0.0.1:0", "publish_address": "tcp://127.0.0.1:0",
                   "taskset": {"path": str(tasks), "id_field": "id"}, "total_steps": 4},
        "buffer": {"address": "tcp://127.0.0.1:0"},
        "reward": {"service": True, "address": "tcp://127.0.0.1:0",
                   "functions": {"math": 1.0, "k12": 1.0}},
        "explorers": [{"name": "explorer-0", "batch_size": 2, "repeat_times": 2}],
        "logging": {"json_console": True},
    }))
    argv = ["--config", str(config)]
    started: list[ComponentProcess] = []
    try:
        # one after the other: the first to come up records the run the others then join
        for name, event in (("master", "master.started"), ("buffer", "buffer.listening"),
                            ("reward", "reward.serving")):
            component = ComponentProcess(f"tandem-{name}", [str(BIN / f"tandem-{name}"), *argv])
            started.append(component)
            component.wait_for(event)
            loaded = sorted(f for f in mapped(component.proc.pid)
                            if any(part in f for part in FORBIDDEN))
            assert not loaded, f"{component.name} mapped {loaded[:5]}"
    finally:
        for component in started:
            assert component.stop(20) == 0, "".join(component.raw[-10:])
