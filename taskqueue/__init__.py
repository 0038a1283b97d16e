"""The task queue: leases on an object store, the claim loop, and the spawner that runs consumers.

The protocol is written down in docs/PROTOCOL.md; this package follows it. It never imports JAX.
"""
