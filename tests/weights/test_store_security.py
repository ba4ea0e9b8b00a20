"""The weight group's store listens on the configured host only, and answers nobody who lacks the
member secret key of the rendezvous: not torch's own TCPStore client (the finding's tool: it
listed 114 keys of the old TCPStore), not a raw socket, not a Curve client with a key of its
own. Such a stranger learns no key and cannot join or disturb the group: the real member, a
separate process, still receives the weights bit for bit afterwards."""

from __future__ import annotations

import datetime
import json
import socket

import pytest
import torch
import torch.distributed as dist
import zmq
from backstop import BACKSTOP

from tandem.weights import WeightBroadcaster, engine_member, engine_members
from tandem.weights.group import current_key
from tandem.weights.store import StoreClient, StoreUnreachable

from weights_helpers import assert_bit_identical, finish


def test_the_store_listens_on_the_rendezvous_host_only():
    sender = WeightBroadcaster(host="127.0.0.1", timeout=BACKSTOP)
    try:
        with socket.create_connection(("127.0.0.1", sender.port), timeout=BACKSTOP):
            pass
        # another address of this host (all of 127/8 is loopback): refused, not served
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.2", sender.port), timeout=BACKSTOP).close()
    finally:
        sender.close()


def _raw_bytes_from(port: int, send: bytes) -> bytes:
    """Everything the store sends a raw TCP client that sends `send`, until it stops talking."""
    got = b""
    with socket.create_connection(("127.0.0.1", port), timeout=BACKSTOP) as raw:
        raw.sendall(send)
        raw.settimeout(1.0)
        try:
            while chunk := raw.recv(65536):
                got += chunk
        except (TimeoutError, ConnectionResetError):
            pass
    return got


def test_a_keyless_client_learns_nothing_and_cannot_join_or_disturb_the_group(tmp_path, spawn):
    sender = WeightBroadcaster(host="127.0.0.1", timeout=BACKSTOP)
    try:
        rendezvous = sender.open_group(engine_members("explorer-0"))
        before = sender.store.num_keys()
        secrets = [rendezvous.member_secret.encode(), rendezvous.session.encode(), b"tandem/"]

        # torch's TCPStore client, which listed every key of the old store: no answer at all
        with pytest.raises(dist.DistError):
            probe = dist.TCPStore("127.0.0.1", rendezvous.port, None, False,
                                  datetime.timedelta(seconds=2), wait_for_workers=False)
            probe.num_keys()
        # a raw client: the ZeroMQ greeting, which names the mechanism and nothing else
        for junk in (b"", b"\x00" * 64, b"\xff" + b"\x00" * 8 + b"\x7f\x03\x00" + b"\x00" * 52):
            heard = _raw_bytes_from(rendezvous.port, junk)
            assert len(heard) <= 64 and not any(s in heard for s in secrets), heard
        # a Curve client that knows the store's public key but holds a key of its own: the
        # handshake fails, so it can neither read nor write, nor sign in as a member
        _, own_secret = zmq.curve_keypair()
        stranger = StoreClient("127.0.0.1", rendezvous.port, rendezvous.store_key,
                               own_secret.decode(), timeout=2.0)
        try:
            for attempt in (lambda: stranger.check([current_key(rendezvous.session)]),
                            lambda: stranger.set(f"{current_key(rendezvous.session)}", b"9"),
                            lambda: stranger.set("tandem/weights/x/1/join/1", b"junk")):
                with pytest.raises(StoreUnreachable, match="no answer"):
                    attempt()
        finally:
            stranger.close()
        assert sender.store.num_keys() == before  # nothing written
        assert sender.joined() == []  # nobody signed in

        # the real member, a separate process, joins and receives as if nothing happened
        peer = spawn("broadcast", json.dumps(rendezvous.model_dump()),
                     engine_member("explorer-0"), tmp_path, "1", BACKSTOP)
        tensors = [("w", torch.arange(12, dtype=torch.float32).view(3, 4))]
        sender.broadcast(1, tensors)
        finish(peer)
        assert_bit_identical(tensors, tmp_path / "v1.safetensors")
    finally:
        sender.close()


def test_the_rendezvous_hides_its_secret_from_logs():
    sender = WeightBroadcaster(host="127.0.0.1", timeout=BACKSTOP)
    try:
        rendezvous = sender.open_group(engine_members("explorer-0"))
        assert rendezvous.member_secret not in repr(rendezvous)
        assert rendezvous.member_secret not in str(rendezvous)
    finally:
        sender.close()


def test_a_client_left_to_the_garbage_collector_is_collected_without_a_hang():
    """torch may drop the last reference to a store client in any order. A client with a zmq
    context of its own, collected in one cycle with its socket, left the socket out of the
    context's weak set and waited in the context's term() forever: a whole test process hung
    at its next collection. Collected here on a thread, bounded."""
    import gc
    import threading

    from tandem.weights.store import StoreServer

    server = StoreServer("127.0.0.1")
    try:
        client = StoreClient("127.0.0.1", server.port, server.store_key, server.member_secret,
                             timeout=BACKSTOP)
        client.set("k", b"v")
        assert client.get("k") == b"v"
        client.cycle = client  # only the collector frees it, as a torch-held store is
        del client
        collecting = threading.Thread(target=gc.collect, daemon=True)
        collecting.start()
        collecting.join(BACKSTOP)
        assert not collecting.is_alive(), "a store client's collection hung"
    finally:
        server.close()


def test_a_request_whose_pipe_goes_between_the_poll_and_the_send_is_sent_on_the_next():
    """ZeroMQ's I/O thread may tear down the pipe a poll just reported writable (a refused
    handshake, a dropped connection) before the send: the send then raises `Again`. CI saw it
    escape a stranger's `check` as `zmq.error.Again`. It means "not writable yet": the
    client waits again, within the call's deadline. Injected here at the one send it hits."""
    from tandem.weights.store import StoreServer

    class PipeGoneOnce:
        def __init__(self, socket):
            self._socket, self.refused = socket, 0

        def send_multipart(self, frames, flags=0):
            if not self.refused:
                self.refused += 1
                raise zmq.Again()
            return self._socket.send_multipart(frames, flags)

        def __getattr__(self, name):
            return getattr(self._socket, name)

    server = StoreServer("127.0.0.1")
    try:
        client = StoreClient("127.0.0.1", server.port, server.store_key, server.member_secret,
                             timeout=BACKSTOP)
        try:
            client._socket = flaky = PipeGoneOnce(client._socket)
            client.set("k", b"v")
            assert flaky.refused == 1
            assert client.get("k") == b"v"
        finally:
            client.close()
    finally:
        server.close()
