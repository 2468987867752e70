"""Publication: getting a version onto every engine, and off them again.

* :mod:`~agentic_lora.publication.publisher`: two-phase publication (reserve, every engine
  ready, commit), capacity admitted before any transfer.
* :mod:`~agentic_lora.publication.rollback`: a version that was the default before made the
  default again, two-phase (a RETIRED one in place, a RECLAIMED one by a reload attempt).
* :mod:`~agentic_lora.publication.reclaimer`: unloads a retired version once no Session can ask
  for it and the engines' request refcounts have drained.
* :mod:`~agentic_lora.publication.repair`: re-loads what a restarted engine lost.
* :mod:`~agentic_lora.publication.resolver`: settles publications a dead publisher left open.
* :mod:`~agentic_lora.publication.result` and :mod:`~agentic_lora.publication.cleanup`: a
  publication's outcome and the undo of a failed one.
* :mod:`~agentic_lora.publication.steps`: the registry step all of them take (one request id,
  replayed while the reply may be lost, timed as the phase named after the verb).
"""
