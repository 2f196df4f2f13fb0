"""The repository's root, for tests that read its files or run its scripts."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
