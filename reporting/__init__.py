"""Status and reporting: what a queue and its fleet have done, cost and will cost.

It reads the queue's listings (`status`, `page`), the machines' records (`machinestate`, `fleetview`, `cost`) and the
done markers' shards (`jobindex`, the job index `merge` writes), prices them (`pricing`, `prices.json`), and plans a
run before it starts (`plan`, `considered`). It is neither the queue nor the cloud glue: it imports `objectstore`,
`taskqueue` (the layout and lease metadata it lists), `fleet.machines` (the record format), `activations` (the shard
format) and, for the planner and the goodput phases, `extract`; none of those imports it.

Importing it never imports JAX or the cloud clients, and status, the page, the costs and the job index never do. The
planner alone sizes a model from the shapes JAX builds (`nnx.eval_shape`, extract/memory.py), importing JAX inside
the call that plans (tests/status/test_no_jax.py).
"""
