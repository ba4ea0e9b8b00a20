"""tandem-common: the contracts every tandem component shares.

Wire messages (`tandem.common.messages`), the msgpack codec (`codec`), ZeroMQ transport
(`sockets`, `rpc`, `pubsub`, `heartbeat`, `auth`), the run config (`config`), logging and
tracing (`logging`, `trace`) and the sync plan (`sync`). Moving weights is `tandem.weights`
(the tandem-weights distribution, with torch); this package needs no torch, so the control plane
(master, buffer) installs without it. Import the submodule you need.
"""

__version__ = "0.1.0"
