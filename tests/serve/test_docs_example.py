"""The serving guide's Python example runs against a live server (its address swapped for the
test server's) and prints real replies."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

from conftest import start_server

PAGE = Path(__file__).resolve().parents[2] / "docs" / "guide" / "10-serving.md"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)


def test_the_serving_guide_python_example_runs(served_llm: Any, capsys: Any) -> None:
    blocks = BLOCK.findall(PAGE.read_text())
    assert blocks, "the serving guide has no Python example"
    with start_server(served_llm) as server:  # no --api-key: any key is accepted, as the guide says
        namespace: dict[str, Any] = {"__name__": "serving_guide_example"}
        for code in blocks:
            exec(compile(code.replace("http://127.0.0.1:8000", server.url), str(PAGE), "exec"), namespace)
        if "main" in namespace:  # the guide defines the async example as main()
            asyncio.run(namespace["main"]())
    printed = capsys.readouterr().out
    assert "CompletionUsage" in printed and "completion_tokens=" in printed, printed
    assert len(printed.strip()) > 20, printed


STRUCTURED = PAGE.parent / "13-structured-outputs.md"


def test_the_structured_outputs_guide_server_example_runs(served_llm: Any, capsys: Any) -> None:
    """Its server block (an OpenAI client on 127.0.0.1:8000) against the test server: the JSON
    reply parses with the schema's keys, the choice is one of the two."""
    import json

    blocks = [b for b in BLOCK.findall(STRUCTURED.read_text()) if 'OpenAI(base_url="http://127.0.0.1:8000' in b]
    assert blocks, "the structured outputs guide has no server example"
    with start_server(served_llm) as server:
        for code in blocks:
            exec(compile(code.replace("http://127.0.0.1:8000", server.url), str(STRUCTURED), "exec"),
                 {"__name__": "structured_guide_example"})
    person, sentiment = capsys.readouterr().out.strip().splitlines()[-2:]
    assert {"name", "age"} <= set(json.loads(person)) and sentiment in ("positive", "negative")
