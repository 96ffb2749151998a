"""Test-side code that changes what kiln runs, installed by the tests from the outside (the
mutations, mutations.py): kiln itself reads no test switch (docs/architecture.md)."""
