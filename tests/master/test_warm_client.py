"""The client of `tandem warm` (tandem.master.warm_client) against a stand-in warm process that
answers before it has read the whole request: what the real one does when it refuses at once,
and what a loaded machine made of it in issue 31's loaded runs (the client's last, empty send
met the closed socket, and it reported "no warm process ... Broken pipe" instead of the
refusal)."""

from __future__ import annotations

import json
import os
import socket
import threading

from backstop import BACKSTOP
from tandem.master.warm_client import run_warm


def test_a_refusal_sent_before_the_whole_request_was_read_is_reported(tmp_path, monkeypatch,
                                                                       capsys):
    path = tmp_path / "warm.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(1)
    listener.settimeout(BACKSTOP)
    # far more than a Unix socket's buffer: the client is still sending when the answer comes
    monkeypatch.setenv("TANDEM_TEST_LARGE", "x" * (8 << 20))

    def refuse_early() -> None:
        conn, _ = listener.accept()
        with conn:
            data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
            for fd in fds:
                os.close(fd)
            assert data  # the start of the request, not the end of it
            conn.sendall((json.dumps({"refused": "a stand-in's refusal"}) + "\n").encode())

    server = threading.Thread(target=refuse_early)
    server.start()
    try:
        code = run_warm(str(path), ["tandem", "up", "--help"])
    finally:
        server.join(BACKSTOP)
        listener.close()
    assert code is None  # the caller starts cold
    err = capsys.readouterr().err
    assert f"tandem up: the warm process at {path} refused: a stand-in's refusal; starting " \
           "cold" in err, err
