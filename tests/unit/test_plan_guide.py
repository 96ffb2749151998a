"""docs/scaling.md states the planner's numbers: it is the planner's output, so it cannot drift
from the model. After changing the model, regenerate it:

    .venv/bin/python -m kiln.plan.guide > docs/scaling.md
"""

from kiln.plan.guide import render
from tests.conftest import REPO


def test_the_scaling_guide_is_the_planner_s_current_output():
    written = (REPO / "docs" / "scaling.md").read_text()
    assert written == render(), (
        "docs/scaling.md is out of date with kiln/plan/: run "
        "`.venv/bin/python -m kiln.plan.guide > docs/scaling.md`"
    )
