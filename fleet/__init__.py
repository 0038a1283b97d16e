"""The cloud glue: the metadata server, preemption notices, self-deletion and the boot's permission
check, machine records, the machine spec schema, launching templates, groups and TPU VMs with their
pre-flight, the TPU keeper, and code upload with its locked environment.

Imports `objectstore` only; never `taskqueue` or `extract`. spawn.py uses
`fleet.metadata.on_gcp`, `fleet.selfdelete.delete_self`, `fleet.preemption.PreemptionWatcher`
and `fleet.machines.MachineRecorder`.
"""
