"""The weight group's TCPStore listens on the configured host only, and a client that is not a
member (it never got the rendezvous from the master) can find no key of the group."""

from __future__ import annotations

import socket

import pytest

from tandem.weights import WeightBroadcaster, engine_members
from tandem.weights.group import connect_store, current_key


def test_the_store_listens_on_the_rendezvous_host_only():
    sender = WeightBroadcaster(host="127.0.0.1", timeout=10.0)
    try:
        with socket.create_connection(("127.0.0.1", sender.port), timeout=5):
            pass
        # another address of this host (all of 127/8 is loopback): refused, not served
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.2", sender.port), timeout=5).close()
    finally:
        sender.close()


def test_a_client_without_the_rendezvous_finds_no_key_of_the_group():
    sender = WeightBroadcaster(host="127.0.0.1", timeout=10.0)
    try:
        rendezvous = sender.open_group(engine_members("explorer-0"))
        stranger = connect_store("127.0.0.1", sender.port, 5.0)
        # nothing at a well-known key names the session, and the session cannot be guessed
        assert not stranger.check(["tandem/weights/current"])
        assert len(rendezvous.session) == 32 and int(rendezvous.session, 16) >= 0
        assert stranger.check([current_key(rendezvous.session)])  # a member's view
        assert stranger.get(current_key(rendezvous.session)) == b"1"
    finally:
        sender.close()
