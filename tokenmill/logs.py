"""Log formatting: plain text or one JSON object per line. Structured fields travel in ``extra={"fields": {...}}``."""

from __future__ import annotations

import json
import logging
import time


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = getattr(record, "fields", None)
        return line + "".join(f" {k}={v}" for k, v in fields.items()) if fields else line


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {"time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)),
                 "level": record.levelname, "logger": record.name, "message": record.getMessage()}
        entry.update(getattr(record, "fields", None) or {})
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def configure_logging(json_lines: bool) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if json_lines else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True
    logging.getLogger("uvicorn.access").setLevel(logging.WARNING)  # our own request line replaces it


def one_line(text: str, max_lines: int = 4) -> str:
    """A message as one log line: its first ``max_lines`` non-empty lines joined (compiler and validation errors run
    to pages)."""
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    return " / ".join(lines[:max_lines]) + (" / ..." if len(lines) > max_lines else "")
