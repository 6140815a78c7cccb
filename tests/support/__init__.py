"""Helpers shared by the test tiers (unit/, integration/, e2e/), imported as `support.<module>`:
pytest puts tests/ on sys.path (tests/conftest.py is not in a package), and every test
directory below it is a package, so test modules are `unit.…`, `integration.…`, `e2e.…`."""
