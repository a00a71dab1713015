"""Clients for the two servers scripts/test-server.sh starts (see its header)."""

import os

import anthropic
import openai
import pytest

DEMO_URL = os.environ.get("LILY_DEMO_URL", "")
SCRIPTED_URL = os.environ.get("LILY_SCRIPTED_URL", "")
SCRIPTED_KEY = os.environ.get("LILY_SCRIPTED_KEY", "")


def _need(url):
    if not url:
        pytest.fail("run through scripts/test-server.sh, which starts the servers")
    return url


@pytest.fixture
def demo():
    """The built-in demo model: random weights, so only greedy or seeded output is predictable."""
    return openai.OpenAI(base_url=_need(DEMO_URL) + "/v1", api_key="unused", max_retries=0)


@pytest.fixture
def scripted():
    """Scripted replies (tests/python/script.json) through the real parsers and SSE path."""
    return openai.OpenAI(base_url=_need(SCRIPTED_URL) + "/v1", api_key=SCRIPTED_KEY, max_retries=0)


@pytest.fixture
def scripted_async():
    return openai.AsyncOpenAI(base_url=_need(SCRIPTED_URL) + "/v1", api_key=SCRIPTED_KEY, max_retries=0)


@pytest.fixture
def claude_demo():
    """The demo model through the Anthropic client (POST /v1/messages)."""
    return anthropic.Anthropic(base_url=_need(DEMO_URL), api_key="unused", max_retries=0)


@pytest.fixture
def claude_scripted():
    """Scripted replies through the Anthropic client, which sends the key as `x-api-key`."""
    return anthropic.Anthropic(base_url=_need(SCRIPTED_URL), api_key=SCRIPTED_KEY, max_retries=0)
