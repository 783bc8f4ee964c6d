"""What `prx-corpus build` prints of a run's Dagster log: progress yes, tracebacks only with --verbose.

Dagster's console logger prints every failed step with its stack trace, then the run's failure
with the same trace again, then one "Dependencies ... Not executing." line per downstream step;
a wrong uri made 206 lines of it. The build prints each failure's cause in one line itself
(`prx_cli.build`), so its runs use this logger: Dagster's own console logger with a filter
that drops those failure events and keeps any other error to its first line. The runs' Dagster
logs (the instance, the UI) keep everything; `--verbose` prints it all here too.
"""

from __future__ import annotations

import logging
from typing import Any

import dagster as dg

LOGGER = "console"
FAILURE_EVENTS = {"STEP_FAILURE", "RUN_FAILURE", "PIPELINE_FAILURE", "RUN_CANCELED", "PIPELINE_CANCELED"}


class QuietFailures(logging.Filter):
    """Drops the failure events and the dependency lines the build's summary replaces; cuts any
    other error record to its first line."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR:
            return True
        meta: dict[str, Any] = getattr(record, "dagster_meta", None) or {}
        event = meta.get("dagster_event")
        original = str(meta.get("orig_message") or "")
        if (event is not None and event.event_type_value in FAILURE_EVENTS) or original.endswith("Not executing."):
            return False
        message = record.getMessage()
        if "\n" in message:
            record.msg, record.args = message.split("\n", 1)[0] + " (more: --verbose)", None
        return True


class LiveHandler(logging.Handler):
    """Progress lines to the terminal's status line (`prx_cli.build_progress`); every other record
    through Dagster's own handler, above it."""

    def __init__(self, inner: logging.Handler) -> None:
        super().__init__(inner.level)
        self.inner = inner

    def handle(self, record: logging.LogRecord) -> bool:
        from prx_cli.build_progress import STATUS, parse_progress

        meta: dict[str, Any] = getattr(record, "dagster_meta", None) or {}
        progress = parse_progress(str(meta.get("orig_message") or record.getMessage()))
        if progress is not None and record.levelno == logging.INFO:
            STATUS.update(progress)
            return True
        with STATUS.lock:
            STATUS.clear()
            handled = self.inner.handle(record)
            STATUS.redraw()
        return bool(handled)


@dg.logger(config_schema={"log_level": dg.Field(str, is_required=False, default_value="INFO"),
                          "verbose": dg.Field(bool, is_required=False, default_value=False),
                          "live": dg.Field(bool, is_required=False, default_value=False)},
           description="Dagster's console logger; without verbose, failures are left to the build's summary; "
                       "live (a terminal): progress as one status line with a bar.")
def build_console(init_context: dg.InitLoggerContext) -> logging.Logger:
    config = init_context.logger_config
    logger = dg.colored_console_logger.logger_fn(
        dg.build_init_logger_context(logger_config={"log_level": config["log_level"], "name": "dagster"}))
    if not config["verbose"]:
        for handler in logger.handlers:
            handler.addFilter(QuietFailures())
    if config["live"]:
        logger.handlers = [LiveHandler(handler) for handler in logger.handlers]
    return logger


def logger_config(verbose: bool) -> dict[str, Any]:
    """The run config section selecting this logger (live progress in a terminal, unless verbose)."""
    from prx_cli.build_progress import live

    return {"loggers": {LOGGER: {"config": {"log_level": "INFO", "verbose": verbose, "live": not verbose and live()}}}}
