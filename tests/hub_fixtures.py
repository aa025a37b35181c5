"""Pytest fixtures that point huggingface_hub at the local test Hub (tests/hub_server.py).

Register with `pytest_plugins = ["hub_fixtures"]` in tests/conftest.py (or import the fixtures).

huggingface_hub reads its endpoint, cache paths and switches once, at import, into `huggingface_hub.constants`
(and a module-level `HfApi` keeps its own endpoint), so setting `HF_ENDPOINT` in a test is not enough: the
fixtures patch those constants too, with a fresh HF_HOME per test, and restore everything afterwards.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest

try:  # imported as `tests.hub_fixtures` or as top-level `hub_fixtures`
    from .hub_server import HubServer, free_closed_port
except ImportError:
    from hub_server import HubServer, free_closed_port

# Variables that would leak the developer's own Hub setup (token, offline switch, proxies) into a test.
_CLEARED_ENV = (
    "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_TOKEN_PATH", "HF_OIDC_RESOURCE", "HF_OIDC_ID_TOKEN",
    "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_DISABLE_IMPLICIT_TOKEN", "HUGGINGFACE_CO_STAGING",
    "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy",
)  # fmt: skip


def point_hub_at(monkeypatch: pytest.MonkeyPatch, endpoint: str, home: Path) -> None:
    """Make huggingface_hub talk to `endpoint` and keep its cache, token and state files under `home`."""
    import huggingface_hub
    from huggingface_hub import constants
    from huggingface_hub.utils import _detect_agent, _http

    endpoint = endpoint.rstrip("/")
    hub_cache = home / "hub"
    for name in _CLEARED_ENV:
        monkeypatch.delenv(name, raising=False)
    env = {
        "HF_ENDPOINT": endpoint,
        "HF_HOME": str(home),
        "HF_HUB_CACHE": str(hub_cache),
        "HF_HUB_DISABLE_XET": "1",  # else uploads go to a Xet CAS service the test Hub does not have
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HUB_DISABLE_UPDATE_CHECK": "1",
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)

    patched = {
        "ENDPOINT": endpoint,
        "HUGGINGFACE_CO_URL_TEMPLATE": endpoint + "/{repo_id}/resolve/{revision}/{filename}",
        "HF_URL_HOSTS": constants.HF_URL_HOSTS | {urlsplit(endpoint).hostname},
        "HF_HOME": str(home),
        "default_cache_path": str(hub_cache),
        "HUGGINGFACE_HUB_CACHE": str(hub_cache),
        "HF_HUB_CACHE": str(hub_cache),
        "default_assets_cache_path": str(home / "assets"),
        "HUGGINGFACE_ASSETS_CACHE": str(home / "assets"),
        "HF_ASSETS_CACHE": str(home / "assets"),
        "HF_TOKEN_PATH": str(home / "token"),
        "HF_STORED_TOKENS_PATH": str(home / "stored_tokens"),
        "CHECK_FOR_UPDATE_DONE_PATH": str(home / ".check_for_update_done"),
        "CHECK_FOR_SKILL_UPDATE_DONE_PATH": str(home / ".check_for_skill_update_done"),
        "AGENT_HARNESSES_PATH": str(home / ".agent_harnesses.json"),
        "default_xet_cache_path": str(home / "xet"),
        "HF_XET_CACHE": str(home / "xet"),
        "HF_HUB_OFFLINE": False,
        "HF_HUB_DISABLE_XET": True,
        "HF_HUB_DISABLE_TELEMETRY": True,
        "HF_HUB_DISABLE_UPDATE_CHECK": True,
        "HF_HUB_DISABLE_IMPLICIT_TOKEN": False,
    }
    for name, value in patched.items():
        if hasattr(constants, name):
            monkeypatch.setattr(constants, name, value)
    # `huggingface_hub.create_repo` & co. are bound methods of one HfApi built at import with the old endpoint.
    monkeypatch.setattr(huggingface_hub.hf_api.api, "endpoint", endpoint)
    # Redirects to these origins keep the Authorization header (the CDN origin of the test Hub is not among them).
    split = urlsplit(endpoint)
    origin = (split.scheme, split.hostname, split.port or {"http": 80, "https": 443}[split.scheme])
    monkeypatch.setattr(_http, "_HUB_ORIGINS", _http._HUB_ORIGINS | {origin})
    # The user-agent builder fetches an "AI agent" registry from {ENDPOINT} once per process: pin it empty.
    monkeypatch.setattr(_detect_agent, "_registry", {"standardEnvVars": [], "harnesses": {}})
    # The shared HTTP client pools connections per origin: start and end each test with a fresh one.
    _http.close_session()


@pytest.fixture
def hub_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[HubServer]:
    """A running test Hub with huggingface_hub pointed at it and a fresh, empty cache under `tmp_path/hf_home`.

    `hub_server.write_token` may write to the `hub_server.user` and `hub_server.org` namespaces; `read_token` only
    reads; `other_user_token` belongs to another user. `hub_server.stop()` makes the Hub unreachable mid-test.
    """
    server = HubServer().start()
    point_hub_at(monkeypatch, server.url, tmp_path / "hf_home")
    try:
        yield server
    finally:
        server.stop()
        from huggingface_hub.utils import _http

        _http.close_session()


@pytest.fixture
def unreachable_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """huggingface_hub pointed at a closed loopback port (network down); yields that endpoint."""
    endpoint = f"http://127.0.0.1:{free_closed_port()}"
    point_hub_at(monkeypatch, endpoint, tmp_path / "hf_home")
    yield endpoint
    from huggingface_hub.utils import _http

    _http.close_session()


@pytest.fixture
def retry_waits(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The waits of half a second or more that anything asks `time.sleep` for during the test: recorded and not
    slept (shorter ones sleep). huggingface_hub's and datasets' retries back off with `time.sleep`, so a test that a
    failure comes without retries asserts this list is empty, instead of timing the call (a busy machine can make a
    call without any retry slow, and a timed check fail: issue 39)."""
    import time

    real_sleep, waits = time.sleep, []

    def sleep(seconds: float) -> None:
        if seconds >= 0.5:
            waits.append(seconds)
        else:
            real_sleep(seconds)

    monkeypatch.setattr(time, "sleep", sleep)
    return waits
