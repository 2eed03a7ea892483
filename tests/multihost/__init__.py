"""Tests on the multi-host bed. A package so that its conftest is ``multihost.conftest`` and
does not take the name ``conftest`` from tests/conftest.py, whose helpers the other tests
import by that name."""
