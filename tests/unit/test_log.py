"""kiln.log: one logger whose lines read `kiln: <message>`, set up once, root logger untouched."""

import ast
import logging
from pathlib import Path

import kiln
from kiln import log


def test_messages_read_as_before_on_the_stream_of_the_moment(capsys):
    log.warn("checkpoint.resume = 'force': continuing")
    log.info("building the demo corpus")
    log.info("resumed from run/checkpoints/step_00000004 (step 4)", stdout=True)
    captured = capsys.readouterr()
    assert captured.err == (
        "kiln: checkpoint.resume = 'force': continuing\nkiln: building the demo corpus\n"
    )
    assert captured.out == "kiln: resumed from run/checkpoints/step_00000004 (step 4)\n"


def test_the_handler_is_added_once_and_the_root_logger_is_left_alone(capsys):
    root_handlers = list(logging.getLogger().handlers)
    for _ in range(3):
        log.logger()
    log.warn("once")
    assert capsys.readouterr().err == "kiln: once\n"
    # pytest attaches its own capture handlers to non-propagating loggers: count kiln's.
    ours = [h for h in log.logger().handlers if isinstance(h, log._StreamOfTheMoment)]
    assert len(ours) == 1 and not log.logger().propagate
    assert logging.getLogger().handlers == root_handlers


def test_the_logger_is_the_bottom_layer():
    tree = ast.parse((Path(kiln.__file__).parent / "log.py").read_text())
    modules = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    modules += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert not [m for m in modules if m and m.startswith("kiln")], modules
