"""The model name the HTTP API's shared SmolLM2 stack serves under (its fixture:
tests/integration/conftest.py, `smol_stack`)."""

SERVED = "smol"
