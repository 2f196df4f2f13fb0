"""The layer above the three services: the `specdecode` command (cli), the local
three-process stack (local) and the in-process engine (inprocess). Nothing below imports it."""
