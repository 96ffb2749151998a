"""Test-side code that changes what kiln runs, installed by the tests from the outside: the
mutations (mutations.py) and the CPU shared-memory collectives (accelerator.py and the
shared_memory_* modules). kiln itself reads no test switch (docs/architecture.md)."""
