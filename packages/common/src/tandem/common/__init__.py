"""tandem-common: the contracts every tandem component shares.

Wire messages (`tandem.common.messages`), the msgpack codec (`codec`), ZeroMQ transport
(`sockets`, `rpc`, `pubsub`, `heartbeat`, `auth`), the run config (`config`), logging and
tracing (`logging`, `trace`), the sync plan (`sync`) and weight sync (`weights`).
Import the submodule you need; this package imports nothing heavy on its own.
"""

__version__ = "0.1.0"
