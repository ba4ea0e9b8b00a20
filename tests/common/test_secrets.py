"""No secret is written to disk by tandem: `tandem up` keeps Curve secret keys out of the run
dir's config.yaml (0600 regardless) and hands them to its children through the environment."""

from __future__ import annotations

import stat

from tandem.common.auth import generate_keypair
from tandem.common.config import load_config
from tandem.master.up import Supervisor


def test_tandem_up_writes_no_secret_into_the_run_dir(tmp_path, monkeypatch):
    server_pub, server_sec = generate_keypair()
    client_pub, client_sec = generate_keypair()
    monkeypatch.setenv("MY_SERVER_SECRET", server_sec)
    monkeypatch.setenv("MY_CLIENT_SECRET", client_sec)
    source = tmp_path / "run.yaml"
    source.write_text(
        f"run_dir: {tmp_path / 'run'}\ntransport:\n  curve:\n"
        f"    server_public: '{server_pub}'\n    server_secret: '${{env:MY_SERVER_SECRET}}'\n"
        f"    client_public: '{client_pub}'\n    client_secret: '${{env:MY_CLIENT_SECRET}}'\n")
    sup = Supervisor(load_config(source), live=False)
    written = sup.prepare()
    text = written.read_text()
    assert server_sec not in text and client_sec not in text
    assert stat.S_IMODE(written.stat().st_mode) == 0o600
    for path in (tmp_path / "run").rglob("*"):
        if path.is_file():
            assert server_sec not in path.read_text(errors="replace")
    # every child gets the secrets in its environment and reads the same keys
    env = {k: v for k, v in sup.children[0].env.items() if k.startswith("TANDEM_CURVE")}
    assert env and all(env.items() <= child.env.items() for child in sup.children)
    monkeypatch.delenv("MY_SERVER_SECRET")
    monkeypatch.delenv("MY_CLIENT_SECRET")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    curve = load_config(written).transport.curve
    assert (curve.server_secret, curve.client_secret) == (server_sec, client_sec)
    assert (curve.server_public, curve.client_public) == (server_pub, client_pub)


def test_the_run_dir_is_made_private_by_the_first_component(tmp_path):
    # issue 32 item 7: the journal sat world-readable (0644) in a 0755 run dir
    import stat

    from tandem.common.runlock import RunDirLock

    made = tmp_path / "new" / "run"
    existing = tmp_path / "existing"
    existing.mkdir(mode=0o755)
    for run_dir in (made, existing):
        with RunDirLock(run_dir, "master") as lock:
            assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700
            assert stat.S_IMODE(lock.path.stat().st_mode) == 0o600
