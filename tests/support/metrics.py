"""Reading a server's Prometheus /metrics endpoint."""

from __future__ import annotations

import re
import urllib.request

MODEL_NAME_LABEL = re.compile(r'model_name="[^"]*"')


def scrape_metrics(port: int) -> dict[str, float]:
    """`name{labels}` -> value of the specdecode_* samples at a /metrics endpoint. Every
    sample must carry a model_name label; the keys leave it out."""
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for m in re.finditer(r"^(specdecode_\S+) (\S+)$", body, re.M):
        assert 'model_name="' in m.group(1), m.group(1)
        key = MODEL_NAME_LABEL.sub("", m.group(1))
        key = key.replace("{,", "{").replace(",}", "}").replace(",,", ",").replace("{}", "")
        out[key] = float(m.group(2))
    return out
