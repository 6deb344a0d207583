"""Kinds and families now live in the contract (bridge.contract.kinds); this
name stays for code not yet moved to it."""

from bridge.contract.kinds import (
    ATTENTION,
    FAMILIES,
    FAMILY_OF_KIND,
    LEGACY_KIND,
    MAX_GROUP_ID,
    OTHER,
    STATE,
    UNKNOWN_KIND,
    WINDOW,
    clean_kind,
    family_of,
    parse_group_kind,
)

__all__ = [
    "ATTENTION", "FAMILIES", "FAMILY_OF_KIND", "LEGACY_KIND", "MAX_GROUP_ID", "OTHER", "STATE", "UNKNOWN_KIND",
    "WINDOW", "clean_kind", "family_of", "parse_group_kind",
]
