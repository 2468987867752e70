"""Foundation: what every other layer stands on, with no I/O of its own.

Version identities (:mod:`~agentic_lora.foundation.identity`), the refused / indeterminate outcome
words (:mod:`~agentic_lora.foundation.outcomes`), phase types for progress reports
(:mod:`~agentic_lora.foundation.phases`), the replay rule for idempotent calls
(:mod:`~agentic_lora.foundation.replay`), request shaping and ids
(:mod:`~agentic_lora.foundation.requests`), listener fan-out, background-loop pacing, HTTP body
limits, shared-secret tokens and the entry-point plugin loader. The typed error tree is
:mod:`agentic_lora.errors`, one level up because every user imports it.

Nothing here imports from a higher layer (``scripts/layers.py`` checks it).
"""
