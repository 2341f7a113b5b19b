"""The CLI front door: listings, JSON on stdout, one-line errors with exit 2."""

from __future__ import annotations

import json

from conftest import assert_one_line_error, run_cli


def test_models_json_lists_presets_with_counts():
    p = run_cli("models", "--json")
    assert p.returncode == 0
    data = json.loads(p.stdout)
    by_name = {m["name"]: m for m in data["models"]}
    assert by_name["llama2-70b"]["num_parameters"] == 68_976_648_192


def test_hardware_table():
    p = run_cli("hardware")
    assert p.returncode == 0 and "dgx-h100" in p.stdout and "h200-141gb" in p.stdout


def test_unknown_preset_one_line(tmp_path):
    p = run_cli("profile", "--model", "gpt3-175", "--device", "meta")
    assert_one_line_error(p, "unknown model preset", "gpt3-175b")
    assert p.returncode == 2


def test_yaml_tag_is_refused_not_run(write, tmp_path):
    marker = tmp_path / "pwned"
    path = write("evil.yaml", f"!!python/object/apply:os.system ['touch {marker}']\n")
    p = run_cli("profile", "--model", path)
    assert_one_line_error(p, "refused YAML tag")
    assert not marker.exists()


def test_usage_error_is_one_line():
    p = run_cli("simulate", "--model", "gpt-tiny")
    assert_one_line_error(p, "required")
    assert p.returncode == 2
