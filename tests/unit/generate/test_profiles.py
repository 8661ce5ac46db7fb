"""The model profiles: one list of names, the registry's."""

from __future__ import annotations

from typing import get_args

import pytest
from pydantic import ValidationError

from eagle3q.config import Settings
from eagle3q.contract import ProfileName
from eagle3q.generate.profiles import PROFILES


def test_the_profile_type_is_the_registry() -> None:
    """`ProfileName` (tasks, settings) names exactly the profiles defined: a profile added to one and not the other
    would be refused by the settings or unknown to the workers."""
    assert set(get_args(ProfileName)) == set(PROFILES) and len(PROFILES) == 3
    assert {Settings(profile=name).profile for name in PROFILES} == set(PROFILES)
    with pytest.raises(ValidationError):
        Settings(profile="kimi")
