"""Helpers the tests share (fixtures live in conftest.py files): the tiny models and engines,
reference decoding, the chi-square check, /metrics scraping, service processes, certificates."""
