"""docs/scaling.md states the planner's numbers: it is the planner's output, so it cannot drift
from the model. After changing the model, regenerate it:

    .venv/bin/python -m kiln.plan.guide > docs/scaling.md
"""

import pytest

from kiln.cli import main
from kiln.plan.guide import render
from tests.conftest import REPO


def test_the_scaling_guide_is_the_planner_s_current_output():
    written = (REPO / "docs" / "scaling.md").read_text()
    assert written == render(), (
        "docs/scaling.md is out of date with kiln/plan/: run "
        "`.venv/bin/python -m kiln.plan.guide > docs/scaling.md`"
    )


def test_kiln_plan_help_ends_with_a_sentence_naming_this_guide(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    ending = " ".join(capsys.readouterr().out.split()[-20:])
    assert ending.endswith(
        "Guide: docs/scaling.md in the kiln repository. It gives every estimate's terms and its "
        "error against published runs."
    ), ending
