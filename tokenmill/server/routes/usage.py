"""GET /v1/usage: the usage ledger (server/ledger.py) per key x model x hour, as JSON or CSV.

Filters: ``key``, ``model``, ``start`` / ``end`` (unix seconds or ISO 8601; the hours that overlap [start, end)),
``format`` (json or csv). A key with ``admin = true`` reads every key's usage; any other key reads its own (asking
for another key's is a 403); a server without keys shows everything, as it serves everyone.
"""

from __future__ import annotations

import asyncio
import csv
import io
from datetime import datetime, timezone

from fastapi import APIRouter, Depends, Query
from fastapi.responses import Response

from tokenmill.server.deps import ServerState, api_key, serving_state
from tokenmill.server.errors import APIError
from tokenmill.server.ledger import COUNTS
from tokenmill.server.openapi import error_responses

router = APIRouter(prefix="/v1")
COLUMNS = ("hour", "hour_utc", "key", "model", *COUNTS, "cost_usd")
LATEST = 253402300799  # 9999-12-31T23:59:59Z: the last second ISO 8601 (and the ledger's hour column) can name


def _time(value: str | None, param: str) -> int | None:
    """Unix seconds (an integer or a float) or an ISO 8601 time, within [0, LATEST]; a 400 naming ``param``."""
    if value is None:
        return None
    seconds: float | None = None
    try:
        seconds = float(value)
    except ValueError:
        try:
            moment = datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            raise APIError(400, f"{param}: not unix seconds or an ISO 8601 time: {value[:64]!r}", param=param) \
                from None
        seconds = (moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)).timestamp()
    if not 0 <= seconds <= LATEST:  # NaN fails this too
        raise APIError(400, f"{param}: out of range (0 to {LATEST} unix seconds): {value[:64]!r}", param=param)
    return int(seconds)


@router.get("/usage", response_model=None, responses=error_responses(400, 401, 403, 404, 503))
async def usage(key: str | None = None, model: str | None = None, start: str | None = None, end: str | None = None,
                format: str = Query("json", pattern="^(json|csv)$"), key_name: str | None = Depends(api_key),
                state: ServerState = Depends(serving_state)):
    ledger = state.ledger
    if ledger is None:
        raise APIError(404, "The usage ledger is off on this server (usage_db = '').", code="ledger_disabled")
    if key_name is not None and not state.tenants.is_admin(key_name):
        if key is not None and key != key_name:
            raise APIError(403, "This key may read only its own usage (an admin key reads every key's).",
                           "permission_error", param="key")
        key = key_name
    begin, until = _time(start, "start"), _time(end, "end")

    def read() -> list[dict]:
        ledger.flush()  # what the writer has not written yet, too
        return ledger.query(key, model, begin, until)
    rows = await asyncio.to_thread(read)
    if format == "csv":
        out = io.StringIO()
        writer = csv.DictWriter(out, COLUMNS, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
        return Response(out.getvalue(), media_type="text/csv")
    totals = {name: sum(row[name] for row in rows) for name in COUNTS}
    totals["cost_usd"] = ledger.cost(totals["engine_seconds"])
    return {"object": "list", "data": rows, "totals": totals}
