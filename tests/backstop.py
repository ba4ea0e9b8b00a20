"""The one wall-clock bound a test puts on a wait that should end: it only ends a hang.

A test's verdict is what the system did (an exit code, a line it logged, the journal, a trace
event), never how soon: beside three `make test` runs at once (a load of 13 on 2 cores) an
explorer's start, 15 s of CPU, took 158 s of wall-clock, and every bound shorter than the slowest
machine's start was a verdict on the machine. A wait that should end is bounded by `BACKSTOP`,
however quickly it ends on a quiet machine; a short bound stays only where the test expects it
to run out (the product's own timeout path under test). `tests/conftest.py` puts this folder on
sys.path: `from backstop import BACKSTOP`.
"""

from tandem.common.config import TransportConfig

BACKSTOP = 900.0  # seconds; pytest-timeout's per-test bound (pyproject.toml) is above it

# one attempt that waits as long as a hang allows: for calls a test expects to be answered
PATIENT = TransportConfig(rpc_timeout=BACKSTOP, rpc_retries=0)
