import pytest

from tools.testbed.corpus import load_corpus


@pytest.fixture(scope="session")
def corpus():
    """The committed corpus' rows (checked against their pin), read once."""
    return load_corpus()
