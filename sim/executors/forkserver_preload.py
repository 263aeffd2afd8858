"""What the processes executor's forkserver imports once, so that no worker forked from it imports it again.

Importing torch and the client stack costs a fresh interpreter 2.5-4.5 s of CPU. The forkserver runs no computation,
so it starts no OpenMP threads that a fork could not carry.
"""

import sim.executors.processes  # noqa: F401 - imported for its imports (torch and the client stack)
