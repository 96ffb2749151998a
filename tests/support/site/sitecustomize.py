"""Imported by Python at start-up where this folder is on PYTHONPATH (the tests put it there with
`tests.support.mutations.subprocess_env`): installs the mutation KILN_TEST_MUTATION names in
this process, so a run torchrun or `kiln verify` starts carries it too."""

import os

if os.environ.get("KILN_TEST_MUTATION"):
    from tests.support.mutations import install_from_env

    install_from_env()
