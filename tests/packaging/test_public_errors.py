"""The typed errors a user meets are importable from ``elastic`` itself, as the design promises
("user code imports from ``elastic`` only"), and the documents name no other."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import elastic

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]
OTHER_LIBRARIES = {"DefaultCredentialsError", "NoCredentialsError"}  # google-auth's, botocore's


def test_every_error_the_readme_and_the_troubleshooting_guide_name_is_importable_from_elastic():
    text = "".join((ROOT / name).read_text() for name in ("README.md", "docs/troubleshooting.md"))
    named = set(re.findall(r"\b([A-Z][A-Za-z]+(?:Error|Interrupt))\b", text)) - OTHER_LIBRARIES
    assert named and sorted(n for n in named if not hasattr(elastic, n)) == []
    assert issubclass(elastic.CheckpointCorruptError, elastic.CheckpointError)
