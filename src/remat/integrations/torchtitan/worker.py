"""``python -m remat.integrations.torchtitan.worker REQUEST.pkl RESULT.json``: the planning process of Note [Plan in a
process of its own] (remat.integrations.torchtitan.policy): reads a pickled :class:`PlanRequest`, writes the plan (or
the error: its type, message and numbers) as JSON."""

from __future__ import annotations

import json
import pickle
import sys
from pathlib import Path

from remat.errors import InfeasibleBudgetError, RematError


def main(given: str, back: str) -> int:
    from remat.integrations.torchtitan.planning import plan_run

    req = pickle.loads(Path(given).read_bytes())
    try:
        result = {"plan": plan_run(req).to_dict()}
    except InfeasibleBudgetError as e:
        result = {"error": type(e).__name__, "message": str(e), "budget_bytes": e.budget_bytes,
                  "min_feasible_bytes": e.min_feasible_bytes}
    except RematError as e:
        result = {"error": type(e).__name__, "message": str(e)}
    Path(back).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
