"""The usage ledger: per API key x model x hour, what was asked and what it cost, kept in SQLite across restarts.

Each finished request (and each one refused) adds one row's worth to an in-memory batch; a writer thread folds the
batch into the database every ``FLUSH_S`` seconds in one transaction (WAL journal, so readers never block it). The
event loop never touches the database: a crash loses at most the last ``FLUSH_S`` of usage. ``engine_seconds`` is the
requests' share of their engine's steps (each step's wall time split among its requests by tokens computed) and
``cost_usd`` is that time at ``--hourly-cost`` dollars per machine-hour.

Rows: ``hour`` (unix seconds at the start of the UTC hour the request ended in), ``key`` (the key's name; "" when
the server has no keys), ``model``; counts: requests, prompt / cached / completion tokens, errors (refused, failed
or cut off before they finished), engine_seconds.
"""

from __future__ import annotations

import contextlib
import logging
import sqlite3
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

FLUSH_S = 1.0
COUNTS = ("requests", "prompt_tokens", "cached_tokens", "completion_tokens", "errors", "engine_seconds")
_SCHEMA = f"""CREATE TABLE IF NOT EXISTS usage (
    hour INTEGER NOT NULL, key TEXT NOT NULL, model TEXT NOT NULL,
    {", ".join(f"{c} {'REAL' if c == 'engine_seconds' else 'INTEGER'} NOT NULL DEFAULT 0" for c in COUNTS)},
    PRIMARY KEY (hour, key, model))"""
_UPSERT = (f"INSERT INTO usage (hour, key, model, {', '.join(COUNTS)}) VALUES (?, ?, ?, {', '.join('?' * len(COUNTS))}) "
           f"ON CONFLICT (hour, key, model) DO UPDATE SET {', '.join(f'{c} = {c} + excluded.{c}' for c in COUNTS)}")


@dataclass
class Usage:
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    errors: int = 0
    engine_seconds: float = 0.0

    def add(self, other: "Usage") -> None:
        for name in COUNTS:
            setattr(self, name, getattr(self, name) + getattr(other, name))


class UsageLedger:
    def __init__(self, path: str | Path, hourly_cost: float | None = None, clock=time.time):
        self.path, self.hourly_cost, self.clock = Path(path).expanduser(), hourly_cost, clock
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self._connect() as db, db:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute(_SCHEMA)
        self._pending: dict[tuple[int, str, str], Usage] = defaultdict(Usage)
        self._lock = threading.Lock()  # guards _pending
        self._flush_lock = threading.Lock()  # one flush at a time: a reader's flush waits for the writer's
        self._stopped = threading.Event()
        self._writer = threading.Thread(target=self._write_loop, name="tokenmill-ledger", daemon=True)
        self._writer.start()

    def _connect(self) -> contextlib.closing[sqlite3.Connection]:
        """A connection of its own (closed when the block ends): the writer thread, readers and close() each
        open one."""
        return contextlib.closing(sqlite3.connect(self.path, timeout=30))

    def record(self, key: str | None, model: str, usage: Usage) -> None:
        """Called on the event loop: a dictionary update, no I/O."""
        hour = int(self.clock()) // 3600 * 3600
        with self._lock:
            self._pending[(hour, key or "", model)].add(usage)

    def flush(self) -> None:
        """Write what was recorded so far (when this returns, it is in the database or kept for the next try)."""
        with self._flush_lock:
            with self._lock:
                batch, self._pending = self._pending, defaultdict(Usage)
            if batch:
                self._write(batch)

    def _write(self, batch: dict[tuple[int, str, str], Usage]) -> None:
        rows = [(*k, *(getattr(u, c) for c in COUNTS)) for k, u in batch.items()]
        try:
            with self._connect() as db, db:  # the inner ``db`` commits the transaction
                db.executemany(_UPSERT, rows)
        except sqlite3.Error as exc:  # the disk is full, say: keep the batch for the next try
            log.error("usage ledger: cannot write %s (%s); retrying", self.path, exc)
            with self._lock:
                for key, usage in batch.items():
                    self._pending[key].add(usage)

    def _write_loop(self) -> None:
        while not self._stopped.wait(FLUSH_S):
            self.flush()

    def close(self) -> None:
        self._stopped.set()
        self._writer.join(timeout=10)
        self.flush()

    def query(self, key: str | None = None, model: str | None = None, start: int | None = None,
              end: int | None = None) -> list[dict]:
        """Rows by hour, key and model (oldest first), with ``cost_usd`` where an hourly cost is set. ``start`` and
        ``end`` are unix seconds: the hours that overlap [start, end)."""
        where, args = [], []
        for column, value in (("key", key), ("model", model)):
            if value is not None:
                where.append(f"{column} = ?")
                args.append(value)
        if start is not None:
            where.append("hour + 3600 > ?")
            args.append(start)
        if end is not None:
            where.append("hour < ?")
            args.append(end)
        sql = (f"SELECT hour, key, model, {', '.join(COUNTS)} FROM usage"
               f"{' WHERE ' + ' AND '.join(where) if where else ''} ORDER BY hour, key, model")
        with self._connect() as db:
            rows = db.execute(sql, args).fetchall()
        return [self._row(row) for row in rows]

    def _row(self, row: tuple) -> dict:
        hour, key, model, *counts = row
        entry = {"hour": hour, "hour_utc": time.strftime("%Y-%m-%dT%H:00:00Z", time.gmtime(hour)), "key": key,
                 "model": model, **dict(zip(COUNTS, counts))}
        entry["cost_usd"] = self.cost(entry["engine_seconds"])
        return entry

    def cost(self, engine_seconds: float) -> float | None:
        return None if self.hourly_cost is None else engine_seconds / 3600 * self.hourly_cost
