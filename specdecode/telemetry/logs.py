"""Structured logs: one line per event (JSON or text) carrying the current trace and span ids."""

from __future__ import annotations

import datetime
import json
import logging
import math
import os
import sys

from opentelemetry import trace

# -- logs ----------------------------------------------------------------------------------

class TraceContextFilter(logging.Filter):
    """Adds trace_id and span_id (hex, "" outside a span) to every record. Put it on the
    handler: it runs in the thread that logs, where the current span is the right one."""

    def filter(self, record: logging.LogRecord) -> bool:
        sc = trace.get_current_span().get_span_context()
        if sc.is_valid:
            record.trace_id = format(sc.trace_id, "032x")
            record.span_id = format(sc.span_id, "016x")
        else:
            record.trace_id = record.span_id = ""
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time (UTC, ISO 8601), level, logger, message, service,
    trace_id and span_id (when inside a span), exception (the formatted traceback), and
    the entries of a `fields` dict passed as `extra={"fields": {...}}`."""

    def __init__(self, service: str = ""):
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        out = {"time": datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc)
               .isoformat(timespec="milliseconds").replace("+00:00", "Z"),
               "level": record.levelname, "logger": record.name, "message": record.getMessage()}
        if self.service:
            out["service"] = self.service
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            out.update({k: v for k, v in fields.items() if k not in out})
        if getattr(record, "trace_id", ""):
            out["trace_id"], out["span_id"] = record.trace_id, record.span_id
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            out["exception"] = record.exc_text
        for key, value in out.items():  # strict JSON: no NaN/Infinity literals
            if isinstance(value, float) and not math.isfinite(value):
                out[key] = str(value)
        return json.dumps(out, default=str)


class TextFormatter(logging.Formatter):
    """The plain format, with trace_id=... span_id=... appended inside a span."""

    def __init__(self):
        super().__init__("%(asctime)s %(levelname)s %(name)s %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        if getattr(record, "trace_id", ""):
            line += f" trace_id={record.trace_id} span_id={record.span_id}"
        return line


def progress_bars_off() -> None:
    """No progress bars from huggingface_hub and transformers: the environment switch both
    read when imported, and the switch of those already imported."""
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    if "huggingface_hub" in sys.modules:
        from huggingface_hub.utils import disable_progress_bars
        disable_progress_bars()
    if "transformers" in sys.modules:
        from transformers.utils import logging as transformers_logging
        transformers_logging.disable_progress_bar()


def configure_logging(service: str, fmt: str = "json", level: int = logging.INFO) -> None:
    """Replace the root logger's handlers with one stderr handler in `fmt` (json | text).

    Progress bars (model conversion and loading, drawn by transformers and huggingface_hub
    on stderr) are turned off in JSON mode, where they would break the stream of JSON lines,
    and above INFO (a quiet console); in text mode at INFO they stay on stderr."""
    if fmt not in ("json", "text"):
        raise ValueError(f"log format: must be json or text, got {fmt!r}")
    if fmt == "json" or level > logging.INFO:
        progress_bars_off()
    handler = logging.StreamHandler()
    handler.addFilter(TraceContextFilter())
    handler.setFormatter(JsonFormatter(service) if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
