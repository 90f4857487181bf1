"""The Argo CD GRPOJob health check (deploy/argocd/grpojob-health.lua) on a real Lua 5.1.

Argo CD runs resource customizations in gopher-lua (Lua 5.1) with the object as the global
`obj`; lupa's bundled Lua 5.1 runs the same file here against the status fixtures in
tests/fixtures/argocd/, whose expected results use Argo CD's own health_test.yaml format.
"""

from pathlib import Path
from typing import Any

import pytest
import yaml
from grpo_operator.api.status import GRPOJobStatus, Phase
from lupa import lua51

ROOT = Path(__file__).resolve().parents[2]
LUA_FILE = ROOT / "deploy" / "argocd" / "grpojob-health.lua"
CM_PATCH = ROOT / "deploy" / "argocd" / "argocd-cm-health.yaml"
FIXTURES = ROOT / "tests" / "fixtures" / "argocd"
CASES = yaml.safe_load((FIXTURES / "health_test.yaml").read_text())["tests"]
ARGO_HEALTH = {"Healthy", "Progressing", "Degraded", "Suspended", "Missing", "Unknown"}


def _to_lua(lua: Any, value: Any) -> Any:
    """Python data → Lua tables the way Argo CD hands JSON to Lua (lists 1-indexed)."""
    if isinstance(value, dict):
        return lua.table_from({k: _to_lua(lua, v) for k, v in value.items()})
    if isinstance(value, list):
        return lua.table_from([_to_lua(lua, v) for v in value])
    return value


def health(obj: dict[str, Any]) -> dict[str, str]:
    lua = lua51.LuaRuntime(unpack_returned_tuples=True)
    lua.globals().obj = _to_lua(lua, obj)
    result = lua.execute(LUA_FILE.read_text())
    return dict(result.items())


@pytest.mark.parametrize("case", CASES, ids=[c["inputPath"].removesuffix(".yaml") for c in CASES])
def test_fixture_health(case: dict[str, Any]) -> None:
    obj = yaml.safe_load((FIXTURES / case["inputPath"]).read_text())
    assert health(obj) == case["healthStatus"]


def test_every_phase_has_a_fixture_and_a_valid_health() -> None:
    covered = {}
    for case in CASES:
        obj = yaml.safe_load((FIXTURES / case["inputPath"]).read_text())
        phase = (obj.get("status") or {}).get("phase")
        covered[phase] = case["healthStatus"]["status"]
        assert case["healthStatus"]["status"] in ARGO_HEALTH
    assert {p.value for p in Phase} <= set(covered)
    assert None in covered, "an object the operator has not reconciled yet needs a fixture"
    assert covered[Phase.FAILED.value] == "Degraded"
    assert covered[Phase.SUSPENDED.value] == "Suspended"
    assert covered[Phase.SUCCEEDED.value] == "Healthy"


def test_status_fixtures_are_valid_status_objects() -> None:
    """Fixtures use the real status field names, so a renamed field breaks this test, not Argo CD."""
    for case in CASES:
        obj = yaml.safe_load((FIXTURES / case["inputPath"]).read_text())
        status = obj.get("status")
        if status is None or status.get("phase") not in {p.value for p in Phase}:
            continue
        GRPOJobStatus.model_validate(status)


def test_argocd_cm_patch_embeds_the_same_lua() -> None:
    data = yaml.safe_load(CM_PATCH.read_text())["data"]
    assert list(data) == ["resource.customizations.health.grpo.dev_GRPOJob"]
    assert data["resource.customizations.health.grpo.dev_GRPOJob"] == LUA_FILE.read_text()


def test_check_never_raises_on_odd_objects() -> None:
    """Argo CD marks a resource Unknown with an error when the script raises: never do that."""
    for status in ({}, {"phase": "Running", "conditions": []}, {"phase": "Restarting"}, {"phase": "Failed"}):
        result = health({"metadata": {}, "status": status})
        assert result["status"] in ARGO_HEALTH
        assert isinstance(result["message"], str)
