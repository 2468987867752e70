"""The receiver's identity checks, on the project's one manifest definition.

``begin`` carries the adapter config and the plan; the plan's tensor entries are exactly the
manifest entries of :mod:`agentic_lora.foundation.identity`, so the receiver can recompute the content digest
before any byte moves and refuse a plan that does not describe the version it claims to be.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from agentic_lora.errors import InvalidIdentityError
from agentic_lora.foundation.identity import Manifest
from agentic_lora.foundation.identity import parse_lora_name
from agentic_lora_dcs.plan import BucketPlan

__all__ = ["manifest_digest", "manifest_of", "name_matches"]


def manifest_of(config: Mapping[str, Any], plan: BucketPlan) -> Manifest:
    """The manifest ``config`` plus the plan's entries describe."""
    return Manifest(config, plan.manifest_entries())


def manifest_digest(config: Mapping[str, Any], plan: BucketPlan) -> str:
    """The content digest ``config`` plus the plan's entries hash to."""
    return manifest_of(config, plan).digest


def name_matches(lora_name: str, version_id: str, digest: str) -> bool:
    """Whether ``lora_name`` is a versioned name for ``version_id`` and ``digest``."""
    try:
        parsed = parse_lora_name(lora_name)
    except InvalidIdentityError:
        return False
    return parsed.version_id == version_id and parsed.names_digest(digest)
