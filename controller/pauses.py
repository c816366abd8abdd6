"""A paused controller (SIGSTOP, a debugger breakpoint, a suspended laptop, a stalled node) survives pauses up to
`PAUSE_TOLERANCE`, instead of Monarch's defaults of 30 s and 1 min (issue 31, item 11).

While the controller is stopped it acknowledges no message. An actor process whose reply (or heartbeat answer) to
it stays unacknowledged for Monarch's `message_delivery_timeout` (30 s by default) closes the link for good: on
waking, the controller's re-asked heartbeats are never answered and a healthy process is declared frozen (measured:
a 60 s SIGSTOP ended the run 'reward 0 ... stopped answering: no heartbeat for 3s'; the same with the timeout at
5 min finished). Monarch's `mesh_orphan_timeout` (1 min) is how long a process mesh waits for its controller's
keepalive before its host stops it as orphaned: raised the same way, so that the pause is not taken for a death.

Costs: a message to a process that really is gone is returned after the longer timeout; meshrl does not rely on
that (deaths are seen by Monarch's supervision, the process table and heartbeats, controller/replicas.py), and
processes of a controller that died still go with it on this host (Monarch's parent-death signal). A value the user
sets in the environment (HYPERACTOR_MESSAGE_DELIVERY_TIMEOUT, HYPERACTOR_MESH_ORPHAN_TIMEOUT) is kept.
"""

from __future__ import annotations

import os

PAUSE_TOLERANCE = "5m"
"""The longest pause of the controller that a run survives (humantime)."""

_SETTINGS = {"message_delivery_timeout": "HYPERACTOR_MESSAGE_DELIVERY_TIMEOUT",
             "mesh_orphan_timeout": "HYPERACTOR_MESH_ORPHAN_TIMEOUT"}  # fmt: skip


def tolerate_pauses() -> dict[str, str]:
    """Before any process mesh starts: the actor processes read these from the environment they inherit, this
    process through `monarch.configure`. Returns the values in force."""
    import monarch.config

    values = {}
    for key, env in _SETTINGS.items():
        values[key] = os.environ.setdefault(env, PAUSE_TOLERANCE)
    monarch.config.configure(**values)
    return values
