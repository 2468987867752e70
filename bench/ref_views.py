"""What one read of a receipt's ref view costs (``binding.lora_name`` and the like).

A Session reads these views about five times per dispatch (four on its ``Binding``, one on the
registry's ``VersionRecord``). Prints nanoseconds per read, the best of ``--repeat`` rounds of
``--reads`` reads, for the shipped views and for the ``def`` property they replaced, interleaved
in one run so both see the same machine load.

Usage: python bench/ref_views.py [--reads N] [--repeat N] [--rounds N]
"""

from __future__ import annotations

import argparse
import timeit
from dataclasses import dataclass

from agentic_lora.foundation.identity import VersionRef
from agentic_lora.registry.types import Binding

REF = VersionRef("v1", "ab" * 32, "policy@0-v1-abababababababab", 1)


class _DefProperty:
    """The former form of one view: a ``def`` property read through a Python frame."""

    __slots__ = ()
    ref: VersionRef

    @property
    def lora_name(self) -> str:
        return self.ref.lora_name


@dataclass(frozen=True, slots=True)
class _DefBinding(_DefProperty):
    ref: VersionRef


def ns_per_read(value: object, reads: int, repeat: int) -> float:
    timer = timeit.Timer("value.lora_name", globals={"value": value})
    return min(timer.repeat(repeat=repeat, number=reads)) / reads * 1e9


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--reads", type=int, default=1_000_000)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    shipped = Binding("s", REF, 1)
    former = _DefBinding(REF)
    assert shipped.lora_name == former.lora_name
    print(f"{'round':>5}  {'shipped view ns':>15}  {'def property ns':>15}  {'ratio':>5}")
    for n in range(args.rounds):
        now = ns_per_read(shipped, args.reads, args.repeat)
        before = ns_per_read(former, args.reads, args.repeat)
        print(f"{n:>5}  {now:>15.1f}  {before:>15.1f}  {now / before:>5.2f}")


if __name__ == "__main__":
    main()
