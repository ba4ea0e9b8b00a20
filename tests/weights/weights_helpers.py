"""Helpers of the weight-sync tests: a real training step, bit-exact comparison, peer processes."""

from __future__ import annotations

import subprocess
from pathlib import Path

from backstop import BACKSTOP

PEER = Path(__file__).with_name("weights_peer.py")


def train_step(model, seed: int) -> None:
    """One real optimiser step on a language-modelling loss, so every weight moves."""
    import torch

    torch.manual_seed(seed)
    ids = torch.randint(4, model.config.vocab_size, (2, 16))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    torch.optim.Adam(model.parameters(), lr=1e-2).step()
    model.zero_grad(set_to_none=True)


def assert_bit_identical(model_or_tensors, received: Path) -> None:
    """Every tensor sent (a module's parameters, or (name, tensor) pairs) equals, bit for bit,
    the one the receiver dumped."""
    import torch
    from safetensors.torch import load_file

    got = load_file(str(received))
    if hasattr(model_or_tensors, "named_parameters"):
        model_or_tensors = model_or_tensors.named_parameters()
    want = {n: p.detach() for n, p in model_or_tensors}
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype, name
        assert torch.equal(got[name].view(torch.uint8), tensor.contiguous().view(torch.uint8)), name


def finish(proc: subprocess.Popen, timeout: float = BACKSTOP) -> str:
    """Wait for a peer; return its stderr, failing the test with it if the peer failed."""
    _, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"peer exited {proc.returncode}:\n{err[-3000:]}"
    return err
