"""The simulated world the tests and benchmarks run the production queue in: test support, not a test.

- `scheduler`: virtual time. Actors (greenlets) take turns; `SimClock` (a machine's clock, which
  stands still while it is suspended), `SimExecutor` (a thread pool of actors), `SimLock`.
- `store`: `SimStore`, GCS's semantics and limits on virtual time, with faults; held to the same
  contract tests as the local and GCS stores (tests/store/test_contract.py).
- `seeds`: what a seed draws, and running one: a world of a few workers, submitters and status looks,
  checked against the protocol's invariants (driven by tests/sim/test_simulation.py and
  `python -m bench.sim_seeds`). Its parts: `world` (the store, machines, actors and the ground truth),
  `invariants` (one function each, as docs/PROTOCOL.md numbers them), `faults`, `worker`, `consumers`,
  `submitters` and `straddle`.
- `fleet`: a fleet of a thousand workers or more on a virtual clock, for the figures in
  docs/PROTOCOL-LOG.md (driven by `python -m bench.fleet_sim`).

Every knob a world varies is an argument of the production code (ClaimOptions, the submit's
executor, region size and keep time, the store's page limit); nothing is patched.
"""
