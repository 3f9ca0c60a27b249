"""Fixtures for the GCS test infrastructure's self-tests (see gcs_fixtures.py)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gcs_fixtures import *  # noqa: E402,F401,F403
