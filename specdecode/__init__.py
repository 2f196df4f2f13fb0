"""specdecode shared library. The core types sit at the top (data model, interfaces,
sampling, errors, model info, forward costs); the rest is in rooms, each named for the
question it answers: executor/, models/, serving/, wire/, telemetry/ (and api/, grammar/,
the generated v1/). docs/design.md, *Where each concern lives*."""
