"""The cloud glue: the metadata server, preemption notices, self-deletion, the machine spec
schema, launching templates, groups and TPU VMs, code upload and the job index.

Imports `objectstore` only; never `taskqueue` or `extract`. spawn.py uses
`fleet.metadata.on_gcp`, `fleet.selfdelete.delete_self` and `fleet.preemption.PreemptionWatcher`.
"""
