"""Status and reporting: what a queue and its fleet have done, cost and will cost.

It reads the queue's listings (`status`, `page`) and the machines' records (`machinestate`, `fleetview`, `cost`),
prices them (`pricing`, `prices.json`). It is neither the queue nor the cloud glue: it imports `objectstore`,
`taskqueue` (the layout and lease metadata it lists) and `fleet.machines` (the record format), and neither of those
imports it. It never imports JAX or the cloud clients.
"""
