"""What the processes executor's forkserver imports once, so that no worker forked from it imports it again.

Importing torch costs a fresh interpreter 2.5-4.5 s of CPU, and the first optimizer another 1.5-2.5 s: its
``add_param_group`` imports ``torch._dynamo`` (and with it sympy) on first call. The forkserver runs no
computation, so it starts no OpenMP threads that a fork could not carry.
"""

import sim.executors.processes  # noqa: F401 - imported for its imports (torch and the client stack)
from sim.executors.host import warm_up

warm_up()
