"""Scoring kiln models with lm-evaluation-harness (`pip install 'kiln[eval]'`): the harness's
model interface over a kiln model (`harness.py`), the forward passes it runs (`runner.py`), task
names and scores (`tasks.py`), and the held-out data `kiln eval` reads (`data.py`)."""
