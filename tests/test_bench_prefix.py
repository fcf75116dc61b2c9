"""bench_prefix runs the real engine with prefix sharing on and off and reports both (no timing asserted)."""

from __future__ import annotations

import io
import json

import pytest
from django.core.management import CommandError, call_command


def test_it_reports_ttft_with_sharing_on_and_off(tmp_path):
    out = tmp_path / "prefix.json"
    call_command("bench_prefix", "--requests", "2", "--json", str(out), stdout=io.StringIO())
    result = json.loads(out.read_text())
    assert result["requests"] == 2 and len(result["ttft_ms_on"]) == len(result["ttft_ms_off"]) == 2
    assert result["shared_prefix_tokens"] > 500 and result["prompt_tokens"] > result["shared_prefix_tokens"]
    assert result["ttft_p50_ms_on"] > 0 and result["ttft_p50_ms_off"] > 0


def test_it_refuses_bad_arguments(tmp_path):
    with pytest.raises(CommandError, match="at least 2"):
        call_command("bench_prefix", "--requests", "1", stdout=io.StringIO())
    with pytest.raises(CommandError, match="does not exist"):
        call_command("bench_prefix", "--json", str(tmp_path / "no" / "x.json"), stdout=io.StringIO())
