"""Weight-sync protocol: how a broadcast group is joined and what precedes its tensors.

These travel as values of the group's own store (`tandem.weights.store`, the control channel of
the broadcast); the master only relays `GroupRendezvous` inside `WeightsPublished.rendezvous`.
They are encoded with msgpack like every other message, so any msgpack reader can inspect them.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from .base import Array, Message, Request, wire


class TensorSpec(BaseModel):
    """One named tensor: its dtype (torch name without `torch.`) and shape."""

    model_config = ConfigDict(extra="forbid")
    name: str
    dtype: str
    shape: list[int]


class BucketSpec(BaseModel):
    """One collective: tensors `first .. first+count-1` (in `BroadcastMeta.tensors` order),
    flattened into one 1-d tensor of `dtype` with `numel` elements."""

    model_config = ConfigDict(extra="forbid")
    dtype: str
    numel: int = Field(ge=0)
    first: int = Field(ge=0)
    count: int = Field(ge=1)


@wire("weights.group")
class GroupRendezvous(Message):
    """Trainer to master (relayed to explorers in `WeightsPublished.rendezvous`): the group to join.

    Rank 0 is the trainer; `members[i]` joins as rank i+1. A new `epoch` replaces every earlier
    group at the same store, so a worker that restarts or arrives late joins the newest one; a
    member is in the announced group exactly when its rendezvous equals the announced one.
    """

    host: str
    port: int = Field(ge=1, le=65535)
    session: str = Field(description="random id of the trainer process hosting the store, so an "
                                     "epoch number of a restarted trainer is never mistaken")
    store_key: str = Field(min_length=40, max_length=40,
                           description="the store's Curve public key (Z85), fresh per trainer")
    member_secret: str = Field(min_length=40, max_length=40, repr=False,
                               description="the Curve secret key members sign in to the store "
                                           "with (Z85): the group's only credential, never "
                                           "logged or journaled")
    epoch: int = Field(ge=1)
    members: list[str] = Field(min_length=1)

    @property
    def world_size(self) -> int:
        return len(self.members) + 1


@wire("weights.group.member")
class GroupMember(Message):
    """Explorer worker to trainer, through the store key `<epoch>/join/<rank>`: I am here."""

    name: str
    rank: int = Field(ge=1)
    device: Literal["cpu", "cuda"]
    host: str
    pid: int


@wire("weights.group.backend")
class GroupBackend(Message):
    """Trainer to every member, through the store key `<epoch>/backend`: all joined; build this."""

    backend: Literal["gloo", "nccl"]


@wire("weights.broadcast.meta")
class BroadcastMeta(Message):
    """Trainer to every member, through the store key `<epoch>/meta/<seq>`: the next transfer.

    Sent before any tensor: version, every tensor's name/dtype/shape, and the bucket layout,
    so a receiver allocates each bucket once and hands out views of it without a copy.
    """

    version: int = Field(ge=0)
    seq: int = Field(ge=0, description="transfer number within this epoch, from 0")
    tensors: list[TensorSpec]
    buckets: list[BucketSpec]


# -- weights.transport: fetch --------------------------------------------------------------------
# Over the trainer's weight server (a ZeroMQ ROUTER at `weights.fetch_address`), for explorers
# that share no filesystem with the trainer. Shards travel as raw frames, one chunk per reply.


@wire("weights.fetch.manifest.reply")
class FetchManifestReply(Message):
    """Trainer's weight server to an explorer: the version's `manifest.json`, byte for byte."""

    version: int = Field(ge=0)
    manifest: str


@wire("weights.fetch.manifest", reply=FetchManifestReply)
class FetchManifest(Request):
    """Explorer to the trainer's weight server: the manifest of `version` (code `not_found`
    when that version is not, or no longer, on the trainer)."""

    version: int = Field(ge=0)


@wire("weights.fetch.chunk.reply")
class FetchChunkReply(Message):
    """Trainer's weight server to an explorer: `length` bytes of a shard from `offset` on."""

    data: Array("uint8", 1)


@wire("weights.fetch.chunk", reply=FetchChunkReply)
class FetchChunk(Request):
    """Explorer to the trainer's weight server: bytes [offset, offset+length) of one shard file
    of `version` (a file the manifest names); answered `busy` with `retry_after` while the
    server already serves `weights.fetch_streams` other explorers."""

    version: int = Field(ge=0)
    file: str
    offset: int = Field(ge=0)
    length: int = Field(ge=1)
    last: bool = Field(default=False, description="the version's final chunk: the explorer's "
                                                  "place among the served ones is freed")
