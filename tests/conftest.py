import pytest

from tiny_gguf import write_tiny_gguf


@pytest.fixture(autouse=True)
def dflash_home(tmp_path_factory, monkeypatch):
    """Every test converts into its own cache folder, never the user's."""
    home = tmp_path_factory.mktemp("dflash-home")
    monkeypatch.setenv("DFLASH_HOME", str(home))
    return home


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf")
