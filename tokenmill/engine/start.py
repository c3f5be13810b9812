"""A start that fails says so in one line: which stage failed, the cause, and the setting that avoids it.

The engine's start (engine/core.py, engine/build.py) runs as named stages. An error that already speaks to the
operator (a ConfigError naming the setting, a ModelLoadError naming the file and the fix) passes through as it is;
any other becomes a ``StartError`` whose message is that one line, with the full traceback in the engine's log.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Iterator

from tokenmill.config import ConfigError
from tokenmill.logs import one_line
from tokenmill.models.paths import ModelLoadError

log = logging.getLogger(__name__)

# What skips each of engine/settle.py's timed choices.
MEASUREMENTS_AVOIDED = ("--dtype, --num-threads, --cpu-weight-layout, --attention-prefetch and --prefill-attention set "
                        "explicitly skip the measurements")


class StartError(RuntimeError):
    """The engine could not start; the message is one line: the stage, the cause, what avoids it."""


def describe(exc: BaseException) -> str:
    """One line: an error that speaks to the operator as it is, any other as ``Type: message``."""
    text = one_line(str(exc))
    if isinstance(exc, (ConfigError, ModelLoadError, StartError)):
        return text
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


@contextmanager
def start_stage(stage: str, avoid: str | None = None) -> Iterator[None]:
    """Run one stage of the start; ``avoid``: the setting that skips or changes what this stage does."""
    try:
        yield
    except (ConfigError, ModelLoadError, StartError):
        raise
    except Exception as exc:  # noqa: BLE001 - said in one line; the traceback goes to the log
        log.error("%s failed", stage, exc_info=exc)
        raise StartError(f"{stage} failed ({describe(exc)})" + (f"; {avoid}" if avoid else "")) from None
